"""What a real link's network stack takes from a computing core, beyond what the virtual clock
measures of a call over loopback (issue #37): the link's `stack_s_per_byte`.

    .venv/bin/python -m xronos.bench.stack_probe [--sizes 196608,393216,786432,1572864] [--reps 60]

Why: an all-reduce hidden behind compute is not free on the wall clock. On the virtual clock a
call's CPU is its process's threads' (Gloo's), measured over loopback, where the sending thread's
syscalls carry each transfer through the kernel to the receiver at once. On a real link (here the
bench's netns + veth + bridge + tc tbf, `bench.netem`) the kernel sends and delivers from softirqs
on whatever core is running, which, while a call is in flight, is the computing thread's; the
thread's CPU time and wall time grow by it, and the clock, which takes a burst's window minimum,
does not see it. This probe measures that remainder on its own, with no training and no overlap
mode in it:

- two ranks, each process pinned to its own core (every thread, Gloo's too), one intra-op thread;
- a fixed compute burst (a loop of GEMMs, longer than the largest transfer takes on the link),
  timed alone and with one asynchronous all-reduce of `size` bytes launched just before it and
  waited for just after, interleaved, `reps` times per size;
- **steal** (per size): the median, over the reps, of the wall time of launch + burst + wait less
  that of the burst alone just before it, on the real link: what a hidden call costs the core in
  wall time;
- **charge** (per size): what the clock charges the same call over loopback (the process's CPU
  from the launch to the end of the wait, less the computing thread's during the burst: the
  launch, Gloo's threads, the wait), its minimum over the reps as the clock's `call_est`;
- `stack_s_per_byte`: the least-squares slope through the origin of steal (real link) minus
  charge (loopback) over the bytes each rank's link carries (a two-rank all-reduce: the tensor);
- `progress_s`: how much later a call in flight is first seen complete beside the busy core than
  the same call blocking with the core free (the median over sizes and both links).

Both runs' steal and charge are reported, so what loopback itself costs beyond the clock's charge
shows too. Beside them, per size: one blocking all-reduce with the core free, and when the call in
flight was first seen complete (polled between the burst's GEMMs) — a call beside a busy core
moves only when Gloo's threads get the core. The ranks raise those threads as a rank's first
overlapped call does with `XRONOS_COMM_THREADS=fifo` (`node/tp/progress.py`; off by default, and
the result says which). Results: bench/results/stack-probe.md and .json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CORES = (0, 1)  # one rank per core (bench/overlap_wall.py's too)


# -- the arithmetic (pure) -------------------------------------------------------------------------
def per_byte(points: list[tuple[float, float]]) -> float:
    """The least-squares slope through the origin of (bytes, seconds) points, at least 0: a stack
    costs nothing per byte only if the real link stole no more than loopback's charge."""
    if not points or not all(b > 0 and math.isfinite(b) and math.isfinite(s) for b, s in points):
        raise ValueError(f"need points of bytes > 0 and finite seconds, got {points!r}")
    return max(0.0, sum(b * s for b, s in points) / sum(b * b for b, _ in points))


def summarise(rows: dict[str, list[dict]], sizes: list[int]) -> dict[str, dict[str, float]]:
    """Per size (one rank's rows, keyed alone<size> / flight<size>): steal and charge in seconds."""
    out = {}
    for n in sizes:
        alone, flight = rows[f"alone{n}"], rows[f"flight{n}"]
        # paired: each call's burst against the alone burst just before it, so the host's drift over
        # the run (this VM's vCPUs change speed by tens of percent between minutes) cancels
        steal = statistics.median(f["wall"] - a["wall"] for a, f in zip(alone, flight))
        done = [r["done"] for r in flight if r.get("done") is not None]
        out[str(n)] = {"steal_s": steal,
                       "blocking_s": statistics.median(r["blocking"] for r in flight),
                       # when the call was first seen complete, between two GEMMs of the burst
                       "done_s": statistics.median(done) if done else math.nan,
                       "charge_s": min(r["charge"] for r in flight),
                       "thread_s": statistics.median(f["burst_thread"] - a["burst_thread"]
                                                     for a, f in zip(alone, flight))}
    return out


