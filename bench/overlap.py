"""Overlap on vs off, side by side, on the virtual clock (issue #37):

    .venv/bin/python -m xronos.bench.overlap [--cells demo,n100x3-s64] [--modes off,bwd,c2] [--iters 6]

Real ranks (one process each, one Gloo group on loopback, one compute thread) train a model of the
cell's shape (random weights, `workloads.shape_config`; `demo`'s is `xronos demo`'s MiniLM) on the
cell's emulated boxes: each rank's `TPGroup` runs on a `VirtualClock` of its box's speed (host
cores) and the cell's link (1 Gbit/s, 0.5 ms a call, the cost model's). The layout is
speed-proportional per segment kind (each kind's units cut by the largest remainder), the same in
every mode. Modes take turns iteration by iteration, so all see the same host conditions: `off`
(today: every all-reduce blocks), `bwd` (`TPGroup.overlap`: the input-gradient all-reduce of every
column-parallel region beside its weight-gradient GEMMs, `node/tp/overlap.py`), `cN`
(`TPGroup.chunks` = N chunks of the batch rows, each chunk's all-reduces travelling while the next
chunk computes, forward and backward). An iteration is forward, backward, the trainer's AdamW step
(`adamw` in `node/rank/optim.py`: fused), from a common
start (an untimed barrier) to the last rank's end, in virtual seconds. Reported per cell and mode:
the median over the measured iterations, its ratio to the first mode's, and the share of the
iteration the rank that computes most (it hardly idles) spends in collectives (the cells the issue
targets have >= 30 % with overlap off). Results: bench/results/overlap.md and .json, with the
clock and the host's load. bench/overlap_wall.py runs the same worker on the wall clock too (two
ranks pinned one per core, behind a real 1 Gbit/s link) beside the virtual clock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from xronos.common.ports import free_port

# The cells: boxes as host cores (virtual speed), model shape, blocks, batch, sequence, task.
# `demo`: `xronos demo`'s boxes (N100 0.9, Pi 5 0.5, Pi 4 0.3) and model (MiniLM-L6, BERT 384 wide).
MINILM = dict(model_type="bert", hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
              intermediate_size=1536, vocab_size=30522, max_position_embeddings=512, type_vocab_size=2,
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0, pad_token_id=0)
CELLS = {
    "demo": dict(speeds=[0.9, 0.5, 0.3], shape="minilm", blocks=None, batch=8, seq=16, task="classify"),
    # three N100 boxes on the same model: faster boxes, so communication is a larger share
    "n100x3": dict(speeds=[0.9, 0.9, 0.9], shape="minilm", blocks=None, batch=8, seq=16, task="classify"),
    # the same at 8 x 64 tokens: chunks of 4 rows still make GEMMs of 256 tokens
    "n100x3-s64": dict(speeds=[0.9, 0.9, 0.9], shape="minilm", blocks=None, batch=8, seq=64, task="classify"),
    "demo-s64": dict(speeds=[0.9, 0.5, 0.3], shape="minilm", blocks=None, batch=8, seq=64, task="classify"),
    # two host cores (the wall-time check, bench/overlap_wall.py: one rank per core, a real link)
    "pair-s64": dict(speeds=[1.0, 1.0], shape="minilm", blocks=None, batch=8, seq=64, task="classify"),
    "pair-s128": dict(speeds=[1.0, 1.0], shape="minilm", blocks=None, batch=8, seq=128, task="classify"),
    "set-a-gpt2m": dict(speeds=[0.45, 0.3, 0.3], shape="gpt2-medium", blocks=6, batch=8, seq=32, task="causal-lm"),
    "set-a-roberta": dict(speeds=[0.45, 0.3, 0.3], shape="roberta-base", blocks=6, batch=8, seq=64, task="classify"),
    "set-a-smollm2": dict(speeds=[0.45, 0.3, 0.3], shape="smollm2-360m", blocks=8, batch=8, seq=32,
                          task="causal-lm"),
}
RATE_MBIT, LATENCY_S = 1000.0, 0.5e-3


def proportional(total: int, speeds: list[float]) -> tuple[int, ...]:
    """`total` units cut by speed, largest remainder first (a rank may get 0)."""
    exact = [total * s / sum(speeds) for s in speeds]
    counts = [int(e) for e in exact]
    for i in sorted(range(len(speeds)), key=lambda i: exact[i] - counts[i], reverse=True)[:total - sum(counts)]:
        counts[i] += 1
    return tuple(counts)


def config_of(cell: dict) -> dict:
    from xronos.bench.workloads import shape_config

    config = dict(MINILM) if cell["shape"] == "minilm" else shape_config(cell["shape"], cell["blocks"])
    prefix = {"gpt2": "GPT2", "bert": "Bert", "roberta": "Roberta", "llama": "Llama"}[config["model_type"]]
    suffix = "LMHeadModel" if prefix == "GPT2" else "ForCausalLM"
    config["architectures"] = [prefix + (suffix if cell["task"] == "causal-lm" else "ForSequenceClassification")]
    return config


def parse_modes(ap: argparse.ArgumentParser, text: str) -> list[str]:
    """`--modes` as a list of mode labels; a bad one is the parser's error, naming it."""
    modes = [m for m in text.split(",") if m]
    for m in modes:
        try:
            chunks_of(m)
        except ValueError as e:
            ap.error(str(e))
    return modes


