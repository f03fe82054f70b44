"""The virtual clock measured against itself and against wall time: `python -m xronos.bench.vclock_bench`.

Real ranks (processes in one Gloo group through `TPGroup`, each on a `VirtualClock`) run iterations
of `--barriers` segments of synthetic compute (a calibrated number of small GEMMs on one thread),
each followed by an all-reduce of the demo's activation ([8, 16, 384] fp32). Every figure is
taken twice in the same run: on the virtual clock and on the wall clock beside it.

- `validate`: where wall time is faithful, i.e. every rank alone on a whole core, no quota, link
  modelled as free (so a collective costs its callers' CPU only). Cases: one rank; two ranks pinned
  one per core, balanced and 2:1. Per case, the medians over iterations of the iteration time on
  both clocks, and the difference accounted for term by term (sums over an iteration's segments,
  rank 0's view): `off_cpu` (segment wall - its thread CPU: preemption, stalls), `estimator` (its
  thread CPU - the estimate the clock charged), `collectives` (wall time in the all-reduces - their
  virtual time: the loopback transfer and the wait for the peer, vs the modelled cost and virtual
  idle); `unexplained` is what is left. Idle per rank on both clocks (the product's definition:
  own time in a collective minus the fastest rank's, over the iteration).
- `floor`: balanced work on emulated boxes of different speeds (a rank's segment is its speed times
  `--segment-ms` of CPU, so ideal boxes all finish together): virtual idle per rank is the floor
  the clock itself adds. `--load N` adds N spinning processes (foreign load) to the host.

Results: JSON and Markdown into bench/results (vclock-validation.*, vclock-floor.*), each naming its
clock and the host's load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ELEMENTS = 8 * 16 * 384  # the demo's activation
RESULTS = Path(__file__).resolve().parent / "results"


def worker(a: argparse.Namespace) -> None:
    if a.pin:
        os.sched_setaffinity(0, {a.rank % os.cpu_count()})  # before torch and Gloo start threads
    import torch

    from xronos.node.emulate.link import Link
    from xronos.node.emulate.vclock import Box, VirtualClock
    from xronos.node.tp.group import TPGroup

    torch.set_num_threads(1)
    m = torch.randn(96, 96)

    def burn(reps: int) -> None:
        for _ in range(reps):
            torch.mm(m, m)

    burn(300)
    speeds = [float(s) for s in a.speeds.split(",")]
    work = [float(w) for w in a.work.split(",")]
    # the same reps per unit of work on every rank (calibrated once by the parent: a rank calibrating
    # itself under contention would get less work per nominal millisecond than its peers)
    reps = max(1, round(a.per_ms * a.segment_ms * work[a.rank]))
    link = Link(1e15, 0.0) if a.free_link else Link()
    clock = VirtualClock(Box(speeds[a.rank], link, a.estimator, a.window))
    group = TPGroup.join(a.rank, len(speeds), "127.0.0.1", a.port, 300, clock=clock)
    x = torch.ones(ELEMENTS)
    rows = []
    for it in range(a.warmup + a.iters):
        group.drain_spans()
        acc0 = clock.account.compute
        t0v, t0w = group.now(), time.perf_counter()
        seg_wall, seg_cpu, coll_wall = [], [], []
        for _ in range(a.barriers):
            w0, c0 = time.perf_counter(), time.thread_time()
            burn(reps)
            seg_wall.append(time.perf_counter() - w0)
            seg_cpu.append(time.thread_time() - c0)
            w1 = time.perf_counter()
            group.all_reduce(x)
            coll_wall.append(time.perf_counter() - w1)
        group.settle()
        t1v, wall = group.now(), time.perf_counter() - t0w
        spans = [s for s in group.drain_spans() if s.name != "mark"]
        estimate = (clock.account.compute - acc0) * speeds[a.rank]  # host CPU seconds the clock charged
        coll_virtual = [s.seconds for s in spans]
        if len(speeds) > 1:  # the product's idle: own time in each collective minus the fastest rank's
            own = torch.tensor([coll_virtual, coll_wall], dtype=torch.float64)
            allr = torch.stack(group.all_gather(own, timed=False))  # [world, 2, C]
            fastest = allr.min(dim=0).values
            idle_v, idle_w = (float((own[k] - fastest[k]).sum()) for k in (0, 1))
        else:
            idle_v = idle_w = 0.0
        if it >= a.warmup:
            rows.append(dict(virtual_s=t1v - t0v, wall_s=wall, seg_wall=sum(seg_wall), seg_cpu=sum(seg_cpu),
                             estimate=estimate, coll_wall=sum(coll_wall), coll_virtual=sum(coll_virtual),
                             idle_virtual=idle_v, idle_wall=idle_w, seg_walls=seg_wall))
    group.leave()
    Path(a.out).write_text(json.dumps(dict(rank=a.rank, speed=speeds[a.rank], work=work[a.rank], reps=reps,
                                           rows=rows)))


def calibrate() -> float:
    """Small GEMMs per CPU millisecond of this thread (the best of five tries)."""
    import torch

    torch.set_num_threads(1)
    m = torch.randn(96, 96)
    best = 0.0
    for _ in range(5):
        c0 = time.thread_time()
        for _ in range(2000):
            torch.mm(m, m)
        best = max(best, 2 / (time.thread_time() - c0))
    return best


def run_case(speeds: list[float], work: list[float], *, segment_ms: float, barriers: int, iters: int, warmup: int,
             estimator: str, pin: bool, free_link: bool, window: int = 32) -> list[dict]:
    from xronos.node.rank.local import free_port

    port, per_ms = free_port(), calibrate()
    with tempfile.TemporaryDirectory(prefix="xronos-vclock-") as tmp:
        outs = [Path(tmp) / f"r{r}.json" for r in range(len(speeds))]
        procs = [subprocess.Popen(
            [sys.executable, "-m", "xronos.bench.vclock_bench", "worker", "--rank", str(r), "--port", str(port),
             "--speeds", ",".join(map(repr, speeds)), "--work", ",".join(map(repr, work)),
             "--segment-ms", repr(segment_ms), "--barriers", str(barriers), "--iters", str(iters),
             "--warmup", str(warmup), "--estimator", estimator, "--per-ms", repr(per_ms), "--window", str(window), "--out", str(outs[r]),
             *(["--pin"] if pin else []), *(["--free-link"] if free_link else [])],
            env=dict(os.environ, OMP_NUM_THREADS="1")) for r in range(len(speeds))]
        for p in procs:
            if p.wait(1200) != 0:
                raise RuntimeError(f"a rank failed ({p.returncode})")
        return [json.loads(o.read_text()) for o in outs]


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def account(ranks: list[dict]) -> dict:
    """Rank 0's medians and the wall - virtual difference term by term; idle per rank, both clocks."""
    r0 = ranks[0]["rows"]
    v, w = med(r0, "virtual_s"), med(r0, "wall_s")
    terms = {"off_cpu": med(r0, "seg_wall") - med(r0, "seg_cpu"),
             "estimator": med(r0, "seg_cpu") - med(r0, "estimate"),
             "collectives": med(r0, "coll_wall") - med(r0, "coll_virtual")}
    diff = w - v
    idle = [(statistics.mean(x["idle_virtual"] / x["virtual_s"] for x in rk["rows"]),
             statistics.mean(x["idle_wall"] / x["wall_s"] for x in rk["rows"])) for rk in ranks]
    return dict(virtual_s=v, wall_s=w, ratio=w / v, diff_s=diff, terms=terms,
                unexplained_s=diff - sum(terms.values()), unexplained_pct=100 * (diff - sum(terms.values())) / w,
                idle=idle, idle_terms=idle_terms(ranks) if len(ranks) > 1 else None,
                spread_pct=100 * statistics.pstdev(x["virtual_s"] for x in r0) / v)


