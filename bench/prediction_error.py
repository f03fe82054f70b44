"""Prediction error of per-node fine-tuning time, over real local runs on emulated heterogeneous boxes.

    .venv/bin/python -m xronos.bench.prediction_error [--models gpt2-medium,roberta-base]
        [--blocks 2] [--scenarios set-a,set-b] [--strategies segment] [--steps 10]
        [--malloc tuned|glibc] [--out FILE.json]

Every run is the real `xronos run --strategy S --cpu-shares ...`: each rank is profiled in its own
process inside its CPU cgroup (the paper's device speeds as CFS quotas, `bench/scenarios.py`),
the gateway planner picks the units, the ranks train over Gloo for `--steps` iterations, and each
rank's predicted compute time per iteration (cost model, Eq. 6-7 + affine fit) is compared with
its measured mean compute time (`compute_s`, first iteration excluded). Reported: MAPE over every
(run, rank) of the affine model and of the paper's linear-in-p model (the same profiles, the same
plans), as the paper's §V-C1 reports 15.32%. Model shapes are the paper's with `--blocks`
transformer blocks (full hidden size, heads, MLP width and vocabulary), batch 8, sequence 32
(CoLA), random weights, synthetic data; the profile cache is shared across runs, so a rank with a
share already profiled reuses its profile, as a node would.

`--malloc tuned` (the default, as `xronos.node.rank.local.rank_env` sets for every rank) runs profiles
and ranks with glibc's malloc never returning big blocks to the kernel (MALLOC_MMAP_MAX_=0,
MALLOC_TRIM_THRESHOLD_=64 GiB): tensors above glibc's 32 MiB mmap ceiling are otherwise mmapped
and page-faulted afresh every iteration, which makes wide layers superlinearly slow (and training
slower). `--malloc glibc` leaves glibc's own behaviour (XRONOS_MALLOC=glibc) for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BATCH, SEQ = 8, 32


def workload(root: Path, model: str, blocks: int, rows: int, seq: int) -> tuple[Path, Path]:
    """The checkpoint and a dataset: `minilm` is the demo's real pretrained MiniLM (all 6 blocks,
    `--blocks` ignored); any other name is a bench shape with `blocks` blocks and random weights."""
    from xronos.bench.workloads import shape_config, write_checkpoint, write_dataset

    if model == "minilm":
        from xronos.bench.tta import minilm_dir

        mdir = minilm_dir()
    else:
        mdir = root / f"{model}-b{blocks}"
        if not (mdir / "model.safetensors").is_file():
            write_checkpoint(mdir, shape_config(model, blocks))
    data = root / f"data-{model}-{rows}-{seq}.jsonl"
    if not data.is_file():
        vocab = json.loads((mdir / "config.json").read_text())["vocab_size"]
        write_dataset(data, rows, seq, vocab)
    return mdir, data


def run_one(mdir: Path, data: Path, shares: list[float], strategy: str, steps: int, work: Path,
            cache: Path, env: dict[str, str], seq: int = SEQ, link: tuple[float, float] | None = None,
            batch: int = BATCH) -> dict:
    metrics = work / "metrics.json"
    cmd = [sys.executable, "-m", "xronos.cli", "run", "--model", str(mdir), "--data", str(data),
           "--task", "classify", "--nodes", str(len(shares)), "--strategy", strategy,
           "--cpu-shares", ",".join(f"{s:g}" for s in shares), "--batch-size", str(batch),
           "--seq-len", str(seq), "--lr", "2e-5", "--max-steps", str(steps), "--seed", "0",
           "--max-grad-norm", "1.0", "--metrics", str(metrics), "--profile-cache", str(cache),
           "--export", str(work / "export")]
    if link is not None:
        cmd += ["--bandwidth-mbps", f"{link[0]:g}", "--latency-ms", f"{link[1]:g}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"xronos run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    doc = json.loads(metrics.read_text())
    pred = doc["prediction"]
    pred["wall_s"] = time.perf_counter() - t0
    pred["idle_ratio"] = [r["summary"]["idle_ratio"] for r in doc["ranks"]]
    pred["iteration_s"] = [r["summary"]["iteration_s"] for r in doc["ranks"]]
    return pred


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2-medium,roberta-base")
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--scenarios", default="set-a,set-b")
    ap.add_argument("--strategies", default="segment")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq-len", type=int, default=SEQ)
    ap.add_argument("--batch-size", type=int, default=BATCH)
    ap.add_argument("--link", default="100000,0", metavar="MBIT,MS",
                    help="the link the planner assumes (default 100000,0: the ranks share loopback, "
                    "so the communication prediction is the ranks' measured CPU cost of all-reduces)")
    ap.add_argument("--shares", metavar="S1,S2,...", help="CPU shares instead of the scenarios' "
                    "(e.g. the demo's 0.9,0.5,0.3); the run is named 'custom'")
    ap.add_argument("--malloc", choices=["tuned", "glibc"], default="tuned")
    ap.add_argument("--work", default="/tmp/xronos-prediction-error", help="checkpoints, data, cache")
    ap.add_argument("--out", metavar="FILE.json")
    args = ap.parse_args(argv)

    from xronos.bench.scenarios import get_scenario
    from xronos.cli.strategy import mape

    root = Path(args.work)
    root.mkdir(parents=True, exist_ok=True)
    cache = root / f"profiles-{args.malloc}"
    env = dict(os.environ, **({"XRONOS_MALLOC": "glibc"} if args.malloc == "glibc" else {}))
    runs = []
    for model in args.models.split(","):
        mdir, data = workload(root, model, args.blocks, max(64, (args.steps + 2) * args.batch_size),
                              args.seq_len)
        sets = ([("custom", [float(x) for x in args.shares.split(",")])] if args.shares
                else [(name, get_scenario(name).shares()) for name in args.scenarios.split(",")])
        for name, shares in sets:
            for strategy in args.strategies.split(","):
                work = root / f"run-{model}-{name}-{strategy}-{args.malloc}-b{args.batch_size}"
                work.mkdir(exist_ok=True)
                load = os.getloadavg()[0]
                pred = run_one(mdir, data, shares, strategy, args.steps, work, cache, env, args.seq_len,
                               tuple(float(x) for x in args.link.split(",")), args.batch_size)
                runs.append(dict(model=model, blocks=args.blocks, scenario=name, shares=shares, batch=args.batch_size,
                                 load_before=load, load_after=os.getloadavg()[0], **pred))
                print(f"{model:>14} b{args.blocks} {name:<6} {strategy:<8} units {pred['units']}  "
                      f"MAPE {pred['mape_pct']:5.2f}% (linear {pred['mape_linear_pct']:5.2f}%)  "
                      + "  ".join(f"r{r['rank']}: {r['predicted_compute_s']:.3f}/{r['measured_compute_s']:.3f}s"
                                  for r in pred["ranks"])
                      + "  idle " + "/".join(f"{100 * x:.1f}%" for x in pred["idle_ratio"])
                      + f"  iter {max(pred['iteration_s']):.3f}s"
                      + f"  comm {pred['comm_s']:.3f}s pred vs "
                      + "/".join(f"{r.get('measured_comm_s', float('nan')):.3f}" for r in pred["ranks"]), flush=True)
    pairs = [(r["predicted_compute_s"], r["predicted_linear_s"], r["measured_compute_s"])
             for run in runs for r in run["ranks"]]
    comm = [(r["predicted_comm_s"], r["measured_comm_s"]) for run in runs for r in run["ranks"]
            if r.get("measured_comm_s", 0) > 0]
    total = dict(points=len(pairs), mape_affine_pct=mape([p[0] for p in pairs], [p[2] for p in pairs]),
                 mape_linear_pct=mape([p[1] for p in pairs], [p[2] for p in pairs]),
                 comm_mape_pct=mape([c[0] for c in comm], [c[1] for c in comm]) if comm else None)
    print(f"per-node compute-time prediction over {total['points']} (run, rank) points: "
          f"MAPE {total['mape_affine_pct']:.2f}% affine in p, {total['mape_linear_pct']:.2f}% linear in p "
          f"(paper: 15.32%); malloc {args.malloc}"
          + (f"; communication MAPE {total['comm_mape_pct']:.2f}%" if total["comm_mape_pct"] is not None else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(args=vars(args), total=total, runs=runs), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