def progress_of(per_size: dict[str, dict[str, float]]) -> float:
    """The link's `progress_s`: how much later a call in flight beside the busy core was first seen
    complete than the same call blocking with the core free, the median over the sizes on the real
    link and on loopback (the delay is the scheduler's, not the wire's: alike on both), at least 0.
    Seen between two GEMMs of the burst, so rounded up by about half a GEMM (0.3-0.6 ms here)."""
    delays = [s[f"{k}_done_s"] - s[f"{k}_blocking_s"] for s in per_size.values() for k in ("real", "loop")]
    delays = [d for d in delays if math.isfinite(d)]
    if not delays:
        raise ValueError("no call in flight was seen complete during its burst: no progress delay to take")
    return max(0.0, statistics.median(delays))


def stack_of(real: list[dict[str, dict[str, float]]], loop: list[dict[str, dict[str, float]]],
             sizes: list[int]) -> dict[str, object]:
    """From both ranks' summaries on the real link and on loopback: per size, the ranks' mean steal
    and charge on each, and the slope of real steal - loopback charge (two ranks: each link carries
    the tensor's bytes)."""
    def mean(runs: list[dict], n: int, k: str) -> float:
        return statistics.fmean(r[str(n)][k] for r in runs)

    per_size = {str(n): {"real_steal_s": mean(real, n, "steal_s"), "real_charge_s": mean(real, n, "charge_s"),
                         "real_thread_s": mean(real, n, "thread_s"), "loop_steal_s": mean(loop, n, "steal_s"),
                         "real_blocking_s": mean(real, n, "blocking_s"), "real_done_s": mean(real, n, "done_s"),
                         "loop_blocking_s": mean(loop, n, "blocking_s"), "loop_done_s": mean(loop, n, "done_s"),
                         "loop_charge_s": mean(loop, n, "charge_s")} for n in sizes}
    slope = per_byte([(n, per_size[str(n)]["real_steal_s"] - per_size[str(n)]["loop_charge_s"]) for n in sizes])
    try:  # an extra figure: a probe whose calls were never seen complete still gives the stack's
        progress = progress_of(per_size)
    except ValueError:
        progress = math.nan
    return {"sizes": per_size, "stack_s_per_byte": slope, "progress_s": progress}