def idle_terms(ranks: list[dict]) -> list[dict]:
    """The wall clock's idle per rank, term by term (seconds per iteration, means over iterations),
    and the virtual clock's idle set against the part of it the work makes:

    - `systematic`: segments x (the longest rank's mean segment - this rank's): what the ranks' mean
      segment lengths make a rank wait, the idle a plan can act on.
    - `jitter`: what the segments' variation adds: in each segment a rank waits for whichever rank
      ran longest *that time* (the mean of a maximum is above the maximum of the means). The window
      minimum removes it by design (a burst is charged its recurring best): the host's per-burst
      noise, not the boxes'.
    - `exit`: the rest of the wall idle: ranks leaving a loopback collective at different moments
      (the virtual clock releases them together).

    The two clocks' iterations differ too (the loopback transfer's wall time against the modelled
    link's; jitter and exit), so `systematic_pct` is the systematic idle over the wall iteration less
    those terms: the iteration the virtual clock models. `left_points` = virtual idle % - that: what
    is left once the terms are accounted (the estimator's bias differing between bursts of unequal
    size, off-CPU time differing between the ranks)."""
    iters = min(len(rk["rows"]) for rk in ranks)
    n = len(ranks)
    rows_of = [rk["rows"][:iters] for rk in ranks]
    mean_seg = [statistics.mean(v for x in rows for v in x["seg_walls"]) for rows in rows_of]
    out = []
    for r in range(n):
        mine = rows_of[r]
        lag = statistics.mean(
            sum(max(seg) - seg[r] for seg in zip(*(rows_of[q][i]["seg_walls"] for q in range(n))))
            for i in range(iters))
        wall_s = statistics.mean(x["wall_s"] for x in mine)
        idle_w = statistics.mean(x["idle_wall"] for x in mine)
        systematic = len(mine[0]["seg_walls"]) * (max(mean_seg) - mean_seg[r])
        transfer_excess = statistics.mean((x["coll_wall"] - x["idle_wall"]) - (x["coll_virtual"] - x["idle_virtual"])
                                          for x in mine)
        jitter, exit_ = lag - systematic, idle_w - lag
        base = wall_s - transfer_excess - jitter - exit_
        virt = statistics.mean(x["idle_virtual"] for x in mine) / statistics.mean(x["virtual_s"] for x in mine)
        out.append(dict(virtual_pct=100 * virt, wall_pct=100 * idle_w / wall_s, systematic_s=systematic,
                        jitter_s=jitter, exit_s=exit_, transfer_excess_s=transfer_excess,
                        systematic_pct=100 * systematic / base, left_points=100 * virt - 100 * systematic / base))
    return out


