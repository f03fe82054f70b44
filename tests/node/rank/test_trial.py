"""The overlap trial's schedule and decision (node/rank/trial.py), pure: which mode each step runs,
which steps count, and which mode is kept."""

from __future__ import annotations

import pytest

from xronos.node.rank.trial import TIE, Trial, pick
from xronos.protocol.messages import Overlap, OverlapTrial

OFF, BWD, C2 = Overlap(backward=False, chunks=1), Overlap(backward=True, chunks=1), Overlap(backward=True, chunks=2)


def test_the_warm_up_runs_the_first_mode_then_the_modes_take_turns_step_by_step() -> None:
    t = Trial(OverlapTrial(modes=[C2, OFF, BWD], rounds=1, after=2), start=10)
    assert [t.mode(s) for s in range(10, 18)] == [C2, C2, C2, OFF, BWD, C2, OFF, BWD]
    assert t.last == 17 and t.fits(18) and not t.fits(17)


def test_only_the_rounds_count_and_the_medians_are_per_mode() -> None:
    t = Trial(OverlapTrial(modes=[OFF, C2], rounds=3, after=1), start=0)
    # step 0 is warm-up, steps 1 and 2 each mode's first (their one-time costs): not counted
    for step, s in enumerate([9.0, 7.0, 8.0, 1.0, 2.0, 3.0, 2.5, 1.2, 2.4]):
        t.record(step, s)
    t.record(9, 100.0)  # after the trial: not counted
    assert t.samples == [[1.0, 3.0, 1.2], [2.0, 2.5, 2.4]]
    assert t.medians() == [1.2, 2.4]


def test_a_decision_before_every_mode_has_a_sample_is_refused() -> None:
    t = Trial(OverlapTrial(modes=[OFF, C2]), start=0)
    t.record(4, 1.0)
    with pytest.raises(RuntimeError, match="a mode has no sample"):
        t.medians()


def test_the_least_slowest_rank_median_wins_and_ties_go_to_the_earlier_mode() -> None:
    t = Trial(OverlapTrial(modes=[C2, OFF, BWD]), start=4)
    out = t.decide([0.30, 0.25, 0.26])
    assert out.kept == OFF and out.kept_label == "off" and out.step == 4 + 2 + 12
    assert out.seconds == {"c2": 0.30, "off": 0.25, "bwd": 0.26}
    assert "kept off" in out.text("virtual") and "virtual clock" in out.text("virtual")
    assert pick([1.0, 1.0 - TIE / 2]) == 0  # within the tie: the plan's own mode stays
    assert pick([1.0, 0.98, 0.975]) == 1  # the third is not 1 % below the second
    with pytest.raises(ValueError, match="2 medians for 3 modes"):
        t.decide([0.1, 0.2])
