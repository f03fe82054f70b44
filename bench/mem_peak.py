"""A training rank's peak resident set, per phase, measured on real `xronos run` ranks, against the
profile's prediction.

    python -m xronos.bench.mem_peak --model gpt2-medium --blocks 2 --layout 'attn=12,4;mlp=3072,1024;vocab=37696,12561'
    python -m xronos.bench.mem_peak --model-dir DIR --task classify --nodes 2   # a real checkpoint, even split
    python -m xronos.bench.mem_peak --model gpt2-medium --blocks 2 --nodes 3 --memcap 1500,800,800   # enforced caps

Writes a random-weight checkpoint of a bench shape (`bench/workloads.py`) or takes a real one,
profiles it once (`xronos profile`, the training ranks' allocator setting), runs `xronos run` with
`XRONOS_MEM_PHASES` set (each rank resets its high-water mark after every phase and writes its
phases' peaks: `xronos.node.measure.memwatch`), and prints per rank the peak of every phase (join, facts,
load, build, eval, forward, backward, clip, step, export), the overall peak, the prediction
(`memorymodel.predict_memory`, rank 0 as the owner) and their difference. `--json FILE` keeps every
number.

`--memcap M1,...,MN` (MiB) is the memory-cap cell: the planner (`segment`) plans for exactly
those caps (no reserve: the cap it respects is the one the kernel enforces), and each rank
trains inside its own cgroup with that memory cap (`xronos.node.emulate.confinement`, swap off) and a CPU
share of 1.8/N cores; the table then adds per rank the cap, the group's peak charge as the
kernel counted it and its OOM kills. Needs root and a cgroup memory controller.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20
PHASES = ("join", "facts", "load", "build", "eval", "forward", "backward", "clip", "step", "export")  # checkpoint: jobs only


def _run(cmd: list[str], env: dict[str, str]) -> None:
    proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def plan_for_caps(report, nodes: int, caps: list[int]):
    """The segment planner's layout for `nodes` copies of one profile under exactly `caps` bytes."""
    from xronos.gateway.plan.compatible import Loaded
    from xronos.gateway.plan.profiles import plan_reports

    loaded = []
    for r, cap in enumerate(caps):
        c = report.capabilities.model_copy(update={"memory_available": int(cap)})
        loaded.append(Loaded(f"rank {r}", report.model_copy(update={"node_id": f"rank{r}", "capabilities": c})))
    return plan_reports(loaded, "segment", reserve_mb=0.0)


def run_capped(cmd: list[str], caps: list[int], phases_dir: Path) -> list[dict]:
    """`xronos run` (argv after `xronos`) with rank r in a cgroup capped at caps[r] bytes; the
    kernel's numbers per rank."""
    import argparse as _ap

    from xronos.cli import run as run_cli
    from xronos.node.emulate.confinement import Confinement, RankLimits
    from xronos.node.rank.local import launch_local
    from xronos.node.measure.memwatch import ENV

    parser = _ap.ArgumentParser()
    run_cli.register(parser.add_subparsers())
    args = parser.parse_args(cmd)
    cfg = run_cli.config_from_args(args, run_cli.resolve_layout(args))
    share = round(1.8 / len(caps), 3)
    os.environ[ENV] = str(phases_dir)
    try:
        with Confinement([RankLimits(share, memory_bytes=c) for c in caps], top_weight=True) as conf:
            failed = None
            try:
                launch_local(cfg, len(caps), wrap=conf.wrap, echo_rank0=False)
            except Exception as exc:  # an OOM kill is a result: the table shows it
                failed = f"{type(exc).__name__}: {exc}"[-2000:]
            stats = [conf.memory_stats(r) | {"failed": failed} for r in range(len(caps))]
    finally:
        os.environ.pop(ENV, None)
    return stats


