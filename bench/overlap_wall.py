"""Overlap's gain on the wall clock beside the virtual clock's, two ranks (issue #37):

    .venv/bin/python -m xronos.bench.overlap_wall [--cells pair-s64] [--modes off,bwd,c2] [--iters 10] [--repeats 3]

The virtual clock's overlap gain (bench/overlap.py) comes from a model: compute from thread CPU
over a box's speed, the link from an alpha-beta formula, Gloo's CPU charged on top. Here the same
worker runs where the wall clock is faithful too, and both clocks' gains are set side by side:

- wall: two ranks, each process pinned to its own core (cores 0 and 1; every thread, Gloo's too),
  no CPU quota, one intra-op thread, the group on the wall clock, each rank in its own network
  namespace behind a real 1 Gbit/s link (`bench.netem.Network`: veth + bridge + tc tbf both ways;
  no added delay). An iteration: from the first rank out of an untimed barrier to the last rank's
  end (perf_counter is CLOCK_MONOTONIC: one clock for both processes).
- virtual: the same two ranks (1.0 host core each), pinned the same way, on loopback (with
  `--virtual-net netns` on the same link: the calls' CPU then measured on that stack), each on a
  `VirtualClock` whose link is the real one's: 1000 Mbit/s and the per-call latency measured first
  on the real link (`probe`: the mean of back-to-back 4-byte all-reduces between the pinned ranks
  in their namespaces; the time of one all-reduce of the cell's activation size is measured too,
  beside what the model says of it). The link's `stack_s_per_byte` is measured first too
  (`bench.stack_probe`: what a call in flight takes from a computing core on the real link beyond
  what the clock charges it over loopback, with no training in it); `--stack off` models the link
  without it, as the grid's virtual runs do. The same probe measures how much later a call in
  flight completes beside the computing core than with the core free (Gloo's threads wait for the
  scheduler's slice): the link's `progress_s`, which the virtual runs model only with `--progress
  probe` (it over-corrects: docs/planning.md). With `--fitted`, a third run per repeat models the
  link at the rate the real one delivered at that size as well (`fitted_mbit`).

Modes take turns iteration by iteration inside each run (as in bench/overlap.py); the repeats run
back to back in pairs: wall then virtual, per cell, repeat after repeat. Per mode: each clock's
median over the measured iterations, its ratio to `off`, and the difference of the gains in
points, (1 - wall ratio) - (1 - virtual ratio). The issue asks that difference within 5 points.
Results: bench/results/overlap-wall.md and .json, with the load before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from xronos.bench.overlap import CELLS, config_of, parse_modes, run_cell
from xronos.bench import stack_probe
from xronos.bench.stack_probe import CORES, uptime

TARGET_POINTS = 5.0  # the bound on |wall gain - virtual gain|


# -- the arithmetic (pure) -------------------------------------------------------------------------
def gain_points(wall_ratio: float, virtual_ratio: float) -> float:
    """Wall gain minus virtual gain, in points, a gain being 1 - the ratio to `off`."""
    return 100.0 * ((1.0 - wall_ratio) - (1.0 - virtual_ratio))


def fitted_mbit(nbytes: int, seconds: float, latency_s: float, world: int = 2) -> float:
    """The link rate (Mbit/s) at which the model's ring all-reduce, latency + 2(N-1)/N x bytes /
    bandwidth, takes `seconds` for `nbytes`: what the real link delivered at that size."""
    if not seconds > latency_s:
        raise ValueError(f"an all-reduce of {nbytes} B took {seconds:.6f} s, not more than the "
                         f"per-call latency {latency_s:.6f} s: no bandwidth to fit")
    return 2 * (world - 1) / world * nbytes * 8 / (seconds - latency_s) / 1e6


def pair_rows(wall: dict, virtual: dict) -> list[dict]:
    """One repeat of a cell: per mode, both clocks' medians, ratios to the first mode (`off`) and
    the gain difference. `wall`, `virtual`: `run_cell` results over the same modes."""
    if wall["modes"] != virtual["modes"]:
        raise ValueError(f"the runs' modes differ: wall {wall['modes']}, virtual {virtual['modes']}")
    base = wall["modes"][0]
    rows = []
    for mode in wall["modes"]:
        w, v = wall[mode], virtual[mode]
        wr, vr = w["median_s"] / wall[base]["median_s"], v["median_s"] / virtual[base]["median_s"]
        rows.append({"mode": mode, "wall_s": w["median_s"], "wall_min_s": w["min_s"], "wall_max_s": w["max_s"],
                     "virtual_s": v["median_s"], "virtual_min_s": v["min_s"], "virtual_max_s": v["max_s"],
                     "wall_ratio": wr, "virtual_ratio": vr, "gain_diff_points": gain_points(wr, vr),
                     "wall_comm_share": w["exposed_comm_share"], "virtual_comm_share": v["exposed_comm_share"],
                     "wall_compute_s": w["compute_s"], "virtual_compute_s": v["compute_s"],
                     # host CPU of the busiest rank: its computing thread, its other threads (Gloo's)
                     "wall_thread_cpu_s": w.get("thread_cpu_s", math.nan),
                     "virtual_thread_cpu_s": v.get("thread_cpu_s", math.nan),
                     "wall_others_cpu_s": w.get("others_cpu_s", math.nan),
                     "virtual_others_cpu_s": v.get("others_cpu_s", math.nan),
                     "n": min(w["n"], v["n"])})
    return rows


def summarise(repeats: list[list[dict]]) -> list[dict]:
    """Over the repeats of one cell (each `pair_rows`), per mode after the first: each clock's
    ratios (mean, spread = (max - min) / mean) and the gain difference (mean, min, max)."""
    out = []
    for mode in [r["mode"] for r in repeats[0]][1:]:
        rows = [next(r for r in rep if r["mode"] == mode) for rep in repeats]
        wr, vr, d = ([r[k] for r in rows] for k in ("wall_ratio", "virtual_ratio", "gain_diff_points"))
        mean_d = statistics.mean(d)
        out.append({"mode": mode, "runs": len(rows),
                    "wall_ratio": statistics.mean(wr), "wall_spread": (max(wr) - min(wr)) / statistics.mean(wr),
                    "virtual_ratio": statistics.mean(vr),
                    "virtual_spread": (max(vr) - min(vr)) / statistics.mean(vr),
                    "wall_ratios": wr, "virtual_ratios": vr,
                    "gain_diff_points": mean_d, "gain_diff_min": min(d), "gain_diff_max": max(d),
                    "within": abs(mean_d) <= TARGET_POINTS})
    return out


_VNET = {"loopback": "on loopback", "netns": "their traffic on the same netns link (its time modelled)"}


def markdown(doc: dict) -> str:
    link = doc["link"]
    lines = ["# Overlap's gain: wall clock vs virtual clock, two ranks (issue #37)", "",
             "**wall**: two ranks pinned one per core (cores 0, 1; no CPU quota; one intra-op thread), each "
             f"in its own network namespace behind a real {doc['rate_mbit']:g} Mbit/s link (veth + bridge, "
             "tc tbf both ways, no added delay), the group on the wall clock; an iteration runs from the "
             "first rank out of an untimed barrier to the last rank's end, in wall seconds. **virtual**: "
             f"the same two ranks, pinned the same way, {_VNET[doc.get('virtual_net', 'loopback')]}, each on a "
             "virtual clock of 1.0 host core "
             f"whose link is modelled at {doc['rate_mbit']:g} Mbit/s and {link['latency_s'] * 1e6:.0f} us a "
             "call: the real link's latency, measured just before (the mean wall time of "
             f"{link['calls']} back-to-back 4-byte all-reduces between the pinned ranks through their "
             f"namespaces, median of {link['loops']} loops; one call after an untimed barrier, the slower "
             f"rank's: median {link['single_s'] * 1e6:.0f} us). One all-reduce of {link.get('cell', 'the')}'s activation "
             f"({link['big_bytes'] / 1e3:.0f} kB) took {link['big_s'] * 1e3:.2f} ms on the real link "
             f"(median of {link['big_calls']}), the model says {link['big_model_s'] * 1e3:.2f} ms. "
             + _stack_text(doc) + _threads_text(doc) + " Modes "
             "take turns iteration by iteration in each run (`off`: every all-reduce blocks; `bwd`: the "
             "input-gradient all-reduce beside the weight-gradient GEMMs; `cN`: N chunks, each "
             "chunk's all-reduces beside the next chunk's compute, forward and backward); "
             f"runs {doc['order']}. Gain = 1 - ratio to `off`; **gain diff** = wall gain - "
             "virtual gain, in points (the issue: within 5). `comm share`: the share of the iteration "
             "the rank that computes most spends in collectives (wall: waits for the peer included); "
             "`compute s`: that rank's median compute (wall: the iteration less its time in collectives, so "
             "the CPU that communication in flight takes from the core, and the launches, count as compute; "
             "virtual: its clock's compute bursts, while the CPU it charges a launched call, Gloo's and the "
             "stack's, is booked as communication). `thread / others CPU`: the host CPU seconds of that "
             "rank's computing thread and of its process's other threads (Gloo's) per iteration, medians: "
             "pinned one process per core, the others' CPU on the wall runs is time the computing thread "
             "waits for its core whenever a call is in flight while it computes.", "",
             f"Command: `python -m xronos.bench.overlap_wall {' '.join(doc['argv'])}`; "
             f"{doc['seconds'] / 60:.1f} min. Load (`uptime`) at the start: {doc['load_start']}; at the end: "
             f"{doc['load_end']}. CPU quota: {doc['quota']}.", "",
             "| cell | run | mode | wall s (min, max) | wall / off | virtual s (min, max) | virtual / off "
             "| gain diff (points) | comm share wall / virtual | compute s wall / virtual "
             "| thread / others CPU s, wall | thread / others CPU s, virtual | iterations |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell in doc["cells"]:
        for k, rep in enumerate(cell["repeats"]):
            for r in rep:
                lines.append(
                    f"| {cell['cell']} | {k + 1} | {r['mode']} | {r['wall_s']:.4f} ({r['wall_min_s']:.4f}, "
                    f"{r['wall_max_s']:.4f}) | {r['wall_ratio']:.3f} | {r['virtual_s']:.4f} "
                    f"({r['virtual_min_s']:.4f}, {r['virtual_max_s']:.4f}) | {r['virtual_ratio']:.3f} | "
                    f"{r['gain_diff_points']:+.1f} | {r['wall_comm_share']:.0%} / {r['virtual_comm_share']:.0%} "
                    f"| {r['wall_compute_s']:.3f} / {r['virtual_compute_s']:.3f} "
                    f"| {r.get('wall_thread_cpu_s', math.nan):.3f} / {r.get('wall_others_cpu_s', math.nan):.3f} "
                    f"| {r.get('virtual_thread_cpu_s', math.nan):.3f} / {r.get('virtual_others_cpu_s', math.nan):.3f} "
                    f"| {r['n']} |")
    lines += ["", "Over the repeats (ratios: mean, spread = (max - min) / mean; gain diff: mean, min .. max):", ""]
    lines += _summary(doc["cells"], "summary")
    if "fit_mbit" in doc:
        lines += ["", f"The same wall runs beside a third run per repeat, **virtual on the fitted link**: the "
                  f"measured latency and {doc['fit_mbit']:.0f} Mbit/s, the rate at which the model's all-reduce "
                  "of the cell's activation takes what it took on the real link:", ""]
        lines += _summary(doc["cells"], "summary_fitted")
    if doc.get("notes"):  # a reading of these figures, written after the run
        lines += ["", "Reading:", "", *(f"- {n}" for n in doc["notes"])]
    return "\n".join(lines) + "\n"


def _threads_text(doc: dict) -> str:
    if doc.get("comm_threads") == "fifo":
        return (" Each rank raises Gloo's threads to SCHED_FIFO 1 at its first overlapped call "
                "(`node/tp/progress.py`), so a call in flight moves while the core computes.")
    if doc.get("comm_threads") == "off":
        return " Gloo's threads stay at normal priority (XRONOS_COMM_THREADS=off)."
    return ""


def _stack_text(doc: dict) -> str:
    stack = doc.get("stack")
    if stack is None:
        return ("The virtual link charges no network-stack CPU beyond the calls' measured CPU"
                + (" (its traffic runs on the real stack, which the calls' CPU then includes)."
                   if doc.get("virtual_net") == "netns" else "."))
    sizes = ", ".join(f"{int(n) / 1e3:.0f} kB {(s['real_steal_s'] - s['loop_charge_s']) * 1e3:.2f} ms"
                      for n, s in stack["sizes"].items())
    progress = (f" A call in flight completes {doc['progress_s'] * 1e3:.2f} ms late while its rank computes "
                "(`Link.progress_s`: the same probe's median lateness of a call beside the busy core against "
                "the same call blocking with the core free)." if doc.get("progress_s") else
                f" No progress delay is modelled (the probe measured {stack['progress_s'] * 1e3:.2f} ms)."
                if "progress_s" in stack else "")
    return (f"The virtual link charges each end {doc['stack_s_per_byte'] * 1e9:.2f} ns of CPU a byte carried "
            "for the network stack, measured just before (`bench.stack_probe`: a GEMM burst with one all-reduce "
            "in flight on the real link took this much more wall time than alone, beyond what the clock "
            f"charges the call over loopback: {sizes}; the least-squares slope through the origin)." + progress)


def _summary(cells: list[dict], key: str) -> list[str]:
    lines = ["| cell | mode | wall / off | spread | virtual / off | spread | gain diff (points) | within 5 |",
             "|---|---|---|---|---|---|---|---|"]
    for cell in cells:
        for s in cell[key]:
            lines.append(f"| {cell['cell']} | {s['mode']} | **{s['wall_ratio']:.3f}** | {s['wall_spread']:.1%} | "
                         f"**{s['virtual_ratio']:.3f}** | {s['virtual_spread']:.1%} | "
                         f"**{s['gain_diff_points']:+.1f}** ({s['gain_diff_min']:+.1f} .. "
                         f"{s['gain_diff_max']:+.1f}) | {'yes' if s['within'] else 'no'} |")
    return lines


# -- the link probe (a rank process) ---------------------------------------------------------------
def probe(job_file: str, rank_s: str) -> None:
    job, rank = json.loads(Path(job_file).read_text()), int(rank_s)
    os.sched_setaffinity(0, {job["cores"][rank]})
    import torch

    torch.set_num_threads(1)
    from xronos.node.tp.group import TPGroup

    group = TPGroup.join(rank, 2, job["host"], job["port"], timeout_s=120)
    tiny, big = torch.ones(1), torch.ones(job["big_bytes"] // 4)
    for _ in range(20):
        group.all_reduce(tiny, timed=False)
    group.all_reduce(big, timed=False)
    loops, single, bigs = [], [], []
    for _ in range(job["loops"]):  # back to back: the ranks meet in lock step, as the model's calls
        group.barrier(timed=False)
        t0 = time.perf_counter()
        for _ in range(job["calls"]):
            group.all_reduce(tiny, timed=False)
        loops.append((time.perf_counter() - t0) / job["calls"])
    for _ in range(job["calls"]):
        group.barrier(timed=False)
        t0 = time.perf_counter()
        group.all_reduce(tiny, timed=False)
        single.append(time.perf_counter() - t0)
    for _ in range(job["big_calls"]):
        group.barrier(timed=False)
        t0 = time.perf_counter()
        group.all_reduce(big, timed=False)
        bigs.append(time.perf_counter() - t0)
    times = {}
    for name, xs in (("loops", loops), ("single", single), ("big", bigs)):
        t = torch.tensor(xs, dtype=torch.float64)
        group.all_reduce(t, "max", timed=False)  # a call ends when its slower rank is done
        times[name] = t.tolist()
    if rank == 0:
        Path(job["out"]).write_text(json.dumps(times))
    group.leave()


def measure_link(net, work: Path, big_bytes: int, rate_mbit: float, calls: int = 200, loops: int = 7) -> dict:
    from xronos.node.emulate.link import Link

    job = {"cores": list(CORES), "host": net.rendezvous_host, "port": 29500, "out": str(work / "probe.json"),
           "big_bytes": big_bytes, "calls": calls, "loops": loops, "big_calls": 30}
    (work / "probe-job.json").write_text(json.dumps(job))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    procs = [subprocess.Popen([*net.argv_prefix(r), sys.executable, "-m", "xronos.bench.overlap_wall", "probe",
                               str(work / "probe-job.json"), str(r)], env={**env, **net.env(r)},
                              stdout=(work / f"probe{r}.log").open("w"), stderr=subprocess.STDOUT) for r in range(2)]
    codes = [p.wait(timeout=300) for p in procs]
    if any(codes):
        raise RuntimeError(f"link probe: ranks exited {codes}; see {work}/probe*.log")
    t = json.loads((work / "probe.json").read_text())
    latency = statistics.median(t["loops"])
    return {"latency_s": latency, "loops": loops, "calls": calls, "loop_s": t["loops"],
            "single_s": statistics.median(t["single"]), "big_bytes": big_bytes,
            "big_s": statistics.median(t["big"]), "big_calls": len(t["big"]),
            "big_model_s": Link.mbit(rate_mbit, latency).seconds("all_reduce_sum", big_bytes, 2)}


# -- the run ----------------------------------------------------------------------------------------
def cpu_quota() -> str:
    """This process's CFS quota as the kernel states it (cgroup v2 cpu.max, or v1's quota/period)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if ctrls == "":
            files = [Path("/sys/fs/cgroup" + path, "cpu.max")]
        elif "cpu" in ctrls.split(","):
            files = [Path("/sys/fs/cgroup/cpu" + path, f) for f in ("cpu.cfs_quota_us", "cpu.cfs_period_us")]
        else:
            continue
        if all(f.exists() for f in files):
            return f"{' / '.join(f.read_text().strip() for f in files)} ({', '.join(str(f) for f in files)})"
    return "none found"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "probe":
        from xronos.node.rank.spawn import exit_process

        probe(argv[1], argv[2])
        exit_process(0)  # past Gloo's teardown (see bench/overlap.py)
    ap = argparse.ArgumentParser(prog="python -m xronos.bench.overlap_wall", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="pair-s64", help=f"comma-separated two-rank cells, of {', '.join(CELLS)}")
    ap.add_argument("--modes", default="off,bwd,c2", help="off, bwd, cN; the first is the baseline")
    ap.add_argument("--iters", type=int, default=10, help="measured iterations per mode")
    ap.add_argument("--warmup", type=int, default=4, help="iterations per mode not counted")
    ap.add_argument("--repeats", type=int, default=3, help="wall + virtual pairs of runs, back to back")
    ap.add_argument("--rate-mbit", type=float, default=1000.0, help="the real link's rate (and the model's)")
    ap.add_argument("--virtual-net", choices=("loopback", "netns"), default="loopback",
                    help="where the virtual runs' real traffic goes: loopback, or the same netns link as the "
                         "wall runs' (the link's time is modelled either way; the CPU the call takes is measured)")
    ap.add_argument("--stack", choices=("probe", "off"), default="probe",
                    help="the virtual link's network-stack CPU per byte: measured by bench.stack_probe on the real "
                         "link first (default), or none (off; also with --virtual-net netns, where it is measured)")
    ap.add_argument("--progress", choices=("probe", "off"), default="off",
                    help="the virtual link's progress delay beside a busy core: none (off, the default), or "
                         "the same probe's figure (probe, with --stack probe; it over-corrects: docs/planning.md)")
    ap.add_argument("--stack-reps", type=int, default=60, help="the stack probe's repeats per size and kind")
    ap.add_argument("--fitted", action="store_true",
                    help="also a virtual run per repeat on the link fitted to the real one (measured rate too)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    names, modes = [c for c in args.cells.split(",") if c], parse_modes(ap, args.modes)
    if args.stack_reps < 5:
        ap.error(f"--stack-reps must be at least 5, got {args.stack_reps}")
    if args.progress == "probe" and not (args.stack == "probe" and args.virtual_net == "loopback"):
        ap.error("--progress probe takes the stack probe's figure: it needs --stack probe and --virtual-net "
                 "loopback (or --progress off)")
    if modes[0] != "off":
        ap.error(f"--modes must start with off (the baseline the gains are measured from), got {modes[0]!r}")
    bad = [c for c in names if c not in CELLS or len(CELLS[c]["speeds"]) != 2]
    if bad:
        ap.error(f"cell(s) {bad}: need two-rank cells of {', '.join(c for c in CELLS if len(CELLS[c]['speeds']) == 2)}")
    if len(os.sched_getaffinity(0)) < 2 or not set(CORES) <= os.sched_getaffinity(0):
        ap.error(f"needs cores {CORES} (one per rank); this process may use {sorted(os.sched_getaffinity(0))}")
    from xronos.bench.netem import Network
    from xronos.node.emulate.confinement import EmulatorError
    from xronos.node.tp import progress

    try:  # what the ranks (which inherit it) do with Gloo's threads: node/tp/progress.py
        threads = progress.mode()
    except ValueError as exc:
        ap.error(str(exc))

    doc: dict = {"argv": argv, "rate_mbit": args.rate_mbit, "load_start": uptime(), "quota": cpu_quota(),
                 "comm_threads": threads,
                 "order": "back to back: per repeat, per cell, the wall run then the virtual run"
                 + (" then the virtual run on the fitted link" if args.fitted else ""),
                 "cores": list(CORES), "cells": []}
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="overlap-wall-"))
    try:
        with Network(2, rate_mbit=args.rate_mbit) as net:
            doc["network"] = net.describe()
            vnet = net if args.virtual_net == "netns" else None
            doc["virtual_net"] = args.virtual_net
            first = CELLS[names[0]]
            config = config_of(first)
            big = first["batch"] * first["seq"] * config["hidden_size"] * 4  # one activation, fp32
            doc["link"] = dict(measure_link(net, tmp, big, args.rate_mbit), cell=names[0])
            print("link:", json.dumps(doc["link"]), flush=True)
            stack_s = progress_s = 0.0
            if args.stack == "probe" and args.virtual_net == "loopback":
                probed = stack_probe.measure(net, tmp / "stack", [big // 4, big // 2, big, 2 * big],
                                             args.stack_reps, rate_mbit=args.rate_mbit)
                doc["stack"] = probed
                stack_s = probed["stack_s_per_byte"]
                if args.progress == "probe":
                    progress_s = probed["progress_s"]
                    if not math.isfinite(progress_s):
                        print("overlap_wall: --progress probe: the stack probe saw no call in flight complete "
                              "during its burst, so it has no progress delay to model", file=sys.stderr)
                        return 2
                print(f"stack: {stack_s * 1e9:.2f} ns a byte; progress delay {probed['progress_s'] * 1e3:.2f} ms"
                      f" ({'modelled' if progress_s else 'not modelled'})", flush=True)
            doc["stack_s_per_byte"], doc["progress_s"] = stack_s, progress_s
            if args.fitted:
                doc["fit_mbit"] = fitted_mbit(big, doc["link"]["big_s"], doc["link"]["latency_s"])
            runs: dict[str, list] = {n: [] for n in names}
            for rep in range(args.repeats):
                for name in names:
                    cell = CELLS[name]
                    print(f"== {name} repeat {rep + 1}/{args.repeats}: wall", flush=True)
                    wall = run_cell(name, cell, args.iters, args.warmup, tmp / f"{name}-{rep}-wall", modes,
                                    {"clock": "wall", "cores": list(CORES)}, placement=net)
                    print(f"== {name} repeat {rep + 1}/{args.repeats}: virtual", flush=True)
                    virtual = run_cell(name, cell, args.iters, args.warmup, tmp / f"{name}-{rep}-virtual", modes,
                                       {"clock": "virtual", "cores": list(CORES), "rate_mbit": args.rate_mbit,
                                        "latency_s": doc["link"]["latency_s"], "stack_s_per_byte": stack_s,
                                        "progress_s": progress_s},
                                       placement=vnet)
                    run = {"rows": pair_rows(wall, virtual), "wall": wall, "virtual": virtual}
                    if args.fitted:
                        print(f"== {name} repeat {rep + 1}/{args.repeats}: virtual, fitted link", flush=True)
                        run["fitted"] = run_cell(name, cell, args.iters, args.warmup, tmp / f"{name}-{rep}-fit",
                                                 modes, {"clock": "virtual", "cores": list(CORES),
                                                         "rate_mbit": doc["fit_mbit"],
                                                         "latency_s": doc["link"]["latency_s"],
                                                         "stack_s_per_byte": stack_s, "progress_s": progress_s},
                                                 placement=vnet)
                        run["rows_fitted"] = pair_rows(wall, run["fitted"])
                    print(json.dumps({k: v for k, v in run.items() if k.startswith("rows")}), flush=True)
                    runs[name].append(run)
    except EmulatorError as exc:
        print(f"overlap_wall: {exc}", file=sys.stderr)
        return 2
    for name in names:
        reps = [r["rows"] for r in runs[name]]
        doc["cells"].append({"cell": name, **CELLS[name], "repeats": reps, "summary": summarise(reps),
                             "runs": [{k: v for k, v in r.items() if not k.startswith("rows")} for r in runs[name]]})
        if args.fitted:
            fits = [r["rows_fitted"] for r in runs[name]]
            doc["cells"][-1].update(repeats_fitted=fits, summary_fitted=summarise(fits))
    doc["load_end"], doc["seconds"] = uptime(), time.monotonic() - t0
    import shutil

    shutil.rmtree(tmp) if not os.environ.get("XRONOS_BENCH_KEEP") else print("kept", tmp)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overlap-wall.json").write_text(json.dumps(doc, indent=1))
    (args.out / "overlap-wall.md").write_text(markdown(doc))
    print((args.out / "overlap-wall.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
