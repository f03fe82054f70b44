"""The interleaved bench's bookkeeping (pure): phases, per-phase figures, pairs and their spread."""

from __future__ import annotations

import pytest

from xronos.bench.interleave import pair_figures, phase_figures, schedule


def records(times: list[list[float]], idle: list[list[float]] | None = None) -> list[list[dict]]:
    idle = idle or [[0.0] * len(t) for t in times]
    return [[{"step": i, "iteration_s": t, "idle_s": d} for i, (t, d) in enumerate(zip(ts, ds))]
            for ts, ds in zip(times, idle)]


def test_schedule_alternates_uniform_then_xronos_and_refuses_bad_counts():
    assert schedule(2, 4) == [(0, "uniform"), (4, "xronos"), (8, "uniform"), (12, "xronos")]
    for pairs, phase in ((0, 4), (2, 1)):
        with pytest.raises(ValueError, match="pairs >= 1 and phase >= 2"):
            schedule(pairs, phase)


def test_a_phase_leaves_out_its_warm_up_and_takes_the_slowest_rank_per_step():
    ranks = records([[9, 9, 1.0, 1.0, 5, 5], [9, 9, 1.2, 0.8, 5, 5]], [[0, 0, 0.2, 0.0, 0, 0], [0, 0, 0.0, 0.4, 0, 0]])
    f = phase_figures(ranks, 0, 4, 2)
    assert f["steps"] == 2
    assert f["iteration_s"] == pytest.approx(1.1)  # max(1.0, 1.2) and max(1.0, 0.8)
    assert f["idle"] == [pytest.approx(0.1 / 1.1), pytest.approx(0.2 / 1.1)]
    assert f["worst_idle"] == pytest.approx(0.2 / 1.1)
    with pytest.raises(ValueError, match="longer than its warm-up"):
        phase_figures(ranks, 0, 2, 2)


def test_pairs_ratio_and_spread():
    # phases of 3 steps, 1 left out: uniform 2.0, xronos 1.8, uniform 2.2, xronos 1.87
    t = [9, 2.0, 2.0, 9, 1.8, 1.8, 9, 2.2, 2.2, 9, 1.87, 1.87]
    f = pair_figures(records([t, t]), 2, 3, 1)
    assert f["ratios"] == [pytest.approx(0.9), pytest.approx(0.85)]
    assert f["spread"] == pytest.approx(0.05 / 0.875)
    assert f["pairs"][1]["uniform"]["iteration_s"] == pytest.approx(2.2)
