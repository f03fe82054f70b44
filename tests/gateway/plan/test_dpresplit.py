"""The data-parallel re-split policy (`gateway.plan.dpresplit`), pure, on hand-computed cases."""

from __future__ import annotations

from dataclasses import replace

import pytest

from xronos.gateway.plan.dpresplit import GroupCost, Resplitter, carries_on, group_costs
from xronos.gateway.plan.rebalance import PolicyConfig
from xronos.gateway.plan.refit import unit_costs
from xronos.protocol.layout import Layout

QUICK = PolicyConfig(warmup=1, settle=2, confirm=2, noise_margin=0.0, cooldown=4, max_cooldown=16)


def feed(p: Resplitter, times, steps: int, start: int = 0):
    """`steps` complete steps of these group times, a decision asked after each; the decisions made."""
    out = []
    for s in range(start, start + steps):
        p.observe(times)
        d = p.decide(s + 1)
        if d is not None:
            out.append(d)
    return out


def test_a_slow_group_loses_rows_after_warm_up_settling_and_confirmation() -> None:
    # Both profiled at 1 s per 4 rows, nothing fixed. Measured at 2 rows each: 0.5 s and 1.5 s, so
    # t0(r) = r/4, t1(r) = 3r/4: the least slowest split of 4 rows is 3,1 (0.75 s each), 50 % faster.
    p = Resplitter((2, 2), 4, [GroupCost(1.0, 0.0)] * 2, config=QUICK)
    reasons = []
    for s in range(3):
        p.observe([0.5, 1.5])
        assert p.decide(s + 1) is None
        reasons.append(p.last_reason)
    assert reasons[0] == "warming up"  # the first step is not measured
    assert reasons[1].startswith("settling: groups [0, 1]")  # one sample of two
    assert reasons[2].endswith("seen 1 of 2 times")  # hysteresis: twice in a row
    p.observe([0.5, 1.5])
    d = p.decide(4)
    assert d is not None and (d.step, d.old, d.new) == (4, (2, 2), (3, 1))
    assert d.predicted_old_s == pytest.approx(1.5) and d.predicted_new_s == pytest.approx(0.75)
    assert d.gain == pytest.approx(0.5) and d.predicted_group_s == pytest.approx((0.75, 0.75))
    assert d.reason == "predicted 1.5000 -> 0.7500 s per iteration (50.0% faster), nothing moves"
    assert p.shares == (3, 1) and p.last_reason == f"re-split at step 4: rows per group [3, 1]: {d.reason}"
    # Under the new split the times agree with the model: nothing more to do.
    assert feed(p, [0.75, 0.75], 8, 4) == []
    assert p.last_reason.startswith("kept rows [3, 1]: predicted gain 0.0%")


def test_the_bar_a_gain_below_the_threshold_keeps_the_split() -> None:
    # 16 rows at 8,8, measured 1.0 and 1.25 s (c0 = 2, c1 = 2.5 s at 16 rows): 9,7 gives 1.125 s
    # and 1.09375 s, 10 % faster than 1.25 s.
    base = [GroupCost(1.0, 0.0)] * 2
    kept = Resplitter((8, 8), 16, base, config=replace(QUICK, threshold=0.15))
    assert feed(kept, [1.0, 1.25], 10) == []
    assert kept.last_reason == "kept rows [8, 8]: predicted gain 10.0% <= 15.0% (threshold 15.0% + measurement noise)"
    moved = Resplitter((8, 8), 16, base, config=replace(QUICK, threshold=0.05))
    (d,) = feed(moved, [1.0, 1.25], 5)
    assert d.new == (9, 7) and d.gain == pytest.approx(0.1)
    # Noise raises the bar: the same medians from scattered samples are not enough.
    noisy = Resplitter((8, 8), 16, base, config=replace(QUICK, threshold=0.05, noise_margin=2.0, settle=5))
    for s, slow in enumerate([0.7, 1.25, 1.8, 1.0, 1.5, 1.25, 0.8, 1.7]):
        noisy.observe([1.0, slow])
        assert noisy.decide(s + 1) is None
    assert "<= " in noisy.last_reason and "measurement noise" in noisy.last_reason


def test_the_share_paid_whatever_the_rows_can_leave_a_slow_group_no_rows() -> None:
    # a = 0.5, B_p = 4; at 2 rows group 0 measures 0.75 s (c = 0.75 / 0.75 = 1), group 1 1.5 s (c = 2):
    # t0(r) = 0.5 + 0.125 r, t1(r) = 1 + 0.25 r. Each row goes to group 0 (at most 1.0 s), never
    # to group 1 (1.25 s for its first row): 4,0, 1.0 s instead of 1.5 s.
    p = Resplitter((2, 2), 4, [GroupCost(1.0, 0.5)] * 2, config=QUICK)
    (d,) = feed(p, [0.75, 1.5], 5)
    assert d.new == (4, 0) and d.predicted_new_s == pytest.approx(1.0) and d.gain == pytest.approx(1 / 3)


