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
    # a call launched beside compute is charged the same stack
    assert stacked.launched_seconds == pytest.approx(plain.launched_seconds + 1e-3 * 256 * 2.0, abs=0.05)


def test_a_launched_call_is_timed_beside_compute_on_its_own_cpu() -> None:
    # Real Gloo pair, real GEMMs beside each call: the launched figures are the call's CPU (not the
    # GEMMs', which would be milliseconds), and the intra-op threads the probe set are given back.
    import torch

    threads = torch.get_num_threads()
    wall = probe_collectives(2, 4, 8, repeats=5, warmup=1)
    virtual = probe_collectives(2, 4, 8, repeats=5, warmup=1, cpu_scale=3.0)
    for p in (wall, virtual):
        assert 0 < p.launched_small_seconds and 0 < p.launched_seconds < 0.05
    assert torch.get_num_threads() == threads


def test_off_the_virtual_clock_nothing_is_added(monkeypatch) -> None:
    # wall seconds: the real link's stack is in what is timed already. The timing itself is faked
    # here (the pairs stay real), so the check is exact and does not time the machine.
    from xronos.node.measure import commprobe

    monkeypatch.setattr(commprobe, "_time", lambda pgs, elements, *a: 1e-3 * elements)
    monkeypatch.setattr(commprobe, "_time_launched", lambda pgs, elements, *a: 2e-3 * elements)
    wall = probe_collectives(2, 4, 8, repeats=3, warmup=1, stack_s_per_byte=1e-3)
    assert (wall.seconds, wall.small_seconds) == (pytest.approx(1e-3 * 64), pytest.approx(1e-3 * 1))
    assert (wall.launched_seconds, wall.launched_small_seconds) == (pytest.approx(2e-3 * 64), pytest.approx(2e-3))
    virtual = probe_collectives(2, 4, 8, repeats=3, warmup=1, cpu_scale=2.0, stack_s_per_byte=1e-3)
    assert virtual.seconds == pytest.approx(1e-3 * 64 + 1e-3 * 256 * 2.0)
    assert virtual.small_seconds == pytest.approx(1e-3 + 1e-3 * 4 * 2.0)
    assert virtual.launched_seconds == pytest.approx(2e-3 * 64 + 1e-3 * 256 * 2.0)


def test_off_the_virtual_clock_a_launched_call_costs_its_cpu_over_the_quota(monkeypatch) -> None:
    # Under a CFS quota of a quarter core the compute loses four wall seconds for each CPU second
    # Gloo's threads take from the quota; without a quota (or at one core and more) its CPU seconds.
    from xronos.node.box import capabilities
    from xronos.node.measure import commprobe

    scales: list[float | None] = []
    monkeypatch.setattr(commprobe, "_time", lambda *a: 1e-3)
    monkeypatch.setattr(commprobe, "_time_launched", lambda pgs, el, rep, wu, scale, stat: scales.append(scale) or 1e-3)
    for limit, want in ((0.25, 4.0), (None, None), (2.0, None)):
        monkeypatch.setattr(capabilities, "cgroup_cpu_limit", lambda limit=limit: limit)
        scales.clear()
        probe_collectives(2, 4, 8, repeats=3, warmup=1)
        assert scales == [want, want]
    scales.clear()
    monkeypatch.setattr(capabilities, "cgroup_cpu_limit", lambda: 0.25)
    probe_collectives(2, 4, 8, repeats=3, warmup=1, cpu_scale=2.0)  # the virtual clock's own scale wins
    assert scales == [2.0, 2.0]