def chunks_of(mode: str) -> int:
    """Modes: `off`; `bwd` (backward overlap); `cN` (N chunks, forward and backward). The
    planner's labels (`overlapcost.mode_of`, which refuses any other)."""
    from xronos.gateway.plan.overlapcost import mode_of

    return mode_of(mode).chunks


def worker(job_file: str, rank_s: str) -> None:
    job, rank = json.loads(Path(job_file).read_text()), int(rank_s)
    if job.get("cores"):  # pinned before torch starts a thread: every thread (Gloo's too) inherits it
        os.sched_setaffinity(0, {job["cores"][rank]})
    import torch

    torch.set_num_threads(1)
    from xronos.node.emulate.link import Link
    from xronos.node.emulate.vclock import Box, VirtualClock
    from xronos.node.models.loading import init_random
    from xronos.node.models.registry import family_for
    from xronos.node.rank.optim import adamw
    from xronos.node.tp.group import TPGroup
    from xronos.node.tp.layout import ShardLayout

    cell, speeds = job["cell"], job["cell"]["speeds"]
    # `wall` (bench/overlap_wall.py): the group on the wall clock, as a real box's; else virtual,
    # on the modelled link (the wall check models its real link's measured latency)
    wall = job.get("clock") == "wall"
    link = Link.mbit(job.get("rate_mbit", RATE_MBIT), job.get("latency_s", LATENCY_S),
                     job.get("stack_s_per_byte", 0.0), job.get("progress_s", 0.0))
    clock = None if wall else VirtualClock(Box(speeds[rank], link, "med"))
    group = TPGroup.join(rank, len(speeds), job.get("host", "127.0.0.1"), job["port"], timeout_s=300, clock=clock)
    config = config_of(cell)
    family = family_for(config)
    sizes = family.sizes(config)
    layout = ShardLayout(*(proportional(getattr(sizes, k), speeds) for k in ("attn", "mlp", "vocab")), rank=rank)
    model = init_random(family.build(config, cell["task"], layout, group), seed=0)
    model.train()
    # The trainer's optimizer (fused AdamW): torch's default `foreach` step took 62 ms of a
    # 97 ms n100x3 iteration's host CPU where the trainer's takes 11, and so diluted the
    # communication share that overlap acts on.
    opt = adamw(model.parameters(), lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, config["vocab_size"], (cell["batch"], cell["seq"]), generator=gen)
    labels = ids if cell["task"] == "causal-lm" else torch.randint(0, 2, (cell["batch"],), generator=gen)
    rows = []
    modes = job["modes"]
    for it in range(len(modes) * (job["warmup"] + job["iters"])):
        mode = modes[it % len(modes)]  # round robin: every mode under the same host conditions
        group.overlap, group.chunks = mode != "off", chunks_of(mode)
        # Every iteration starts together (untimed barrier): no rank's wait for the last iteration's
        # slowest optimizer step lands in the next one, which runs in the other mode.
        group.barrier(timed=False)
        group.drain_timings()
        acc = None if wall else clock.account
        t0, w0 = group.now(), time.perf_counter()
        c0, p0 = time.thread_time(), time.process_time()
        before = (0.0, 0.0, 0.0) if wall else (acc.compute, acc.comm, acc.idle)
        loss = model(ids, labels=labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        group.settle()
        t1, w1 = group.now(), time.perf_counter()
        c1, p1 = time.thread_time(), time.process_time()
        if wall:  # time in collectives (waits for the peer included: wall time cannot tell them apart)
            comm = sum(s for _, s in group.drain_timings())
            after = (t1 - t0 - comm, comm, 0.0)
        else:
            after = (acc.compute, acc.comm, acc.idle)
        # w0/w1: perf_counter is CLOCK_MONOTONIC, one clock for every process of the host
        rows.append({"mode": mode, "iteration_s": t1 - t0, "wall_s": w1 - w0, "w0": w0, "w1": w1,
                     **{k: a - b for k, a, b in zip(("compute_s", "comm_s", "idle_s"), after, before)},
                     "launched": group.launched, "loss": loss.item(),
                     # host CPU: the computing thread's, and the process's other threads' (Gloo's)
                     "thread_cpu_s": c1 - c0, "others_cpu_s": (p1 - p0) - (c1 - c0)})
    lay = {k: list(getattr(layout, k)) for k in ("attn", "mlp", "vocab")}
    # host s: what the clock charges a blocking call (its window minimum) and a launched one (median)
    calls, flights = ({}, {}) if wall else ({f"{k[0]} {k[1]} B": est.value(k) for k in est._hist}
                                            for est in (clock.call_est, clock.flight_est))
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps({"layout": lay, "calls_cpu_s": calls,
                                                                "flights_cpu_s": flights, "rows": rows}))
    group.leave()