def spinners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(["/bin/sh", "-c", "while :; do :; done"], stdin=subprocess.DEVNULL) for _ in range(n)]


def cmd_validate(a: argparse.Namespace) -> dict:
    cases = [("one rank, one core", [1.0], [1.0]),
             ("two ranks pinned, balanced", [1.0, 1.0], [1.0, 1.0]),
             ("two ranks pinned, 2:1 work", [1.0, 1.0], [2.0, 1.0])]
    out = []
    for name, speeds, work in cases:
        load = os.getloadavg()
        for est in a.estimators.split(","):
            ranks = run_case(speeds, work, segment_ms=a.segment_ms, barriers=a.barriers, iters=a.iters,
                             warmup=a.warmup, estimator=est, pin=True, free_link=True)
            acc = account(ranks)
            out.append(dict(case=name, estimator=est, load_before=load, load_after=os.getloadavg(), **acc))
            print(f"{name:<28} {est:<5} wall {acc['wall_s']:.4f} virtual {acc['virtual_s']:.4f} "
                  f"wall/virtual {acc['ratio']:.3f}  off-CPU {acc['terms']['off_cpu']:.4f} estimator "
                  f"{acc['terms']['estimator']:.4f} collectives {acc['terms']['collectives']:.4f} unexplained "
                  f"{acc['unexplained_pct']:.1f} %  idle v/w " + " ".join(f"{100 * i:.1f}/{100 * j:.1f}"
                                                                    for i, j in acc["idle"])
                  + f"  load {load[0]:.1f}"
                  + ("  idle left, points " + " ".join(f"{t['left_points']:+.1f}" for t in acc["idle_terms"])
                     if acc["idle_terms"] else ""), flush=True)
    return dict(kind="validate", clock="virtual and wall side by side", args=vars(a), cases=out)


