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
the change and after it (the median of the iterations from 3 after the last re-shard, or after
the change), and its ratio to the *measured* new ideal bound; the iterations from the change
until the iteration time stays within 1.10x that bound; each re-shard's time in seconds and in
iterations (over the run's iteration time after the change).

The bound (`measured_bound`) is the grid's measured ideal (`xronos.bench.results.measured_ideal`)
over the boxes as they are after the change: every rank's per-kind compute (median over the
iterations of one layout, from the second iteration after the change, and after a re-shard)
in both runs of the variant — the static run's layout and the live run's layouts before and after
its move, two or three counts per rank — fitted per rank and kind as a + b x (the replicated part
and the slope; the rest as r + c P, P the parameters held), then balanced per kind in whole heads;
plus each run's own median communication and data time after the change. A lower bound an integer
layout can reach, not an estimate from the time before the change.
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

from xronos.bench.results import _balance, _balance_integer, _fits
from xronos.bench.workloads import kind_parameters, shape_config, write_checkpoint, write_dataset
from xronos.node.emulate.confinement import Confinement, RankLimits
from xronos.node.rank.local import spawn_ranks
from xronos.protocol.layout import QUANTA, Layout, Sizes
from xronos.protocol.recipe import Recipe

RANKS = 3
RECOVERED = 1.10
KINDS = ("attn", "mlp", "vocab")


