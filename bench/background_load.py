"""The background-load scenario (issue 14): a box loses half its CPU in the middle of a run.

    python -m xronos.bench.background_load [--blocks 2] [--steps 45] [--change-at 15] [--share 0.5]
        [--variant quota|hog|both] [--out bench/results/background_load]

Three emulated boxes (cgroup CPU quotas of `--share` cores each, one thread per rank) fine-tune a
GPT-2-Medium-shaped classifier (hidden 1024, 16 heads, 4096 MLP columns, 50257 vocabulary rows;
`--blocks` of its 24 blocks) from the even layout their equal speeds call for. At the boundary
before step `--change-at` box 0 loses half its CPU:
  quota  its cgroup's quota is halved (`Confinement.set_share`);
  hog    a CPU-hungry process starts inside its cgroup (the box's own day job).
Each variant runs twice, side by side: static (the plan stays) and live (`--rebalance`'s policy on
rank 0 re-plans and re-shards). Reported per run: the iteration time (the slowest rank's) before
the change and after it, its ratio to the new ideal bound (estimated as before x the total CPU
before / after: compute-bound, balanced before), the iterations from the change until the
iteration time stays within 1.10x that bound, and each re-shard's time against an iteration's.
Timings on a shared machine are provisional: the load (`os.getloadavg`) is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from xronos.bench.workloads import shape_config, write_checkpoint, write_dataset
from xronos.node.emulator import Confinement, RankLimits
from xronos.node.launch import spawn_ranks
from xronos.protocol.layout import QUANTA, Layout, Sizes

RANKS = 3
RECOVERED = 1.10


def even_layout(sizes: Sizes, n: int) -> Layout:
    def split(w: int) -> list[int]:
        return [w // n + (1 if r < w % n else 0) for r in range(n)]

    return Layout.from_quanta(split(sizes.attn), split(sizes.quanta("mlp")), split(sizes.quanta("vocab")), sizes,
                              QUANTA)


def run_one(model: Path, data: Path, layout: Layout, args, *, live: bool, variant: str, work: Path) -> dict:
    from xronos.bench.bgload_worker import BgRankConfig

    signal = work / f"{variant}-{'live' if live else 'static'}"
    signal.mkdir(parents=True)
    cfg = BgRankConfig(model_dir=str(model), data_path=str(data), task="classify", layout=layout,
                       batch_size=args.batch_size, seq_len=args.seq_len, lr=1e-4, max_steps=args.steps,
                       seed=0, dropout=0.0, metrics_path=str(signal / "metrics.json"), progress=False,
                       live=live, signal_dir=str(signal), change_at=args.change_at)
    hog: subprocess.Popen | None = None
    with Confinement([RankLimits(args.share)] * RANKS, top_weight=True) as conf:
        failed: list[BaseException] = []

        def launch() -> None:
            try:
                spawn_ranks("xronos.bench.bgload_worker", [cfg] * RANKS, conf.wrap, threads=1, timeout_s=3600)
            except BaseException as exc:  # reported by the main thread
                failed.append(exc)

        t = threading.Thread(target=launch)
        t.start()
        while t.is_alive() and not (signal / "change").exists():
            time.sleep(0.005)
        if (signal / "change").exists():
            if variant == "quota":
                conf.set_share(0, args.share / 2)
            else:
                hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                conf.add(0, hog.pid)
            (signal / "applied").write_text(str(time.time()))
        t.join()
        if hog is not None:
            hog.kill()
            hog.wait()
    if failed:
        raise failed[0]
    return json.loads((signal / "metrics.json").read_text())


def summarize(doc: dict, change_at: int) -> dict:
    ranks = doc["ranks"]
    steps = len(ranks[0]["iterations"])
    it = [max(r["iterations"][s]["iteration_s"] for r in ranks) for s in range(steps)]
    before = statistics.median(it[max(1, change_at - 10):change_at])
    ideal = before * RANKS / (RANKS - 0.5)  # the boxes CPU: 3 x share before, 2.5 x share after
    replans = (doc.get("rebalance") or {}).get("replans", [])
    settled = max([r["step"] for r in replans], default=change_at) + 3
    after = statistics.median(it[min(settled, steps - 3):])
    # Recovered: the first iteration within the bound whose next three are too (their median: one
    # noisy iteration does not undo it).
    bound = RECOVERED * ideal
    recovered = next((s - change_at for s in range(change_at, steps - 2)
                      if it[s] <= bound and statistics.median(it[s:s + 3]) <= bound), None)
    moves = doc.get("reshards", [])
    return {
        "before_s": before, "after_s": after, "ideal_after_s": ideal, "after_over_ideal": after / ideal,
        "iterations_to_recover": recovered, "replans": replans, "last_reason": (doc.get("rebalance") or {}).get("last_reason"),
        # the policy's own cost per boundary (gather, decide, broadcast) over the iteration time
        "boundary_over_iteration": (doc["rebalance"]["boundary_s_mean"] / before) if doc.get("rebalance") else None,
        "reshards": [{"step": m["step"], "seconds": m["seconds"], "moved_bytes": m["moved_bytes"],
                      "over_iteration": m["seconds"] / before, "new": m["new"]} for m in moves],
        "iteration_s": it,
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f} %"


def table(results: dict) -> str:
    lines = ["| variant | plan | before s | after s | after / ideal | iterations to <= 1.10x ideal | re-shards "
             "(s, x an iteration) | policy per boundary |", "|---|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        variant, mode = key.split("/")
        rec = "never" if r["iterations_to_recover"] is None else str(r["iterations_to_recover"])
        moves = ", ".join(f"{m['seconds']:.2f} s ({m['over_iteration']:.1f}x) at {m['step']}" for m in r["reshards"]) or "-"
        lines.append(f"| {variant} | {mode} | {r['before_s']:.3f} | {r['after_s']:.3f} | {r['after_over_ideal']:.2f} "
                     f"| {rec} | {moves} | {_pct(r.get('boundary_over_iteration'))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xronos.bench.background_load", description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--steps", type=int, default=45)
    p.add_argument("--change-at", type=int, default=15)
    p.add_argument("--share", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--variant", choices=["quota", "hog", "both"], default="both")
    p.add_argument("--out", default="bench/results/background_load")
    args = p.parse_args(argv)
    if not 1 <= args.change_at < args.steps - 5:
        raise SystemExit(f"--change-at must be in [1, {args.steps - 6}]")
    config = shape_config("gpt2-medium", args.blocks)
    with tempfile.TemporaryDirectory(prefix="xronos-bgload-") as tmp:
        work = Path(tmp)
        model = write_checkpoint(work / "model", config)
        data = write_dataset(work / "data.jsonl", args.batch_size * args.steps + 8, args.seq_len,
                             config["vocab_size"])
        from xronos.node.validate import model_sizes

        layout = even_layout(model_sizes(str(model)), RANKS)
        load = {"loadavg_before": os.getloadavg()}
        results = {}
        for variant in (["quota", "hog"] if args.variant == "both" else [args.variant]):
            for live in (False, True):  # side by side: the same cell, static then live
                doc = run_one(model, data, layout, args, live=live, variant=variant, work=work)
                results[f"{variant}/{'live' if live else 'static'}"] = summarize(doc, args.change_at)
                print(f"{variant} {'live' if live else 'static'}: done", file=sys.stderr, flush=True)
        load["loadavg_after"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": "gpt2-medium", "blocks": args.blocks, "ranks": RANKS, "share": args.share,
            "change_at": args.change_at, "steps": args.steps, "batch_size": args.batch_size,
            "seq_len": args.seq_len, "start_layout": layout.to_text(), **load}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    text = (f"# Background load: box 0 loses half its CPU at step {args.change_at}\n\n"
            f"GPT-2-Medium shapes ({args.blocks} blocks, classify), {RANKS} ranks at {args.share} cores each, "
            f"batch {args.batch_size} x {args.seq_len}, start layout {layout.describe()}; "
            f"load average {load['loadavg_before'][0]:.1f} before, {load['loadavg_after'][0]:.1f} after "
            f"(provisional: a shared machine).\n\n{table(results)}\n")
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