def cmd_floor(a: argparse.Namespace) -> dict:
    speeds = [float(s) for s in a.speeds.split(",")]
    out = []
    for load_n in [int(x) for x in a.load.split(",")]:
        hogs = spinners(load_n)
        try:
            time.sleep(3 if load_n else 0)
            for rep in range(a.repeats):
                for est in a.estimators.split(","):
                    load = os.getloadavg()
                    ranks = run_case(speeds, speeds, segment_ms=a.segment_ms, barriers=a.barriers, iters=a.iters,
                                     warmup=a.warmup, estimator=est, pin=False, free_link=False)
                    idle = [statistics.mean(x["idle_virtual"] / x["virtual_s"] for x in rk["rows"]) for rk in ranks]
                    wall_idle = [statistics.mean(x["idle_wall"] / x["wall_s"] for x in rk["rows"]) for rk in ranks]
                    spread = 100 * statistics.pstdev(x["virtual_s"] for x in ranks[0]["rows"]) / med(ranks[0]["rows"], "virtual_s")
                    out.append(dict(spinners=load_n, repeat=rep, estimator=est, load=load, idle_virtual=idle,
                                    idle_wall=wall_idle, iteration_spread_pct=spread,
                                    virtual_s=med(ranks[0]["rows"], "virtual_s"), wall_s=med(ranks[0]["rows"], "wall_s")))
                    print(f"+{load_n} spinners rep {rep} {est:<4} virtual idle " + "/".join(f"{100 * i:.1f}" for i in idle)
                          + " %  (wall idle " + "/".join(f"{100 * i:.1f}" for i in wall_idle)
                          + f" %)  iteration spread {spread:.1f} %  load {load[0]:.1f}", flush=True)
        finally:
            for h in hogs:
                h.kill()
                h.wait()
    return dict(kind="floor", clock="virtual (wall beside)", args=vars(a), runs=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xronos.bench.vclock_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    for k, t in (("rank", int), ("port", int), ("speeds", str), ("work", str), ("segment-ms", float), ("per-ms", float),
                 ("barriers", int), ("iters", int), ("warmup", int), ("estimator", str), ("window", int),
                 ("out", str)):
        w.add_argument(f"--{k}", type=t, required=True)
    w.add_argument("--pin", action="store_true")
    w.add_argument("--free-link", action="store_true")
    for name in ("validate", "floor"):
        p = sub.add_parser(name)
        p.add_argument("--segment-ms", type=float, default=3.0, help="CPU milliseconds of a segment (x work or speed)")
        p.add_argument("--barriers", type=int, default=24)
        p.add_argument("--iters", type=int, default=20)
        p.add_argument("--warmup", type=int, default=4)
        p.add_argument("--estimators", default="med,min", help="virtual clock estimators to compare")
        p.add_argument("--out", type=Path, default=RESULTS)
        p.add_argument("--name", default=None)
    fl = sub.choices["floor"]
    fl.add_argument("--speeds", default="0.9,0.5,0.3", help="the boxes' speeds in host cores")
    fl.add_argument("--load", default="0,4", help="foreign spinning processes per series (e.g. 0,4)")
    fl.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    if a.cmd == "worker":
        worker(a)
        return 0
    doc = cmd_validate(a) if a.cmd == "validate" else cmd_floor(a)
    doc["host"] = dict(cpu_count=os.cpu_count(), finished_load=os.getloadavg())
    name = a.name or f"vclock-{a.cmd}"
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str))
    (a.out / f"{name}.md").write_text(render(doc))
    print(f"wrote {a.out / name}.json, .md")
    return 0


