"""Idle at barriers caused by the CPU emulation itself: `python -m xronos.bench.barrier_idle`.

Three real processes in a Gloo group, each in its own emulator cgroup (`Confinement`, top CFS
weight, as `xronos run --strategy` confines ranks), run iterations of `--barriers` segments. In
each segment a rank burns `share x segment` seconds of its own CPU time (calibrated per process on
its thread CPU clock), so on ideal slow cores every rank would finish every segment at the same
moment; then all ranks all-reduce the demo's activation ([8, 16, 384] fp32). Reported per rank,
with the product's definitions (`node.metrics.comm_and_idle`): idle (own time in each all-reduce
minus the fastest rank's) over the iteration, and the segment speed: CPU seconds per wall second
of its segments over its share (1.0 = as fast as a core of that speed; 2.0 = twice as fast).
Nothing here is the model: whatever idle shows up is the emulation's (CFS bandwidth control runs a
rank at full core speed for its quota, then stops it until the period ends) and the barrier's.

    --shares 0.9,0.5,0.3 --segment-ms 1,3,10 --period-us 0,6667,20000
    (period 0: the emulator's own choice, `period_for`; else every rank gets at least that period)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from xronos.node.emulate.poller import POLL_S

ELEMENTS = 8 * 16 * 384  # the demo's activation: batch 8 x seq 16 x hidden 384


def worker(rank: int, world: int, port: int, share: float, seg_s: float, barriers: int, iters: int,
           warmup: int, out: str, core: int = -1) -> None:
    if core >= 0:  # before torch and Gloo start their threads, which inherit it
        os.sched_setaffinity(0, {core})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    a = torch.randn(64, 64)

    def burn(reps: int) -> None:
        for _ in range(reps):
            torch.mm(a, a)

    # reps per CPU second, on this thread's CPU clock (throttling does not count)
    burn(200)
    c0 = time.thread_time()
    burn(3000)
    per_s = 3000 / (time.thread_time() - c0)
    reps = max(1, round(per_s * share * seg_s))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.ones(ELEMENTS)
    from xronos.node.emulate import pacer

    paced = pacer.current()  # the emulator's paced CPU (cpu mode "pace"), else None
    rows = []
    for it in range(warmup + iters):
        own, seg, cpu = [], [], []
        t_it = time.perf_counter()
        for _ in range(barriers):
            t0, c0 = time.perf_counter(), time.thread_time()
            burn(reps)
            t1 = time.perf_counter()
            if paced is not None:  # as TPGroup does at every collective
                paced.pace()
                t1 = time.perf_counter()
            cpu.append(time.thread_time() - c0)
            dist.all_reduce(x)
            own.append(time.perf_counter() - t1)
            if paced is not None:
                paced.restart()
            seg.append(t1 - t0)
        iter_s = time.perf_counter() - t_it
        everyone = [torch.zeros(barriers, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(everyone, torch.tensor(own, dtype=torch.float64))
        fastest = torch.stack(everyone).min(dim=0).values
        if it >= warmup:
            rows.append(dict(iter_s=iter_s, idle_s=float((torch.tensor(own, dtype=torch.float64) - fastest).sum()),
                             comm_s=float(fastest.sum()), seg_s=sum(seg) / len(seg),
                             seg_cpu_s=sum(cpu) / len(cpu)))
    dist.destroy_process_group()
    n = len(rows)
    mean = {k: sum(r[k] for r in rows) / n for k in rows[0]}
    # speed: the rank's segment CPU seconds per wall second over its share (1.0: as slow as its share
    # says; 2.0: it ran its segments twice as fast as a core of that speed would)
    Path(out).write_text(json.dumps(dict(rank=rank, share=share, target_seg_s=seg_s, **mean,
                                         idle_ratio=mean["idle_s"] / mean["iter_s"],
                                         speed=mean["seg_cpu_s"] / mean["seg_s"] / share)))


def start_eaters(conf, cores: list[int]) -> list:
    """Per rank, a spinning process at SCHED_IDLE in the rank's cpu group on the rank's core: it
    spends the quota whenever the rank has nothing runnable, so a rank that waited has not banked
    its quota (an experiment on the emulation, not part of it)."""
    procs = []
    for r, core in enumerate(cores):
        p = subprocess.Popen(["/bin/sh", "-c", "while :; do :; done"], stdin=subprocess.DEVNULL)
        os.sched_setaffinity(p.pid, {core})
        os.sched_setscheduler(p.pid, os.SCHED_IDLE, os.sched_param(0))
        (conf._dir_for(r, conf.cpu) / "cgroup.procs").write_text(str(p.pid))
        procs.append(p)
    return procs


def run(shares: list[float], seg_s: float, period_us: int, barriers: int, iters: int, warmup: int,
        tmp: Path, pin: bool = False, poll_s: float | None = POLL_S, eat: bool = False,
        cpu_mode: str = "quota") -> list[dict]:
    from xronos.node.emulate.confinement import Confinement, RankLimits, assign_cores
    from xronos.node.emulate.cpumode import DEFAULT_PERIOD_US
    from xronos.node.rank.local import free_port

    port = free_port()
    pin = pin and cpu_mode == "quota"  # paced ranks are pinned by the emulator itself
    cores = assign_cores(shares, sorted(os.sched_getaffinity(0))) if pin or eat else [-1] * len(shares)
    outs = [tmp / f"r{r}-{seg_s}-{period_us}.json" for r in range(len(shares))]
    with Confinement([RankLimits(s) for s in shares], period_us=period_us or DEFAULT_PERIOD_US,
                     top_weight=True, poll_s=poll_s, cpu_mode=cpu_mode) as conf:
        eaters = start_eaters(conf, cores) if eat else []
        procs = []
        for r, s in enumerate(shares):
            cmd = [sys.executable, "-m", "xronos.bench.barrier_idle", "--worker", str(r), str(len(shares)),
                   str(port), repr(s), repr(seg_s), str(barriers), str(iters), str(warmup), str(outs[r]), str(cores[r])]
            p = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))
            conf.add(r, p.pid)
            procs.append(p)
        for p in procs:
            if p.wait(600) != 0:
                raise RuntimeError(f"worker failed ({p.returncode})")
        periods = [q.get("period_us", 0) for q in conf.quotas()]
        for e in eaters:
            e.kill()
            e.wait()
    res = [json.loads(o.read_text()) for o in outs]
    for r, p in zip(res, periods):
        r["period_us"] = p
    return res


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        a = sys.argv[2:]
        worker(int(a[0]), int(a[1]), int(a[2]), float(a[3]), float(a[4]), int(a[5]), int(a[6]), int(a[7]), a[8], int(a[9]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shares", default="0.9,0.5,0.3")
    ap.add_argument("--segment-ms", default="1,3,10", help="wall time of a segment at the rank's share")
    ap.add_argument("--period-us", default="0", help="shortest CFS period(s); 0 = the emulator's default")
    ap.add_argument("--pin", default="0", help="0, 1 or 0,1: each rank's process pinned to one core "
                    "(no core over one core's worth of shares)")
    ap.add_argument("--poll", default=str(POLL_S), help="the emulator's poll interval(s) in seconds, "
                    "'none' = quotas enforced at the scheduler tick only (e.g. none,0.0005)")
    ap.add_argument("--eat", default="0", help="0, 1 or 0,1: an idle-priority spinner in each rank's group "
                    "on its (pinned) core, spending the quota while the rank waits (an experiment)")
    ap.add_argument("--cpu-mode", default="quota", help="the emulator's CPU mode(s): quota, pace or quota,pace")
    ap.add_argument("--barriers", type=int, default=30)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", metavar="FILE.json")
    args = ap.parse_args(argv)
    import tempfile

    shares = [float(s) for s in args.shares.split(",")]
    doc = []
    with tempfile.TemporaryDirectory(prefix="xronos-barrier-") as tmp:
        for period in [int(p) for p in args.period_us.split(",")]:
          for seg_ms in [float(s) for s in args.segment_ms.split(",")]:
           for pin in [bool(int(x)) for x in args.pin.split(",")]:
            for poll in [None if x == "none" else float(x) for x in args.poll.split(",")]:
             for eat in [bool(int(x)) for x in args.eat.split(",")]:
              for mode in args.cpu_mode.split(","):
                load = os.getloadavg()[0]
                res = run(shares, seg_ms / 1000, period, args.barriers, args.iters, args.warmup, Path(tmp), pin, poll,
                          eat, mode)
                doc.append(dict(period_us=period, segment_ms=seg_ms, pin=pin, poll_s=poll, eat=eat, cpu_mode=mode,
                                load=load, ranks=res))
                print(f"{mode} poll {poll} {'eat ' if eat else ''}{'pinned' if pin else 'free  '} segment {seg_ms:5.1f} ms  periods " + "/".join(f"{r['period_us'] / 1000:.2f}" for r in res)
                      + " ms  idle " + "/".join(f"{100 * r['idle_ratio']:4.1f}" for r in res)
                      + " %  segment speed/share " + "/".join(f"{r['speed']:.2f}" for r in res)
                      + f"  iter {res[0]['iter_s'] * 1000:.0f} ms (ideal {args.barriers * seg_ms:.0f} + comm "
                      f"{res[0]['comm_s'] * 1000:.0f})  load {load:.1f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(args=vars(args), runs=doc), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
