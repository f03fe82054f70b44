"""How the profiler's clock readings become layer times: where the profiled rank waits as training
does (`collective_pause_s`), and how the hooks that split an iteration into layers are kept from
biasing them — their CPU taken out on the wall clock (`without_hook_overhead`), the total taken
from the iterations without hooks on the virtual clock (`to_plain_total`). The method itself is in
`xronos.node.measure.profiler`'s docstring."""

from __future__ import annotations

import statistics

import structlog

log = structlog.get_logger(__name__)

# The pause without a CPU quota (and on the virtual clock): long enough for the kernel to put the
# thread to sleep, as a wait in a Gloo collective does; under a quota it is one CFS period (see
# `collective_pause_s`).
DEFAULT_PAUSE_S = 0.001


def collective_pause_s() -> float:
    """How long the profiled rank waits at each skipped collective. A training rank blocks in every
    collective; under a CFS quota (the emulator, a container's CPU limit) it comes back with its
    whole quota for the period and runs it at full core speed. Measured on the real MiniLM at
    shares 0.9/0.5/0.3 a profile taken back to back mispredicted the ranks' compute by 44.7 %
    (MAPE; 5.5-13.5 % with the pause, bench/results/prediction-error.md). One period is the longest a wait can matter: the quota refills every period.

    On the virtual clock a wait banks no quota, but the thread that slept still pays for having
    slept: the compute after each wait costs it more CPU than the same compute back to back. Two
    ranks of MiniLM at halves, speed 1.0, batch 8 x 16 (thread CPU per iteration, window minimum,
    25 collectives): alone 63.4-68.2 ms, alone with a sleep at every skipped collective 70.5-73.2 ms
    (whatever the sleep, 0.2 to 3 ms), in a real Gloo group 70.7-73.1 ms; at a 0.15 share 29.9,
    34.3 and 35.6 ms. So the virtual profile sleeps too (DEFAULT_PAUSE_S), or it predicts each
    rank's compute low by ~0.2-0.3 ms a collective, most on the small shards of slow boxes."""
    import os

    from xronos.node.box.capabilities import cgroup_cpu_period_s

    from xronos.node.emulate import process_clock

    clock = process_clock()
    if clock is not None and clock.name != "virtual":
        return 0.0  # a paced rank sleeps at every reading of the profiler's clock already (its pacer)
    forced = os.environ.get("XRONOS_PROFILE_PAUSE_S")  # for measuring the pause's effect (0: none)
    if forced is not None:
        value = float(forced)
        if not 0 <= value < 1:
            raise ValueError(f"XRONOS_PROFILE_PAUSE_S must be in [0, 1) s, got {forced!r}")
        return value
    if clock is not None:
        return DEFAULT_PAUSE_S  # virtual: no quota refills; the wake-up after the wait is what to mimic
    period = cgroup_cpu_period_s()
    return DEFAULT_PAUSE_S if period is None else period


def profile_passes() -> int:
    """How many times the profiler times each width: 2 on the virtual clock under the window
    minimum, else 1. This host's thread CPU time has slow phases of about a second (a fixed GEMM
    burst back to back on an idle 2-core guest: per-second medians 16.7-25.0 ms, per-second minima
    16.1-18.4 ms over a minute), and a width's set, timed in a fraction of a second, can fall in
    one whole: on `bench.choice`'s overlap-demo profiles every layer of one width read 30-50 %
    above the same width on the other boxes (same host, times x speed), which the affine fit turns
    into a node's intercept two to three times the others'. Training's clock takes each burst's
    minimum over a window spanning many seconds; a second pass, in reverse order and seconds
    later, gives each width a second draw, and the lesser is kept (noise only adds time)."""
    from xronos.node.emulate import process_clock

    clock = process_clock()
    box = getattr(clock, "box", None)
    return 2 if box is not None and box.estimator == "min" else 1


def virtual_cpu_scale() -> tuple[float | None, str]:
    """1 / the box's speed on the virtual clock and the statistic the clock takes of a call's CPU
    (the window minimum, `VirtualClock.call_est`), else (None, "min")."""
    from xronos.node.emulate import process_clock
    from xronos.node.emulate.vclock import CALL_STAT

    clock = process_clock()
    box = getattr(clock, "box", None)
    return (None, CALL_STAT) if box is None else (1.0 / box.host_cores, CALL_STAT)


def virtual_stack_s_per_byte() -> float:
    """The network-stack CPU per byte carried that the virtual clock's link charges beside a call's
    measured CPU (`Link.stack_s_per_byte`), 0 off the virtual clock."""
    from xronos.node.emulate import process_clock

    box = getattr(process_clock(), "box", None)
    return 0.0 if box is None else box.link.stack_s_per_byte


def without_hook_overhead(med: dict[str, float], hooked: list[tuple[float, float]],
                          plain: list[tuple[float, float]]) -> dict[str, float]:
    """Layer medians with the hooks' own cost taken out of the block's layers. The module hooks
    that split the iteration cost CPU (full backward hooks wrap the block's and its regions'
    inputs and outputs): about 1 ms per iteration on the MiniLM block at 1/6 width, +11% of its
    forward and backward, a cost the block's layers would be charged B times. It is measured as
    the CPU time of the hooked iterations minus that of the same iterations without hooks (CPU
    time: a shared machine's wall clock is noisier than the difference), turned into wall seconds
    at the hooked iterations' wall-per-CPU ratio, and taken from the block's layers in proportion
    to their times. (wall, CPU) pairs; nothing changes when the hooks cost nothing measurable."""
    if not hooked or not plain:
        return med
    cpu_h = statistics.median(c for _, c in hooked)
    cpu_p = statistics.median(c for _, c in plain)
    wall_h = statistics.median(w for w, _ in hooked)
    over = (cpu_h - cpu_p) * (wall_h / cpu_h if cpu_h > 0 else 1.0)
    blk = {k: v for k, v in med.items() if k.startswith("blk.")}
    total = sum(blk.values())
    if over <= 0 or total <= 0:
        return med
    over = min(over, 0.5 * total)  # a bound against a noisy measurement, never the whole block
    log.debug("profile.hook_overhead", seconds=round(over, 6), block_s=round(total, 6))
    return {k: (v - over * v / total if k in blk else v) for k, v in med.items()}


def to_plain_total(med: dict[str, float], plain: list[tuple[float, float]]) -> dict[str, float]:
    """On the virtual clock: the layers' medians scaled to sum to the plain iteration's (`plain`:
    (clock, CPU) pairs of the iterations without hooks, whose bursts end where training's do, at
    the collectives). Every hook reading ends a burst, and the clock charges a burst the minimum
    of its recent samples, so the hooked iteration's many small minima carried the noise of each
    piece: four profiles of MiniLM on one quiet host (speed 1.0, the one-block set, the 6-block
    prediction) gave 148-222 ms at full width and 24-50 ms at a 0.09 share with the hooks' cost
    taken out by process CPU (`without_hook_overhead`, which the wall clock keeps), 164-179 and
    33-42 ms (three of four at 33.2-33.6) sized by the plain iteration, whose builds read within
    5 % of each other; the 6-block model in a real three-rank group read 118, 60 and 37 ms at 2/3,
    1/4 and 0.09. The hooks' own cost goes with the rescaling."""
    total = sum(med.values())
    if not plain or total <= 0:
        return med
    k = statistics.median(w for w, _ in plain) / total
    log.debug("profile.to_plain_total", factor=round(k, 4), hooked_s=round(total, 6))
    return {key: v * k for key, v in med.items()}
