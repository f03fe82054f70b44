"""What an all-reduce costs this node's own CPU: measured in the profile, used by the planner.

A rank that waits in a Gloo collective still pays for it on its own CPU: Gloo's threads copy and
reduce the buffers, and the kernel does the TCP work of every byte sent and received. On a slow
box (or under a CFS quota) that is not free, and no compute profile sees it. The probe runs two
Gloo ranks *inside the profiling process* (two threads, one `ProcessGroupGloo` each, over
loopback), so both share this node's CPU quota and threads, and times all-reduces of the job's
activation `[batch, seq, hidden]` (fp32) and of a few bytes. Over loopback the link is not the
limit: the time is what the CPU needs for two ranks' sending and receiving, which is what one rank
of a ring pays for its own share of both directions (`gateway.commmodel.node_comm`).

A call launched to overlap with compute (`node/tp/overlap.py`) costs the box differently: its
Gloo threads run beside a busy computing thread, and what they take comes out of that compute. The
probe times that too (`_time_launched`), as the CPU the virtual clock charges a launched call.

The probe runs in `PROBE_ROUNDS` rounds, each on a fresh loopback pair, and every figure is taken
over the rounds' calls pooled. One pair's calls share a regime (why, unknown): on a 2-core guest
the median of a launched 196 kB call's CPU over one pair's 30 calls read 0.35-2.8 ms in eight fresh
processes, with a second mode near 3.3 ms, while three pairs pooled read 0.42-0.75 ms; eight
probes back to back on one pair read 0.44-0.49 ms. A single reading decided plans: in one
`bench.choice` run two of the demo's three boxes read 3.3 ms and the third 0.7 ms, and the planner
chose no overlap where overlapping the backward pass measured 4 % faster.
"""

from __future__ import annotations

import statistics
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from xronos.node.emulate.vclock import CALL_STAT, FLIGHT_STAT
from xronos.protocol.messages import CollectiveProfile

SMALL_ELEMENTS = 1  # the latency probe: one fp32 (4 bytes)
PROBE_ROUNDS = 3  # fresh loopback pairs, their calls pooled (module docstring)
_TIMEOUT = timedelta(seconds=120)
# The compute a launched call flies beside: [rows, 256] @ [256, 256] fp32 GEMMs (about 0.1 ms each
# on one core), one after another until the call has completed. Small, so the burst ends soon after
# the call does; a GEMM, so the call competes for the core and its caches as beside a layer's.
_BURST_ROWS, _BURST_WIDTH = 64, 256


def _groups() -> list[dist.ProcessGroup]:
    """Two Gloo ranks of one world in this process (each constructor blocks until both join)."""
    store = dist.HashStore()
    pgs: list[dist.ProcessGroup | None] = [None, None]
    errors: list[BaseException] = []

    def make(rank: int) -> None:
        try:
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(interface="lo")]
            opts._timeout = _TIMEOUT
            pgs[rank] = dist.ProcessGroupGloo(store, rank, 2, opts)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=make, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(_TIMEOUT.total_seconds())
    if errors or any(p is None for p in pgs):
        raise RuntimeError(f"cannot set up the loopback Gloo pair for the collective probe: {errors[:1]}")
    return pgs  # type: ignore[return-value]


def _time(pgs: list[dist.ProcessGroup], elements: int, repeats: int,
          warmup: int) -> tuple[list[list[float]], list[float]]:
    """Blocking all-reduces of `elements` fp32 on one pair, the warm-up left out: each rank's wall
    seconds per call, and the process CPU time of one rank's call (both ranks' calls run at once in
    this process: half the process's CPU over rank 0's call)."""
    times: list[list[float]] = [[], []]
    cpus: list[float] = []
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        x = torch.ones(elements)
        try:
            for _ in range(warmup + repeats):
                t0, c0 = time.perf_counter(), time.process_time()
                pgs[rank].allreduce([x]).wait()
                times[rank].append(time.perf_counter() - t0)
                if rank == 0:
                    cpus.append((time.process_time() - c0) / 2)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"the collective probe failed: {errors[0]}")
    return [ts[warmup:] for ts in times], cpus[warmup:]


def _blocking_seconds(walls: list[list[float]], cpus: list[float], cpu_scale: float | None,
                      cpu_stat: str) -> float:
    """A blocking call's cost from its samples (`_time`'s, the rounds' pooled): the slower rank's
    mean wall seconds, not the median: under a CFS quota a call either fits in the period's quota
    or waits for the next one, and the median of that two-valued distribution flips between them
    (4 B: 0.1 vs 8.7 ms at share 0.3); a training rank pays the mean. With `cpu_scale` (an emulated
    box on the virtual clock: 1 / its speed in host cores) one rank's CPU instead, its `cpu_stat`
    (the clock's estimator: `xronos.node.emulate.estimator`) at the box's speed: what the virtual
    clock charges a call."""
    if cpu_scale is not None:
        from xronos.node.emulate.estimator import statistic

        return statistic(cpus, cpu_stat) * cpu_scale
    return max(statistics.fmean(ts) for ts in walls)