def run_cell(name: str, cell: dict, iters: int, warmup: int, work: Path, modes: list[str],
             extra: dict | None = None, placement=None) -> dict:
    """`extra`: more of the job (bench/overlap_wall.py: clock, latency_s, cores); `placement`: a
    `bench.netem.Network` the ranks run behind (None: loopback)."""
    work.mkdir(parents=True, exist_ok=True)
    job = {"cell": cell, "iters": iters, "warmup": warmup, "port": free_port(), "out": str(work), "modes": modes,
           **(extra or {})}
    if placement is not None:
        job["host"] = placement.rendezvous_host
    (work / "job.json").write_text(json.dumps(job))
    from xronos.node.rank.spawn import rank_env

    env = rank_env(1)  # as a training rank runs: one thread, the ranks' allocator setting
    argv = [sys.executable, "-m", "xronos.bench.overlap", "worker", str(work / "job.json")]
    procs = [subprocess.Popen([*(placement.argv_prefix(r) if placement else ()), *argv, str(r)],
                              env={**env, **(placement.env(r) if placement else {})},
                              stdout=(work / f"rank{r}.log").open("w"), stderr=subprocess.STDOUT)
             for r in range(len(cell["speeds"]))]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"cell {name}: ranks exited {codes}; see {work}/rank*.log")
    ranks = [json.loads((work / f"rank{r}.json").read_text())["rows"] for r in range(len(procs))]
    res: dict = {"cell": name, **cell}
    for mode in modes:
        its = [i for i in range(len(ranks[0])) if ranks[0][i]["mode"] == mode][warmup:]
        # from the common start to the last rank's end: the iteration
        slowest = [iteration_of([rk[i] for rk in ranks], (extra or {}).get("clock") == "wall") for i in its]
        # the communication the iteration waits for: the share of it the rank that computes most
        # (the slowest box for its share; it hardly idles) spends in collectives
        busiest = max(range(len(ranks)), key=lambda r: sum(ranks[r][i]["compute_s"] for i in its))
        exposed = [ranks[busiest][i]["comm_s"] / ranks[busiest][i]["iteration_s"] for i in its]
        res[mode] = {"median_s": statistics.median(slowest),
                     "compute_s": statistics.median(ranks[busiest][i]["compute_s"] for i in its), "min_s": min(slowest), "max_s": max(slowest),
                    "exposed_comm_share": statistics.median(exposed),
                    "wall_median_s": statistics.median(max(rk[i]["wall_s"] for rk in ranks) for i in its),
                    # the busiest rank's host CPU: its computing thread's and its other threads' (Gloo's)
                    "thread_cpu_s": statistics.median(ranks[busiest][i]["thread_cpu_s"] for i in its),
                    "others_cpu_s": statistics.median(ranks[busiest][i]["others_cpu_s"] for i in its),
                    "n": len(its)}
    res["modes"] = modes
    res["losses"] = [row["loss"] for row in ranks[0]]  # every iteration's, in order: the same on any clock
    for mode in modes[1:]:
        res[mode]["ratio"] = res[mode]["median_s"] / res[modes[0]]["median_s"]
    res["layout"] = json.loads((work / "rank0.json").read_text())["layout"]
    if (extra or {}).get("clock") != "wall":
        res["call_cpu_ms"] = call_cpu([json.loads((work / f"rank{r}.json").read_text()) for r in range(len(procs))])
    return res


