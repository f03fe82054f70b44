"""The profile's all-reduce probe on the virtual clock's ruler: a call's measured CPU at the box's
speed, plus the network stack's CPU the clock's link models beside it (as `VirtualClock` charges
a call). Two real Gloo ranks over loopback, in this process."""

from __future__ import annotations

import pytest

from xronos.node.measure.commprobe import probe_collectives


def test_the_stack_the_link_models_is_charged_per_byte_on_the_virtual_ruler() -> None:
    # 1 ms a byte: far above what the loopback call itself costs, so the sum shows through its noise
    plain = probe_collectives(2, 4, 8, repeats=3, warmup=1, cpu_scale=2.0)
    stacked = probe_collectives(2, 4, 8, repeats=3, warmup=1, cpu_scale=2.0, stack_s_per_byte=1e-3)
    assert plain.nbytes == stacked.nbytes == 2 * 4 * 8 * 4
    assert stacked.seconds == pytest.approx(plain.seconds + 1e-3 * 256 * 2.0, abs=0.05)
    assert stacked.small_seconds == pytest.approx(plain.small_seconds + 1e-3 * 4 * 2.0, abs=0.004)


def test_off_the_virtual_clock_nothing_is_added(monkeypatch) -> None:
    # wall seconds: the real link's stack is in what is timed already. The timing itself is faked
    # here (the pairs stay real), so the check is exact and does not time the machine.
    from xronos.node.measure import commprobe

    monkeypatch.setattr(commprobe, "_time", lambda pgs, elements, *a: 1e-3 * elements)
    wall = probe_collectives(2, 4, 8, repeats=3, warmup=1, stack_s_per_byte=1e-3)
    assert (wall.seconds, wall.small_seconds) == (pytest.approx(1e-3 * 64), pytest.approx(1e-3 * 1))
    virtual = probe_collectives(2, 4, 8, repeats=3, warmup=1, cpu_scale=2.0, stack_s_per_byte=1e-3)
    assert virtual.seconds == pytest.approx(1e-3 * 64 + 1e-3 * 256 * 2.0)
    assert virtual.small_seconds == pytest.approx(1e-3 + 1e-3 * 4 * 2.0)