def _time_launched(pgs: list[dist.ProcessGroup], elements: int, repeats: int, warmup: int) -> list[float]:
    """One rank's CPU for each of `repeats` all-reduces of `elements` fp32 it launched
    (`async_op`) and computed beside until the call completed, then waited for, the warm-up left
    out: the process's CPU over the two ranks' round less their computing threads' GEMMs, half of
    it (both ranks' calls fly at once). That is what `flight._Flight` charges a launched call in
    training (its launch, its share of Gloo's threads, its wait).

    Gloo's threads beside a busy thread cost more than beside a waiting one (a 2-core host, 2 MiB:
    medians of 1.1-3.3 ms a call against a blocking call's minimum of 0.6-0.7 ms), which is why it
    is measured apart."""
    calls = warmup + repeats
    bar = threading.Barrier(2, timeout=_TIMEOUT.total_seconds())
    gemm: list[list[float]] = [[0.0] * calls, [0.0] * calls]
    marks: list[float] = [0.0] * calls
    cpus: list[float] = []
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        # one intra-op thread, as a training rank's: an OpenMP pool's workers would add their
        # CPU to the process's, not to the thread's GEMM time
        torch.set_num_threads(1)
        x = torch.ones(elements)
        a, w = torch.randn(_BURST_ROWS, _BURST_WIDTH), torch.randn(_BURST_WIDTH, _BURST_WIDTH)
        try:
            for i in range(calls):
                bar.wait()
                if rank == 0:
                    marks[i] = time.process_time()
                bar.wait()
                work = pgs[rank].allreduce([x])
                spent = 0.0
                while True:
                    c0 = time.thread_time()
                    torch.mm(a, w)
                    spent += time.thread_time() - c0
                    if work.is_completed():
                        break
                gemm[rank][i] = spent
                work.wait()
                bar.wait()
                if rank == 0:
                    cpus.append(max(0.0, time.process_time() - marks[i] - gemm[0][i] - gemm[1][i]) / 2)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
            bar.abort()

    threads_before = torch.get_num_threads()
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(threads_before)
    if errors:
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)] or errors
        raise RuntimeError(f"the launched collective probe failed: {real[0]}")
    return cpus[warmup:]


def _quota_scale() -> float | None:
    """1 / the process's CPU limit in cores when it is below one core (a CFS quota), else None."""
    from xronos.node.box.capabilities import cgroup_cpu_limit

    limit = cgroup_cpu_limit()
    return 1.0 / limit if limit is not None and 0 < limit < 1 else None


def probe_collectives(batch_size: int, seq_len: int, hidden_size: int, *, repeats: int = 30,
                      warmup: int = 3, cpu_scale: float | None = None, cpu_stat: str = CALL_STAT,
                      stack_s_per_byte: float = 0.0, launched_stat: str = FLIGHT_STAT,
                      rounds: int = PROBE_ROUNDS) -> CollectiveProfile:
    """All-reduce cost on this node's CPU at the job's activation size and at 4 bytes (`cpu_scale`:
    see `_blocking_seconds`), blocking and launched beside compute (`_time_launched`, its
    `launched_stat`, times `cpu_scale`; off the virtual clock times 1 / the CPU quota in cores when
    that is below one: `_quota_scale`), each over `rounds` fresh pairs' `repeats` calls pooled
    (module docstring). On the virtual clock (`cpu_scale`) each is charged the network stack's CPU
    the clock's link models beside it too (`stack_s_per_byte` per byte carried: a two-rank ring
    carries the tensor), as `VirtualClock` charges a call, so the profile and the run share one
    ruler."""
    from xronos.node.emulate.estimator import statistic

    elements = batch_size * seq_len * hidden_size
    if elements <= SMALL_ELEMENTS:
        raise ValueError(f"activation of {elements} elements is too small to probe")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    sizes = (SMALL_ELEMENTS, elements)
    walls: dict[int, list[list[float]]] = {n: [[], []] for n in sizes}
    cpus: dict[int, list[float]] = {n: [] for n in sizes}
    launched: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(rounds):
        pgs = _groups()
        try:
            for n in sizes:
                w, c = _time(pgs, n, repeats, warmup)
                walls[n][0] += w[0]
                walls[n][1] += w[1]
                cpus[n] += c
            for n in sizes:
                launched[n] += _time_launched(pgs, n, repeats, warmup)
        finally:
            for pg in pgs:
                shutdown = getattr(pg, "shutdown", None)
                if shutdown is not None:
                    shutdown()
    small, big = (_blocking_seconds(walls[n], cpus[n], cpu_scale, cpu_stat) for n in sizes)
    # off the virtual clock a launched call's CPU comes out of the compute's CPU quota, if any:
    # under a limit of q cores it costs the computing thread 1/q of its seconds in wall time
    l_scale = cpu_scale if cpu_scale is not None else _quota_scale()
    l_small, l_big = (statistic(launched[n], launched_stat) * (1.0 if l_scale is None else l_scale) for n in sizes)
    if cpu_scale is not None:
        small += stack_s_per_byte * 4 * SMALL_ELEMENTS * cpu_scale
        big += stack_s_per_byte * 4 * elements * cpu_scale
        l_small += stack_s_per_byte * 4 * SMALL_ELEMENTS * cpu_scale
        l_big += stack_s_per_byte * 4 * elements * cpu_scale
    return CollectiveProfile(nbytes=4 * elements, seconds=big, small_bytes=4 * SMALL_ELEMENTS,
                             small_seconds=small, repeats=rounds * repeats, launched_seconds=l_big,
                             launched_small_seconds=l_small)
