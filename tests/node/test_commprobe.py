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


def _fake_timing(monkeypatch, blocking, launched, groups: list | None = None) -> None:
    """The pairs and the timing faked (nothing times the machine): `blocking(elements)` and
    `launched(elements)` give one round's samples; `groups` counts the pairs made."""
    from xronos.node.measure import commprobe

    def make_groups():
        if groups is not None:
            groups.append(1)
        return []

    monkeypatch.setattr(commprobe, "_groups", make_groups)

    def time_blocking(pgs, elements, repeats, warmup):
        samples = blocking(elements)
        return [samples, samples], samples

    monkeypatch.setattr(commprobe, "_time", time_blocking)
    monkeypatch.setattr(commprobe, "_time_launched", lambda pgs, elements, repeats, warmup: launched(elements))


def test_off_the_virtual_clock_nothing_is_added(monkeypatch) -> None:
    # wall seconds: the real link's stack is in what is timed already
    _fake_timing(monkeypatch, lambda el: [1e-3 * el] * 3, lambda el: [2e-3 * el] * 3)
    wall = probe_collectives(2, 4, 8, repeats=3, warmup=1, stack_s_per_byte=1e-3)
    assert (wall.seconds, wall.small_seconds) == (pytest.approx(1e-3 * 64), pytest.approx(1e-3 * 1))
    assert (wall.launched_seconds, wall.launched_small_seconds) == (pytest.approx(2e-3 * 64), pytest.approx(2e-3))
    virtual = probe_collectives(2, 4, 8, repeats=3, warmup=1, cpu_scale=2.0, stack_s_per_byte=1e-3)
    assert virtual.seconds == pytest.approx(2 * 1e-3 * 64 + 1e-3 * 256 * 2.0)
    assert virtual.small_seconds == pytest.approx(2 * 1e-3 + 1e-3 * 4 * 2.0)
    assert virtual.launched_seconds == pytest.approx(2 * 2e-3 * 64 + 1e-3 * 256 * 2.0)


def test_off_the_virtual_clock_a_launched_call_costs_its_cpu_over_the_quota(monkeypatch) -> None:
    # Under a CFS quota of a quarter core the compute loses four wall seconds for each CPU second
    # Gloo's threads take from the quota; without a quota (or at one core and more) its CPU seconds.
    from xronos.node.box import capabilities

    _fake_timing(monkeypatch, lambda el: [1e-3], lambda el: [1e-3])
    for limit, want in ((0.25, 4e-3), (None, 1e-3), (2.0, 1e-3)):
        monkeypatch.setattr(capabilities, "cgroup_cpu_limit", lambda limit=limit: limit)
        p = probe_collectives(2, 4, 8, repeats=3, warmup=1)
        assert (p.launched_seconds, p.launched_small_seconds) == (pytest.approx(want), pytest.approx(want))
    monkeypatch.setattr(capabilities, "cgroup_cpu_limit", lambda: 0.25)
    p = probe_collectives(2, 4, 8, repeats=3, warmup=1, cpu_scale=2.0)  # the virtual clock's own scale wins
    assert p.launched_seconds == pytest.approx(2e-3)


def test_the_rounds_pairs_are_pooled_before_the_statistic(monkeypatch) -> None:
    # Three fresh pairs; the second pair's launched calls all sit in the slow regime. The median of
    # the pooled calls is the typical call's, where that pair's own median would be 3.3 ms; the
    # blocking call takes the minimum over every pair's calls, the wall mean averages them all.
    groups: list[int] = []
    # per round: the 4-byte call, then the activation's (the same samples for both here)
    pairs = [[0.5e-3, 0.6e-3, 0.7e-3], [3.3e-3, 3.3e-3, 3.4e-3], [0.4e-3, 0.5e-3, 0.6e-3]]
    launched = iter([p for p in pairs for _ in range(2)])
    blocking = iter([b for b in ([2e-3, 4e-3], [1e-3, 5e-3], [3e-3, 3e-3]) for _ in range(2)])
    _fake_timing(monkeypatch, lambda el: next(blocking), lambda el: next(launched), groups)
    p = probe_collectives(2, 4, 8, repeats=3, warmup=1, cpu_scale=1.0, launched_stat="med", cpu_stat="min")
    assert len(groups) == 3 and p.repeats == 9
    assert p.launched_seconds == pytest.approx(0.6e-3)  # pooled median (the second pair's: 3.3 ms)
    assert p.seconds == pytest.approx(1e-3)  # pooled minimum
    blocking = iter([b for b in ([2e-3, 4e-3], [1e-3, 5e-3], [3e-3, 3e-3]) for _ in range(2)])
    launched = iter([p for p in pairs for _ in range(2)])
    wall = probe_collectives(2, 4, 8, repeats=3, warmup=1)
    assert wall.seconds == pytest.approx(3e-3)  # the mean over every pair's calls


def test_one_round_is_one_pair(monkeypatch) -> None:
    groups: list[int] = []
    _fake_timing(monkeypatch, lambda el: [1e-3], lambda el: [1e-3], groups)
    assert probe_collectives(2, 4, 8, repeats=3, warmup=1, rounds=1).repeats == 3 and len(groups) == 1


@pytest.mark.parametrize("rounds", [0, -1, 1.5, True])
def test_a_round_count_that_is_not_a_positive_integer_is_refused(rounds) -> None:
    with pytest.raises(ValueError, match="rounds must be a positive integer"):
        probe_collectives(2, 4, 8, rounds=rounds)