def measure(model_dir: Path, data: Path, task: str, layout_text: str | None, nodes: int, *, batch: int, seq: int,
            steps: int, work: Path, profile_json: Path | None = None, memcap: list[int] | None = None,
            lora_r: int | None = None, clip: bool = True) -> dict:
    from xronos.gateway.plan.costmodel import layout_shares, node_cost
    from xronos.gateway.plan.memorymodel import heap_slack, predict_memory
    from xronos.gateway.plan.profiles import load_report, node_profile
    from xronos.node.rank.spawn import rank_env
    from xronos.node.measure.memwatch import ENV
    from xronos.protocol.layout import Layout

    env = rank_env(1)
    if profile_json is None:
        profile_json = work / "profile.json"
        t0 = time.perf_counter()
        _run([sys.executable, "-m", "xronos.cli", "profile", "--model", str(model_dir), "--task", task,
              "--batch-size", str(batch), "--seq-len", str(seq), "--threads", "1", "--iters", "2",
              "--out", str(profile_json)] + (["--lora-r", str(lora_r)] if lora_r else [])
             + ([] if clip else ["--no-clip"]), env)
        print(f"profiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    report = load_report(profile_json)
    plan = None
    if memcap is not None:
        plan = plan_for_caps(report, nodes, memcap)
        layout_text = plan.layout.to_text()
        print(f"planned for caps {[round(c / MiB) for c in memcap]} MiB: {layout_text}", file=sys.stderr, flush=True)
    phases_dir = work / "phases"
    phases_dir.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "xronos.cli", "run", "--model", str(model_dir), "--data", str(data),
           "--task", task, "--nodes", str(nodes), "--batch-size", str(batch), "--seq-len", str(seq),
           "--lr", "1e-4", "--max-steps", str(steps), "--seed", "0"]
    cmd += ["--max-grad-norm", "1.0"] if clip else []
    cmd += ["--export", str(work / "export"), "--metrics", str(work / "metrics.json")]
    cmd += ["--lora-r", str(lora_r)] if lora_r else []
    if layout_text:
        cmd += ["--layout", layout_text]
    else:
        cmd += ["--strategy", "uniform", "--profile-cache", str(work / "pcache")]
    t0 = time.perf_counter()
    kernel = None
    if memcap is not None:
        kernel = run_capped(cmd[3:], memcap, phases_dir)
    else:
        _run(cmd, env | {ENV: str(phases_dir)})
    wall = time.perf_counter() - t0
    layout = Layout.parse(layout_text) if layout_text else Layout.model_validate(
        json.loads((work / "metrics.json").read_text())["config"]["layout"])
    from dataclasses import replace

    # The runs export without --export-merged: the owner gathers the trained tensors.
    node = replace(node_cost(node_profile(report)), export_all=False)
    rows = []
    for r in range(nodes):
        path = phases_dir / f"rank{r}.json"
        if not path.exists():  # the rank did not finish (killed)
            rows.append(dict(rank=r, phases={}, peak=0, predicted=predict_memory(
                replace(node, owner=r == 0), layout_shares(layout, r)), events=[],
                kernel=kernel[r] if kernel else None, cap=memcap[r] if memcap else None))
            continue
        doc = json.loads(path.read_text())
        train = max(v for k, v in doc["phases"].items() if k not in ("export", "checkpoint"))
        rows.append(dict(rank=r, layout={k: layout.counts(k)[r] for k in ("attn", "mlp", "vocab")},
                         phases=doc["phases"], peak=doc["peak"], peak_phase=doc["peak_phase"],
                         train_peak=train, baseline_rss=doc["baseline_rss"],
                         predicted=predict_memory(replace(node, owner=r == 0), layout_shares(layout, r)), anon_after=doc["anon_after"],
                         events=doc["events"], heaps=doc.get("heaps", []), kernel=kernel[r] if kernel else None,
                         holes=heap_slack(node, layout_shares(layout, r)),
                         cap=memcap[r] if memcap else None))
    return dict(plan=None if plan is None else dict(layout=plan.layout.to_text(),
                predicted_memory=[row.predicted_memory for row in plan.rows], caps=[row.memory_cap for row in plan.rows]),
                model_dir=str(model_dir), task=task, batch=batch, seq=seq, steps=steps, nodes=nodes,
                layout=layout.to_text(), clip=clip, wall_s=wall, loadavg=os.getloadavg(), rows=rows,
                profile=json.loads(profile_json.read_text()))