def even_layout(sizes: Sizes, n: int) -> Layout:
    def split(w: int) -> list[int]:
        return [w // n + (1 if r < w % n else 0) for r in range(n)]

    return Layout.from_quanta(split(sizes.attn), split(sizes.quanta("mlp")), split(sizes.quanta("vocab")), sizes,
                              QUANTA)


def run_one(model: Path, data: Path, layout: Layout, args, *, live: bool, variant: str, work: Path,
            shares: list[float] | None = None, steps: int | None = None, tag: str = "") -> dict:
    """One run of `bgload_worker` ranks in cgroups (`shares`, default `--share` each). `variant`:
    quota / hog change box 0 at `--change-at`; steady changes nothing."""
    from xronos.bench.bgload_worker import BgRankConfig

    shares = shares or [args.share] * RANKS
    steps = steps or args.steps
    steady = variant == "steady"
    signal = work / f"{variant}-{'live' if live else 'static'}{tag}"
    signal.mkdir(parents=True)
    recipe = Recipe(model_dir=str(model), data_path=str(data), task="classify", batch_size=args.batch_size,
                    seq_len=args.seq_len, lr=1e-4, max_steps=steps, seed=0, dropout=0.0, eval_fraction=0.0,
                    max_grad_norm=None)
    cfg = BgRankConfig(recipe=recipe, layout=layout, metrics_path=str(signal / "metrics.json"), progress=False,
                       live=live, signal_dir=str(signal), change_at=steps + 1 if steady else args.change_at)
    hog: subprocess.Popen | None = None
    with Confinement([RankLimits(s) for s in shares], top_weight=True) as conf:
        failed: list[BaseException] = []

        def launch() -> None:
            try:
                spawn_ranks("xronos.bench.bgload_worker", [cfg] * len(shares), conf.wrap, threads=1, timeout_s=3600)
            except BaseException as exc:  # reported by the main thread
                failed.append(exc)

        t = threading.Thread(target=launch)
        t.start()
        while not steady and t.is_alive() and not (signal / "change").exists():
            time.sleep(0.005)
        if (signal / "change").exists():
            if variant == "quota":
                conf.set_share(0, shares[0] / 2)
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


# -- the measured bound after the change (pure) -------------------------------------------------
def layout_at(start: Layout, reshards: list[dict], step: int) -> Layout:
    """The layout iteration `step` ran under (re-shards apply before their step)."""
    lay = start
    for m in sorted(reshards, key=lambda m: m["step"]):
        if m["step"] <= step:
            lay = Layout.parse(m["new"])
    return lay


def segments(doc: dict, start: Layout, change_at: int) -> list[tuple[Layout, list[int]]]:
    """The iterations after the change grouped by layout, each group without its first iteration
    (the change's or the move's own boundary: a transient) — (layout, indices into iterations)."""
    its = doc["ranks"][0]["iterations"]
    groups: list[tuple[Layout, list[int]]] = []
    for i, rec in enumerate(its):
        if rec["step"] < change_at:
            continue
        lay = layout_at(start, doc.get("reshards", []), rec["step"])
        if groups and groups[-1][0] == lay:
            groups[-1][1].append(i)
        else:
            groups.append((lay, [i]))
    return [(lay, idx[1:]) for lay, idx in groups if len(idx) > 1]


def measured_bound(docs: list[dict], start: Layout, change_at: int, kind_params: dict[str, int]) -> dict:
    """The compute time the boxes after the change allow at best (see the module docstring):
    {per_kind_s, compute_s (continuous), compute_whole_heads_s, points}."""
    ranks = len(docs[0]["ranks"])
    totals = {k: sum(getattr(start, k)) for k in KINDS}
    per_unit = {k: kind_params[k] / totals[k] for k in KINDS}
    pts: dict[str, list[list[tuple[float, float]]]] = {k: [[] for _ in range(ranks)] for k in (*KINDS, "rest")}
    for doc in docs:
        for lay, idx in segments(doc, start, change_at):
            for d in range(ranks):
                its = [doc["ranks"][d]["iterations"][i] for i in idx]
                for k in KINDS:
                    pts[k][d].append((getattr(lay, k)[d], statistics.median(x[f"compute_{k}_s"] for x in its)))
                held = sum(per_unit[k] * getattr(lay, k)[d] for k in KINDS)
                pts["rest"][d].append((held, statistics.median(x["compute_rest_s"] for x in its)))
    out: dict = {"per_kind_s": {}, "points": pts}
    for k in KINDS:
        fits = _fits(pts[k])
        out["per_kind_s"][k] = _balance(fits, totals[k])
        if k == "attn":
            out["attn_whole_units_s"] = _balance_integer(fits, totals[k])
    out["per_kind_s"]["rest"] = _balance(_fits(pts["rest"]), sum(kind_params[k] for k in KINDS))
    out["compute_s"] = sum(out["per_kind_s"].values())
    out["compute_whole_heads_s"] = out["compute_s"] - out["per_kind_s"]["attn"] + out["attn_whole_units_s"]
    return out


def summarize(doc: dict, change_at: int, bound_compute_s: float) -> dict:
    """One run against the measured bound's compute (`measured_bound`): the run's ideal iteration
    is that plus its own median communication and data time after the change."""
    ranks = doc["ranks"]
    steps = len(ranks[0]["iterations"])
    it = [max(r["iterations"][s]["iteration_s"] for r in ranks) for s in range(steps)]
    before = statistics.median(it[max(1, change_at - 10):change_at])
    replans = (doc.get("rebalance") or {}).get("replans", [])
    moves = doc.get("reshards", [])
    settled = max([m["step"] for m in moves], default=change_at) + 3
    tail = range(min(settled, steps - 3), steps)
    after = statistics.median(it[s] for s in tail)
    extra = statistics.median(ranks[0]["iterations"][s]["comm_s"] + max(r["iterations"][s]["data_s"] for r in ranks)
                              for s in tail)
    ideal = bound_compute_s + extra
    # Recovered: the first iteration within the bound whose next three are too (their median: one
    # noisy iteration does not undo it).
    bound = RECOVERED * ideal
    recovered = next((s - change_at for s in range(change_at, steps - 2)
                      if it[s] <= bound and statistics.median(it[s:s + 3]) <= bound), None)
    reb = doc.get("rebalance") or {}
    return {
        "before_s": before, "after_s": after, "ideal_after_s": ideal, "after_over_ideal": after / ideal,
        "comm_data_after_s": extra, "iterations_to_recover": recovered, "replans": replans,
        "last_reason": reb.get("last_reason"),
        # rank 0's time per boundary over the iteration time: in the policy itself (observe,
        # decide) and in the whole boundary (the gather too, with its wait for the slowest rank)
        "policy_over_iteration": (reb["policy_s_mean"] / before) if "policy_s_mean" in reb else None,
        "boundary_over_iteration": (reb["boundary_s_mean"] / before) if "boundary_s_mean" in reb else None,
        "reshards": [{"step": m["step"], "seconds": m["seconds"], "moved_bytes": m["moved_bytes"],
                      "over_iteration": m["seconds"] / after, "new": m["new"]} for m in moves],
        "iteration_s": it,
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f} %"


def table(results: dict) -> str:
    lines = ["| variant | plan | before s | after s | ideal after s | after / ideal | iterations to <= 1.10x ideal "
             "| re-shards (s, x an iteration after) | policy per boundary (own / whole boundary) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        variant, mode = key.split("/")
        rec = "never" if r["iterations_to_recover"] is None else str(r["iterations_to_recover"])
        moves = ", ".join(f"{m['seconds']:.2f} s ({m['over_iteration']:.1f}x) at {m['step']}"
                          for m in r["reshards"]) or "-"
        cost = f"{_pct(r.get('policy_over_iteration'))} / {_pct(r.get('boundary_over_iteration'))}"
        lines.append(f"| {variant} | {mode} | {r['before_s']:.3f} | {r['after_s']:.3f} | {r['ideal_after_s']:.3f} "
                     f"| {r['after_over_ideal']:.2f} | {rec} | {moves} | {cost} |")
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
    p.add_argument("--cpu-mode", choices=("virtual", "quota", "pace"), default="virtual",
                   help="virtual clock (default: box 0's speed halves; no 'hog', which takes host CPU, not the "
                        "box's virtual time) or the wall clock under quotas or pacing")
    p.add_argument("--out", default="bench/results/background_load")
    args = p.parse_args(argv)
    from xronos.bench.command import cpu_mode

    with cpu_mode(args.cpu_mode):
        return _main(args)


def _main(args) -> int:
    if args.cpu_mode == "virtual" and args.variant == "hog":
        raise SystemExit("--variant hog: a process in box 0's cgroup takes host CPU, not box 0's virtual time; on "
                         "the virtual clock the change is box 0's speed (--variant quota), or use --cpu-mode quota")
    if not 1 <= args.change_at < args.steps - 5:
        raise SystemExit(f"--change-at must be in [1, {args.steps - 6}]")
    config = shape_config("gpt2-medium", args.blocks)
    with tempfile.TemporaryDirectory(prefix="xronos-bgload-") as tmp:
        work = Path(tmp)
        model = write_checkpoint(work / "model", config)
        data = write_dataset(work / "data.jsonl", args.batch_size * args.steps + 8, args.seq_len,
                             config["vocab_size"])
        from xronos.node.rank.validate import model_sizes

        layout = even_layout(model_sizes(str(model)), RANKS)
        load = {"loadavg_before": os.getloadavg()}
        results, bounds = {}, {}
        params = kind_parameters(config)
        both = ["quota"] if args.cpu_mode == "virtual" else ["quota", "hog"]
        for variant in (both if args.variant == "both" else [args.variant]):
            docs = {}
            for live in (False, True):  # side by side: the same cell, static then live
                docs[live] = run_one(model, data, layout, args, live=live, variant=variant, work=work)
                print(f"{variant} {'live' if live else 'static'}: done", file=sys.stderr, flush=True)
            bound = measured_bound(list(docs.values()), layout, args.change_at, params)
            bounds[variant] = {k: v for k, v in bound.items() if k != "points"}
            for live, doc in docs.items():
                results[f"{variant}/{'live' if live else 'static'}"] = summarize(doc, args.change_at,
                                                                                bound["compute_whole_heads_s"])
        load["loadavg_after"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": "gpt2-medium", "blocks": args.blocks, "ranks": RANKS, "share": args.share,
            "change_at": args.change_at, "steps": args.steps, "batch_size": args.batch_size,
            "seq_len": args.seq_len, "start_layout": layout.to_text(), "cpu_mode": args.cpu_mode,
            "clock": "virtual" if args.cpu_mode == "virtual" else "wall", **load}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "bounds": bounds, "results": results}, indent=1))
    bound_text = ", ".join(f"{v} {b['compute_whole_heads_s']:.3f} s" for v, b in bounds.items())
    text = (f"# Background load: box 0 loses half its CPU at step {args.change_at}\n\n"
            f"GPT-2-Medium shapes ({args.blocks} blocks, classify), {RANKS} ranks at {args.share} cores each, "
            f"batch {args.batch_size} x {args.seq_len}, start layout {layout.describe()}; "
            f"load average {load['loadavg_before'][0]:.1f} before, {load['loadavg_after'][0]:.1f} after "
            f"(provisional: a shared machine). Clock: **{meta['clock']}** (`--cpu-mode {args.cpu_mode}`"
            f"{': box 0 at half its speed' if args.cpu_mode == 'virtual' else ''}).\n\nIdeal after: the measured bound (per-rank, per-kind compute after "
            f"the change fitted over the static and live runs' layouts, balanced in whole heads: {bound_text}) plus "
            f"each run's median communication and data time after the change.\n\n{table(results)}\n")
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