def render(doc: dict) -> str:
    """The Markdown table of a run (clock and load named)."""
    a = doc["args"]
    if doc["kind"] == "validate":
        lines = [f"### Virtual clock vs wall time where wall time is faithful\n",
                 f"`python -m xronos.bench.vclock_bench validate --segment-ms {a['segment_ms']} --barriers "
                 f"{a['barriers']} --iters {a['iters']} --warmup {a['warmup']} --estimators {a['estimators']}`. "
                 "Clocks: **virtual** (VirtualClock, free link: a collective costs its callers' process CPU) and "
                 "**wall** (perf_counter) of the same iterations; ranks pinned one per core, no quota. Medians over "
                 "iterations, rank 0; terms in ms per iteration (wall - virtual = off-CPU + estimator + collectives "
                 "+ unexplained).\n",
                 "| case | estimator | load | wall s | virtual s | wall/virtual | off-CPU ms | estimator ms | "
                 "collectives ms | unexplained % of wall | idle % virtual / wall per rank |",
                 "|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in doc["cases"]:
            t = c["terms"]
            lines.append(f"| {c['case']} | {c['estimator']} | {c['load_before'][0]:.1f} | {c['wall_s']:.4f} | "
                         f"{c['virtual_s']:.4f} | {c['ratio']:.3f} | {1e3 * t['off_cpu']:.2f} | "
                         f"{1e3 * t['estimator']:.2f} | {1e3 * t['collectives']:.2f} | {c['unexplained_pct']:.1f} | "
                         + " · ".join(f"{100 * i:.1f} / {100 * j:.1f}" for i, j in c["idle"]) + " |")
        lines += ["", "Idle term by term (`idle_terms`; ms per iteration, means over iterations): the wall "
                  "clock's idle = systematic (the ranks' mean segment lengths: what the work makes a rank wait) + "
                  "jitter (each segment waits for whichever rank ran longest that time; the window minimum removes "
                  "it by design) + exit (ranks leaving a loopback collective at different moments; the virtual "
                  "clock releases them together). Systematic % is over the wall iteration less the loopback "
                  "transfer's excess over the modelled link, jitter and exit (the iteration the virtual clock "
                  "models); left = virtual idle % - systematic %, in points.\n",
                  "| case | estimator | rank | virtual idle % | wall idle % | systematic ms | jitter ms | exit ms | "
                  "transfer excess ms | systematic % | left, points |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in doc["cases"]:
            for r, t in enumerate(c.get("idle_terms") or []):
                lines.append(f"| {c['case']} | {c['estimator']} | {r} | {t['virtual_pct']:.1f} | {t['wall_pct']:.1f} | "
                             f"{1e3 * t['systematic_s']:.2f} | {1e3 * t['jitter_s']:.2f} | {1e3 * t['exit_s']:.2f} | "
                             f"{1e3 * t['transfer_excess_s']:.2f} | {t['systematic_pct']:.1f} | {t['left_points']:+.1f} |")
        return "\n".join(lines) + "\n"
    lines = [f"### Idle floor of balanced work on the virtual clock\n",
             f"`python -m xronos.bench.vclock_bench floor --speeds {a['speeds']} --load {a['load']} --repeats "
             f"{a['repeats']} --segment-ms {a['segment_ms']} --barriers {a['barriers']} --iters {a['iters']} "
             f"--estimators {a['estimators']}`. Clock: **virtual** (idle per rank as the product defines it; the "
             "wall clock's beside it, for scale). Each rank's segment is its speed x segment-ms of CPU: ideal boxes "
             "finish together, so any idle is the clock's floor.\n",
             "| spinners | repeat | estimator | load | virtual idle % per rank | wall idle % per rank | "
             "iteration spread % (virtual) |", "|---|---|---|---|---|---|---|"]
    for r in doc["runs"]:
        lines.append(f"| {r['spinners']} | {r['repeat']} | {r['estimator']} | {r['load'][0]:.1f} | "
                     + " / ".join(f"{100 * i:.1f}" for i in r["idle_virtual"]) + " | "
                     + " / ".join(f"{100 * i:.1f}" for i in r["idle_wall"]) + f" | {r['iteration_spread_pct']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