def table(res: dict) -> str:
    head = f"{'rank':>4} " + " ".join(f"{p[:6]:>7}" for p in PHASES) + f" {'peak':>7} {'pred':>7} {'err %':>6}"
    lines = [f"{res['model_dir']} ({res['task']}), layout {res['layout']}, batch {res['batch']} x {res['seq']}; "
             "MiB, each phase's own peak", head]
    for row in res["rows"]:
        ph = " ".join(f"{row['phases'].get(p, 0) / MiB:>7.0f}" for p in PHASES)
        err = 100 * (row["predicted"] - row["peak"]) / row["peak"] if row["peak"] else float("nan")
        lines.append(f"{row['rank']:>4} {ph} {row['peak'] / MiB:>7.0f} {row['predicted'] / MiB:>7.0f} {err:>+6.1f}")
    if any(row.get("kernel") for row in res["rows"]):
        lines.append(f"{'rank':>4} {'cap':>7} {'pred':>7} {'VmHWM':>7} {'cgroup':>7} {'OOM kills':>9}  (MiB; cgroup = the "
                     "group's peak charge, page cache included)")
        for row in res["rows"]:
            k = row["kernel"]
            lines.append(f"{row['rank']:>4} {row['cap'] / MiB:>7.0f} {row['predicted'] / MiB:>7.0f} "
                         f"{row['peak'] / MiB:>7.0f} {k.get('peak', 0) / MiB:>7.0f} {k['oom_kills']:>9}")
        if res["rows"][0]["kernel"].get("failed"):
            lines.append(f"run failed: {res['rows'][0]['kernel']['failed'][-400:]}")
    for row in res["rows"]:
        lines.append(f"rank {row['rank']} in order: " + ", ".join(
            f"{n} {p / MiB:.0f}" for n, p, _ in row["events"][:12]))
    lines.append("glibc heap at the end of the last training step (MiB): span = used + free; the free holes stay "
                 "resident under the ranks' allocator setting (node/measure/allocator.py)")
    for row in res["rows"]:
        last = next((h for n, h in reversed(row.get("heaps", [])) if n == "step" and h), None)
        if last:
            lines.append(f"rank {row['rank']}: span {last['span'] / MiB:.0f}, used {last['used'] / MiB:.0f}, "
                         f"free {last['free'] / MiB:.0f}, mmapped {last['mmapped'] / MiB:.0f}; predicted holes "
                         f"{row.get('holes', 0) / MiB:.0f} (profile's heap_slack_bytes scaled to the rank)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from xronos.bench.workloads import get_shape, shape_config, write_checkpoint, write_dataset

    ap = argparse.ArgumentParser(prog="python -m xronos.bench.mem_peak", description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a bench shape (bench/workloads.py)")
    src.add_argument("--model-dir", help="a real Hugging Face checkpoint directory")
    ap.add_argument("--data", help="with --model-dir: the data file (JSONL with text/label)")
    ap.add_argument("--task", default="classify", choices=["classify", "causal-lm"])
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--layout", help="xronos run --layout text (default: the uniform split)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--profile", help="reuse this profile JSON instead of profiling")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--lora-r", type=int, help="LoRA adapters of this rank on a frozen base (profile and run)")
    ap.add_argument("--no-clip", action="store_true", help="no global-norm clipping, in the profile nor the run "
                    "(as the bench grid's ranks: their peaks lack the clipping pass's 16 MiB chunks and its holes)")
    ap.add_argument("--memcap", help="MiB per rank: plan for these caps and train under them (cgroups)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="xronos-mempeak-") as tmp:
        work = Path(tmp)
        if args.model:
            config = shape_config(args.model, args.blocks)
            model_dir = write_checkpoint(work / "model", config)
            data = write_dataset(work / "data.jsonl", args.batch_size * (args.steps + 2), args.seq_len,
                                 get_shape(args.model)["vocab_size"])
        else:
            model_dir, data = Path(args.model_dir), Path(args.data)
        res = measure(model_dir, data, args.task, args.layout, args.nodes, batch=args.batch_size,
                      seq=args.seq_len, steps=args.steps, work=work,
                      profile_json=Path(args.profile) if args.profile else None,
                      memcap=[int(float(x) * MiB) for x in args.memcap.split(",")] if args.memcap else None,
                      lora_r=args.lora_r, clip=not args.no_clip)
    res["model"] = args.model or args.model_dir
    print(table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