# -- a rank ----------------------------------------------------------------------------------------
def worker(job_file: str, rank_s: str) -> None:
    job, rank = json.loads(Path(job_file).read_text()), int(rank_s)
    os.sched_setaffinity(0, {job["cores"][rank]})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from xronos.node.tp.group import TPGroup

    group = TPGroup.join(rank, 2, job["host"], job["port"], timeout_s=120)
    from xronos.node.tp import progress

    progress.promote()  # as a rank's first overlapped call does (XRONOS_COMM_THREADS)
    tensors = {n: torch.ones(n // 4) for n in job["sizes"]}
    a, w = torch.randn(64, 384), torch.randn(384, 1536)
    t0 = time.thread_time()
    for _ in range(20):
        torch.mm(a, w)
    per_mm = max((time.thread_time() - t0) / 20, 1e-6)
    mms = int(job["burst_s"] / per_mm) + 1

    def burst(done) -> float | None:
        """The burst; the first time between two GEMMs at which `done()` held (None: never)."""
        seen = None
        for _ in range(mms):
            torch.mm(a, w)
            if seen is None and done():
                seen = time.perf_counter()
        return seen

    for t in tensors.values():  # warm: the pairs connected, the buffers touched
        burst(lambda: False)
        dist.all_reduce(t, group=group.pg)
    rows: dict[str, list[dict]] = {f"{k}{n}": [] for n in job["sizes"] for k in ("alone", "flight")}
    for _ in range(job["reps"]):
        for n, t in tensors.items():
            group.barrier(timed=False)
            c0 = time.perf_counter()
            dist.all_reduce(t, group=group.pg)  # blocking: the call's time with the core free
            blocking = time.perf_counter() - c0
            for kind in ("alone", "flight"):
                group.barrier(timed=False)
                p0, w0 = time.process_time(), time.perf_counter()
                work = dist.all_reduce(t, group=group.pg, async_op=True) if kind == "flight" else None
                b0 = time.thread_time()
                seen = burst(work.is_completed if work is not None else lambda: False)
                b1 = time.thread_time()
                if work is not None:
                    work.wait()
                w1, p1 = time.perf_counter(), time.process_time()
                rows[f"{kind}{n}"].append({"wall": w1 - w0, "burst_thread": b1 - b0,
                                           "charge": (p1 - p0) - (b1 - b0), "blocking": blocking,
                                           "done": None if seen is None else seen - w0})
    warm = job["warm"]
    rows = {k: v[warm:] for k, v in rows.items()}
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps(rows))
    group.leave()


def run(net, work: Path, sizes: list[int], reps: int, burst_s: float) -> list[dict]:
    """Both ranks' summaries, on `net` (a `bench.netem.Network`) or, with None, on loopback."""
    from xronos.common.ports import free_port

    work.mkdir(parents=True, exist_ok=True)
    job = {"cores": list(CORES), "host": net.rendezvous_host if net else "127.0.0.1", "port": free_port(),
           "out": str(work), "sizes": sizes, "reps": reps, "warm": min(3, reps - 1), "burst_s": burst_s}
    (work / "job.json").write_text(json.dumps(job))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    procs = [subprocess.Popen([*(net.argv_prefix(r) if net else ()), sys.executable, "-m", "xronos.bench.stack_probe",
                               "worker", str(work / "job.json"), str(r)], env={**env, **(net.env(r) if net else {})},
                              stdout=(work / f"rank{r}.log").open("w"), stderr=subprocess.STDOUT) for r in range(2)]
    codes = [p.wait(timeout=600) for p in procs]
    if any(codes):
        raise RuntimeError(f"stack probe: ranks exited {codes}; see {work}/rank*.log")
    return [summarise(json.loads((work / f"rank{r}.json").read_text()), sizes) for r in range(2)]


def measure(net, work: Path, sizes: list[int], reps: int = 60, burst_s: float | None = None,
            rate_mbit: float = 1000.0) -> dict[str, object]:
    """The probe on `net`'s real link, then on loopback, and the link's `stack_s_per_byte`. The
    burst lasts twice the largest transfer on the link (at least 20 ms), so every call is hidden."""
    burst_s = burst_s or max(0.020, 2 * max(sizes) * 8 / (rate_mbit * 1e6))
    real = run(net, work / "real", sizes, reps, burst_s)
    loop = run(None, work / "loopback", sizes, reps, burst_s)
    return {"reps": reps, "burst_s": burst_s, "cores": list(CORES), "real": real, "loopback": loop,
            **stack_of(real, loop, sizes)}


def markdown(doc: dict) -> str:
    lines = ["# The network stack's CPU beyond the clock's loopback charge (issue #37)", "",
             f"Two ranks pinned one per core (cores {doc['cores'][0]}, {doc['cores'][1]}), one intra-op thread; "
             f"a {doc['burst_s'] * 1e3:.0f} ms GEMM burst alone and with one asynchronous all-reduce in flight "
             f"over it, interleaved, {doc['reps']} times per size (the first 3 not counted), on the real "
             f"{doc['rate_mbit']:g} Mbit/s link (netns + veth + bridge + tc tbf) and on loopback. "
             "**steal**: the median over the reps of the wall time of launch + burst + wait less that of the "
             "burst alone just before it (the ranks' mean); **charge**: what the virtual clock charges the "
             "call (the process's CPU from launch to the end of the wait less the computing thread's during "
             "the burst; its minimum); "
             "**thread**: the computing thread's own CPU time grows by this with the call in flight (softirq "
             "work done in its time); **blocking**: one blocking all-reduce of the size with the core free; "
             "**complete under compute**: when the call in flight was first seen complete (polled between the "
             "burst's GEMMs), from its launch. Wall seconds. Gloo's threads: "
             + ("raised to SCHED_FIFO 1 (`node/tp/progress.py`, as a rank's first overlapped call does)"
                if doc.get("comm_threads", "fifo") == "fifo" else "normal priority (XRONOS_COMM_THREADS=off)")
             + ".", "",
             f"Command: `python -m xronos.bench.stack_probe {' '.join(doc['argv'])}`; {doc['seconds'] / 60:.1f} min. "
             f"Load (`uptime`) at the start: {doc['load_start']}; at the end: {doc['load_end']}.", "",
             "| bytes | real steal ms | real charge ms | real thread ms | loopback steal ms | loopback charge ms "
             "| real steal - loopback charge ms | real: blocking / complete under compute ms "
             "| loopback: blocking / complete under compute ms |", "|---|---|---|---|---|---|---|---|---|"]
    for n, s in doc["sizes"].items():
        lines.append(f"| {int(n)} | {s['real_steal_s'] * 1e3:.3f} | {s['real_charge_s'] * 1e3:.3f} | "
                     f"{s['real_thread_s'] * 1e3:.3f} | {s['loop_steal_s'] * 1e3:.3f} | "
                     f"{s['loop_charge_s'] * 1e3:.3f} | "
                     f"{(s['real_steal_s'] - s['loop_charge_s']) * 1e3:.3f} | "
                     f"{s['real_blocking_s'] * 1e3:.2f} / {s['real_done_s'] * 1e3:.2f} | "
                     f"{s['loop_blocking_s'] * 1e3:.2f} / {s['loop_done_s'] * 1e3:.2f} |")
    lines += ["", f"**stack_s_per_byte = {doc['stack_s_per_byte'] * 1e9:.2f} ns** a byte carried (least squares "
              "through the origin of the real steal less the loopback charge, over the bytes).", "",
              f"**progress_s = {doc['progress_s'] * 1e3:.2f} ms** (the median over the sizes, on both links, of "
              "complete under compute less blocking). A call in flight beside a busy core completes later than "
              "the same call with the core free, because Gloo's threads, which move it forward step by step, "
              "wait for the computing thread to yield the core (the scheduler's slice). A virtual link given "
              "`progress_s` (`Link.progress_s`) delays an asynchronous call by it while the rank computes; "
              "without it the clock completes a call at its link time whatever the core does."]
    return "\n".join(lines) + "\n"


def uptime() -> str:
    """The host's load as `uptime` prints it (a result file's record of what else ran)."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        from xronos.node.rank.spawn import exit_process

        worker(argv[1], argv[2])
        exit_process(0)  # past Gloo's teardown (see bench/overlap.py)
    ap = argparse.ArgumentParser(prog="python -m xronos.bench.stack_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="196608,393216,786432,1572864", help="all-reduce sizes in bytes")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--rate-mbit", type=float, default=1000.0)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s]
    except ValueError:
        ap.error(f"--sizes must be comma-separated byte counts, got {args.sizes!r}")
    if not sizes or any(s < 4 or s % 4 for s in sizes):
        ap.error(f"--sizes must be multiples of 4 bytes (fp32), got {sizes}")
    if args.reps < 5:
        ap.error(f"--reps must be at least 5, got {args.reps}")
    if not set(CORES) <= os.sched_getaffinity(0):
        ap.error(f"needs cores {CORES} (one per rank); this process may use {sorted(os.sched_getaffinity(0))}")
    import tempfile

    from xronos.bench.netem import Network
    from xronos.node.emulate.confinement import EmulatorError
    from xronos.node.tp import progress

    try:  # what the ranks (which inherit it) do with Gloo's threads: node/tp/progress.py
        threads = progress.mode()
    except ValueError as exc:
        ap.error(str(exc))
    t0, start = time.monotonic(), uptime()
    try:
        with Network(2, rate_mbit=args.rate_mbit) as net:
            doc = measure(net, Path(tempfile.mkdtemp(prefix="stack-probe-")), sizes, args.reps,
                          rate_mbit=args.rate_mbit)
    except EmulatorError as exc:
        print(f"stack_probe: {exc}", file=sys.stderr)
        return 2
    doc.update(argv=argv, rate_mbit=args.rate_mbit, load_start=start, load_end=uptime(), seconds=time.monotonic() - t0,
               comm_threads=threads)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stack-probe.json").write_text(json.dumps(doc, indent=1))
    (args.out / "stack-probe.md").write_text(markdown(doc))
    print((args.out / "stack-probe.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
