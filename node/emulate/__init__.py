"""The emulator: one machine standing in for a set of edge boxes.

- `confinement`: per-rank cgroups (CPU quota, memory cap) and the files a rank finds its box in;
- `vclock`: virtual mode (the default): a rank's clock advances by its compute over its box's speed,
  every collective resolved from the ranks' virtual arrivals (`arrivals`) and a modelled link
  (`link`), bursts smoothed by `estimator`;
- `pacer`: pace mode (a rank sleeps to its share's speed at every collective);
- `poller`: quota mode's fine-grained quota enforcement;
- `cgroupfs`: where this process can drive cgroup controllers (read-only).

A rank process asks `process_clock()` once, when it starts, and gives the answer to its `TPGroup`
(the one hook: `xronos.node.tp.clock`); `node/tp` never imports this package.
"""

from __future__ import annotations

from xronos.node.tp.clock import Clock

SERIALIZE_ENV = "XRONOS_EMULATOR_SERIALIZE"
_UNSET = object()
_clock: object = _UNSET


def process_clock() -> Clock | None:
    """This process's emulated clock, None on a real box (wall time); resolved once. A process is
    emulated when the emulator placed it (or its parent) in a rank's group: virtual mode's box file
    or pace mode's share file. A virtual clock counts one thread's CPU time: the process gets one
    intra-op thread."""
    global _clock
    if _clock is _UNSET:
        from xronos.node.emulate import pacer, vclock

        path = pacer.share_file(root=vclock.VCLOCK_ROOT)
        box = vclock.read_box(path)
        if box is not None:
            import os

            import torch

            torch.set_num_threads(1)
            # XRONOS_EMULATOR_SERIALIZE=1: the run's ranks compute one at a time (`VirtualClock`)
            serialize = path.parent / "serialize.lock" if os.environ.get(SERIALIZE_ENV) == "1" else None
            _clock = vclock.VirtualClock(box, path=path, serialize=serialize)
        else:
            p = pacer.current()
            _clock = None if p is None else pacer.PacedClock(p)
    return _clock  # type: ignore[return-value]


def reset_for_tests(clock: Clock | None | object = _UNSET) -> None:
    global _clock
    _clock = clock