def call_cpu(rank_docs: list[dict]) -> list[dict]:
    """Per rank, the host CPU (ms) the virtual clock charged at the run's end: a blocking
    all-reduce (its window minimum, by size) and a launched one (its window median, by size). A
    box pays these at its speed (ms / host cores): where a launched call's comes near the link's
    time, chunking has nothing left to hide."""
    def ms(d: dict) -> dict:
        return {k: round(v * 1e3, 3) for k, v in d.items() if k.startswith("all_reduce")}

    return [{"blocking": ms(doc["calls_cpu_s"]), "launched": ms(doc["flights_cpu_s"])} for doc in rank_docs]


def iteration_of(rows: list[dict], wall: bool) -> float:
    """One iteration from every rank's row: virtual, the longest rank's (the barrier gives every
    rank the same start); wall, from the first rank out of the barrier to the last rank's end."""
    if wall:
        return max(r["w1"] for r in rows) - min(r["w0"] for r in rows)
    return max(r["iteration_s"] for r in rows)


def markdown(results: list[dict], load: str, argv: list[str], seconds: float, stack_ns: float = 0.0,
             progress_ms: float = 0.0) -> str:
    stack = (f"; the network stack's CPU charged to each end at {stack_ns:g} ns of a host core a byte carried, "
             "beside each call's measured CPU, at the box's speed" if stack_ns else
             "; no network-stack CPU beyond each call's measured CPU")
    stack += (f"; a call in flight moves {progress_ms:g} ms late while its rank computes (`Link.progress_s`: "
              "Gloo's threads wait for the busy core)" if progress_ms else
              "; a call in flight moves at once beside a busy core (no progress delay)")
    lines = ["# Overlap on vs off (issue #37)", "",
             "Clock: **virtual** (each rank's compute at its box's speed, collectives on a modelled "
             f"{RATE_MBIT:g} Mbit/s link, {LATENCY_S * 1e3:g} ms a call{stack}; wall seconds beside, for scale only: "
             "the host is shared). Modes: `off` (every all-reduce blocks: today), `bwd` (the input-gradient "
             "all-reduce of every column-parallel region runs while the region's weight-gradient GEMMs "
             "compute, `node/tp/overlap.py`), `cN` (the batch rows in N chunks, each "
             "chunk's all-reduces travelling while the next chunk computes, in forward and backward). Modes take turns "
             "iteration by iteration in one run; each figure is the median over the measured iterations of "
             "the iteration (forward, backward, the trainer's fused AdamW; from a common start to the last "
             "rank's end). `compute "
             "s` and `comm share`: the compute of the rank that computes most, and the share of the "
             "iteration it spends in collectives (a mode may change the compute itself: the fused "
             "backward skips autograd's copies, chunks add per-op overhead). The "
             "layout is speed-proportional per segment kind, the same in every mode.", "",
             f"Command: `python -m xronos.bench.overlap {' '.join(argv)}`; {seconds / 60:.1f} min; "
             f"load (`uptime`) at the end: {load}.", "",
             "| cell | boxes (host cores) | model | blocks | batch x seq | run | mode | iteration s (virtual) "
             "| / off | compute s | comm share | wall s | iterations |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for mode in r["modes"]:
            m = r[mode]
            ratio = f"**{m['ratio']:.3f}**" if "ratio" in m else "1"
            lines.append(f"| {r['cell']} | {', '.join(f'{s:g}' for s in r['speeds'])} | {r['shape']} | "
                         f"{r['blocks'] or 'all'} | {r['batch']} x {r['seq']} | {r.get('repeat', 1)} | {mode} | "
                         f"{m['median_s']:.4f} "
                         f"(min {m['min_s']:.4f}, max {m['max_s']:.4f}) | {ratio} | {m['compute_s']:.4f} | "
                         f"{m['exposed_comm_share']:.0%} | {m['wall_median_s']:.3f} | {m['n']} |")
    cpu = [r for r in results if r.get("call_cpu_ms")]
    if cpu:
        lines += ["", "Host CPU the clock charged an all-reduce at the run's end, per rank (ms of a host core; a "
                  "box pays it at its speed, ms / host cores): blocking (window minimum) | launched beside "
                  "compute (window median), by the call's bytes:", "",
                  "| cell | run | rank (host cores) | blocking | launched |", "|---|---|---|---|---|"]
        for r in cpu:
            for rank, (c, speed) in enumerate(zip(r["call_cpu_ms"], r["speeds"])):
                blk, fly = (", ".join(f"{k.split()[-2]} B {v:g}" for k, v in c[x].items()) or "-"
                            for x in ("blocking", "launched"))
                lines.append(f"| {r['cell']} | {r.get('repeat', 1)} | {rank} ({speed:g}) | {blk} | {fly} |")
    cells = list(dict.fromkeys(r["cell"] for r in results))
    if max(r.get("repeat", 1) for r in results) > 1:
        lines += ["", "Ratios to `off` over the repeats (mean, and (max - min) / mean):", "",
                  "| cell | mode | mean | spread | runs |", "|---|---|---|---|---|"]
        for cell in cells:
            runs = [r for r in results if r["cell"] == cell]
            for mode in runs[0]["modes"][1:]:
                xs = [r[mode]["ratio"] for r in runs]
                mean = statistics.mean(xs)
                lines.append(f"| {cell} | {mode} | **{mean:.3f}** | {(max(xs) - min(xs)) / mean:.1%} | "
                             f"{', '.join(f'{x:.3f}' for x in xs)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        from xronos.node.rank.spawn import exit_process

        worker(argv[1], argv[2])
        exit_process(0)  # past Gloo's teardown, which aborts a finished rank now and then (spawn.py)
    ap = argparse.ArgumentParser(prog="python -m xronos.bench.overlap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="demo,set-a-gpt2m", help=f"comma-separated, of {', '.join(CELLS)}")
    ap.add_argument("--modes", default="off,bwd,c2", help="off, bwd, cN (N chunks), the first the baseline")
    ap.add_argument("--iters", type=int, default=8, help="measured iterations per mode")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every cell, interleaved")
    ap.add_argument("--warmup", type=int, default=4, help="iterations per mode not counted (estimator windows)")
    ap.add_argument("--stack-ns", type=float, default=0.0,
                    help="the link's network-stack CPU, ns of a host core per byte carried, charged to each end "
                         "beside a call's measured CPU (bench/stack_probe.py measures it on a real link; 0: none)")
    ap.add_argument("--progress-ms", type=float, default=0.0,
                    help="how much later a call in flight completes while its rank computes, ms of the box's time "
                         "(bench/stack_probe.py measures it: Gloo's threads wait for the busy core; 0: none)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    if not (args.stack_ns >= 0 and args.stack_ns < float("inf")):
        ap.error(f"--stack-ns must be a finite number >= 0, got {args.stack_ns}")
    if not 0 <= args.progress_ms < 1000:
        ap.error(f"--progress-ms must be in [0, 1000), got {args.progress_ms}")
    names = [c for c in args.cells.split(",") if c]
    modes = parse_modes(ap, args.modes)
    bad = [c for c in names if c not in CELLS]
    if bad:
        ap.error(f"unknown cell(s) {bad}; known: {', '.join(CELLS)}")
    t0 = time.monotonic()
    results = []
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="overlap-bench-")  # kept when a cell fails: its ranks' logs
    for rep in range(args.repeats):  # repeats interleaved: every cell, then every cell again
        for name in names:
            print(f"== {name} (repeat {rep + 1}/{args.repeats})", flush=True)
            res = run_cell(name, CELLS[name], args.iters, args.warmup, Path(tmp) / f"{name}-{rep}", modes,
                           {"stack_s_per_byte": args.stack_ns * 1e-9, "progress_s": args.progress_ms * 1e-3})
            res["repeat"] = rep + 1
            print(json.dumps(res), flush=True)
            results.append(res)
    shutil.rmtree(tmp) if not os.environ.get("XRONOS_BENCH_KEEP") else print("kept", tmp)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overlap.json").write_text(json.dumps({"load": load, "results": results}, indent=1))
    (args.out / "overlap.md").write_text(markdown(results, load, argv, time.monotonic() - t0, args.stack_ns,
                                                            args.progress_ms))
    print((args.out / "overlap.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