def test_a_group_that_lost_its_rows_keeps_its_last_measured_speed() -> None:
    # The case above: group 1 (c = 2 s) went to 0 rows. Group 0 then measures its model's 1.0 s at 4
    # rows; group 1 measures only its optimizer step (ignored) and keeps c = 2: its first row would
    # cost 1.25 s, more than group 0's whole batch. Scaled like the measured group instead (c = 1)
    # it would look as fast as group 0 and win rows back once the cooldown is over: an oscillation.
    p = Resplitter((2, 2), 4, [GroupCost(1.0, 0.5)] * 2, config=QUICK)
    (d,) = feed(p, [0.75, 1.5], 5)
    assert d.new == (4, 0) and p.last_scale == [1.0, 2.0]
    assert feed(p, [1.0, 0.05], 12, 5) == []
    assert p.last_reason.startswith("kept rows [4, 0]: predicted gain 0.0%")


def test_a_group_with_no_rows_keeps_its_profile_estimate_at_the_measured_scale() -> None:
    # Group 0 (profiled 1 s per 4 rows) measures 2 s at 4 rows: the boxes run at 2x their profile.
    # Group 1, with no rows, was profiled twice as fast (0.5 s): t1(r) = 0.5 x 2 x r/4 = r/4, while
    # t0(r) = r/2. What group 1 measures (its optimizer step only) is not its rows' time: ignored.
    p = Resplitter((4, 0), 4, [GroupCost(1.0, 0.0), GroupCost(0.5, 0.0)], config=QUICK)
    (d,) = feed(p, [2.0, 100.0], 5)
    assert d.new == (1, 3) and d.predicted_group_s == pytest.approx((0.5, 0.75)) and d.scale == (2.0, 2.0)
    assert d.gain == pytest.approx(0.625)
    # Memory: group 1 fits one row only (its limit), so 3,1.
    capped = Resplitter((4, 0), 4, [GroupCost(1.0, 0.0), GroupCost(0.5, 0.0)], max_rows=[4, 1], config=QUICK)
    (d,) = feed(capped, [2.0, 100.0], 5)
    assert d.new == (3, 1) and d.predicted_new_s == pytest.approx(1.5)


def test_in_the_cooldown_only_a_resplit_that_carries_on_is_made() -> None:
    p = Resplitter((2, 2), 4, [GroupCost(1.0, 0.0)] * 2, config=replace(QUICK, cooldown=8))
    (d,) = feed(p, [0.5, 1.5], 5)
    assert d.new == (3, 1)
    # Now group 1 looks fast (0.25 s for its 1 row): the model says 2,2 — back the way it came.
    assert feed(p, [0.75, 0.25], 3, 5) == []
    assert p.last_reason.startswith("cooling down") and "take back" in p.last_reason
    # Once the cooldown is over, the evidence may undo it (twice in a row).
    (d,) = feed(p, [0.75, 0.25], 6, 8)
    assert d.new == (2, 2)
    assert carries_on((2, 2), (3, 1), (4, 0)) and not carries_on((2, 2), (3, 1), (2, 2))
    assert not carries_on(None, (3, 1), (4, 0))


def test_group_costs_take_each_groups_slowest_rank_per_segment() -> None:
    # unit costs: one second per whole kind. tp = 2 at attn 6/6, mlp 64/36, vocab 0/37: per group the
    # slowest rank per kind is 0.5 + 0.64 + 1.0 = 2.14 s; the fixed share is the slowest rank's (rank 1:
    # 0.5 + 0.36 + 1.0 = 1.86 s beats rank 0's 1.14 s).
    nodes = unit_costs(["a", "b", "c", "d"])
    nodes = [replace(n, rows_fixed=f) for n, f in zip(nodes, (0.1, 0.2, 0.3, 0.4))]
    layout = Layout(attn=(6, 6), mlp=(64, 36), vocab=(0, 37))
    costs = group_costs(nodes, layout, 2)
    assert [c.full_s for c in costs] == pytest.approx([2.14, 2.14])
    assert [c.fixed for c in costs] == [0.2, 0.4]
    with pytest.raises(ValueError, match="3 nodes for 2 data-parallel groups of 2 ranks"):
        group_costs(nodes[:3], layout, 2)


@pytest.mark.parametrize("kwargs,match", [
    ({"shares": (2, -1)}, r"rows per group must be >= 0"),
    ({"shares": (0, 0)}, r"at least one in all"),
    ({"shares": (2, 2, 0)}, r"2 group costs for 3 shares"),
    ({"profile_rows": 0}, r"profile rows must be >= 1"),
    ({"base": [GroupCost(0.0, 0.0)] * 2}, r"group 0: profile time must be finite and > 0"),
    ({"max_rows": [4]}, r"1 row limits for 2 groups"),
])
def test_bad_settings_are_refused_naming_the_value(kwargs, match) -> None:
    settings = {"shares": (2, 2), "profile_rows": 4, "base": [GroupCost(1.0, 0.0)] * 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        Resplitter(**settings)
    p = Resplitter((2, 2), 4, [GroupCost(1.0, 0.0)] * 2)
    with pytest.raises(ValueError, match=r"group 1: compute seconds must be finite and >= 0, got nan"):
        p.observe([1.0, float("nan")])
    with pytest.raises(ValueError, match=r"3 groups measured, the split has 2"):
        p.observe([1.0, 1.0, 1.0])
