"""The join bench's pure parts: the slowest rank per step, the join and the gateway's decision read
from the job's events, and the summary arithmetic (before/after, restart, steps redone, break-even)."""

from __future__ import annotations

import pytest

from xronos.bench.joinsummary import break_even, decision, find_join, slowest, static_over, summarize_join

JOIN = ("11:31:40 node 'n2' joins: plan v1 -> v2, predicted 0.883 -> 0.65 s/iteration; resuming from step 70")
TAKEN = ("11:31:12 node 'n2' taken for plan v2 at the checkpoint of step 70: predicted 0.883 -> 0.65 s/iteration "
         "(26.4% faster), ~35.2 s saved over 60 steps against a restart's ~16.1 s (measured: assignment to first "
         "metrics)")
NOT = ("11:31:12 node 'n2' not taken: predicted 0.883 -> 0.9 s/iteration (1.9% slower): the bar is 5% faster")


def _m(t, version, rank, step, it):
    return {"t": t, "plan_version": version, "rank": rank, "step": step, "iteration_s": it}


def _run():
    """Plan v1 on 2 ranks (rank 1 the slower, 1.0 s) to step 72; the join resumes from 70 on 3 ranks
    (rank 2 the slowest, 0.6 s; its first two steps 2.0 s, the restart's transient)."""
    ms, t = [], 0.0
    for step in range(1, 73):
        t += 1.0
        ms += [_m(t, 1, 0, step, 0.9), _m(t + 0.01, 1, 1, step, 1.0)]
    cancel = t + 0.5
    t = cancel + 12.0  # the restart: 12 s from the cancel to the first step of v2
    for step in range(71, 81):
        slow = 2.0 if step <= 72 else 0.6
        ms += [_m(t, 2, 0, step, 0.5), _m(t, 2, 1, step, 0.55), _m(t + 0.02, 2, 2, step, slow)]
        t += slow
    states = [{"t": 5.0, "plan_version": 1}, {"t": cancel, "plan_version": 2}, {"t": cancel + 1, "plan_version": 2}]
    return ms, states


def test_slowest_takes_the_slowest_rank_per_version_and_step_and_its_last_arrival():
    per = slowest([_m(1.0, 1, 0, 1, 0.9), _m(1.2, 1, 1, 1, 1.1), _m(3.0, 2, 0, 1, 0.4)])
    assert per[(1, 1)]["iteration_s"] == 1.1 and per[(1, 1)]["ranks"] == {0, 1} and per[(1, 1)]["t"] == 1.2
    assert per[(2, 1)]["iteration_s"] == 0.4


def test_the_join_and_the_decision_are_read_from_the_events():
    assert find_join(["x", JOIN]) == {"old_version": 1, "new_version": 2, "predicted_before_s": 0.883,
                                      "predicted_after_s": 0.65, "resume_step": 70}
    assert find_join([TAKEN, NOT]) is None
    d = decision(["11:30:01 node 'n2' is online: profiling it for the job's next plan", TAKEN, JOIN])
    assert d["taken"] is True and d["at_checkpoint"] == 70 and d["gateway_restart_estimate_s"] == 16.1
    assert d["restart_estimate_source"] == "measured: assignment to first metrics"
    d = decision([NOT])
    assert d["taken"] is False and d["why"].startswith("predicted 0.883 -> 0.9")
    assert decision([])["taken"] is None


def test_summary_of_a_join():
    ms, states = _run()
    s = summarize_join(ms, states, [TAKEN, JOIN])
    assert s["joined"] and s["before_s"] == 1.0 and s["after_s"] == pytest.approx(0.6)
    assert s["after_steps"] == list(range(73, 81)) and s["ranks_after"] == 3
    # a step is done when its last rank reports: the new plan's first at cancel + 12.02 s
    assert s["redone_steps"] == 2 and s["restart_s"] == pytest.approx(12.02)
    assert s["restart_from_last_old_step_s"] == pytest.approx(12.5 + 0.02 - 0.01)
    # the restart's cost: 12.02 s plus the 2 redone steps at 0.6 s; 0.4 s saved per iteration
    assert s["restart_cost_s"] == pytest.approx(13.22) and s["break_even_iterations"] == pytest.approx(33.05)


def test_summary_without_a_join_says_so_with_the_time_before():
    ms, _ = _run()
    s = summarize_join([x for x in ms if x["plan_version"] == 1], [], [NOT])
    assert s["joined"] is False and s["before_s"] == 1.0 and s["decision"]["taken"] is False


def test_break_even_never_when_the_join_saves_nothing_and_unknown_without_figures():
    assert break_even(1.0, 1.1, 10.0, 1)["break_even_iterations"] is None
    assert break_even(1.0, None, 10.0, 1) == {"saved_per_iteration_s": None, "restart_cost_s": None,
                                               "break_even_iterations": None}


def test_static_over_takes_the_static_runs_median_on_the_join_runs_steps():
    ms = [_m(float(s), 1, r, s, 1.0 + 0.01 * s + 0.1 * r) for s in range(1, 11) for r in range(2)]
    assert static_over(ms, [8, 9, 10, 11]) == pytest.approx(1.19)
    assert static_over(ms, [20]) is None


def test_steps_beside_the_newcomers_profile_are_reported_apart_from_the_time_before():
    ms, states = _run()
    for x in ms:  # steps 10..20 (ending at t 10.01..20.01) ran beside the profile, at 1.5 s
        if x["plan_version"] == 1 and 10 <= x["step"] <= 20 and x["rank"] == 1:
            x["iteration_s"] = 1.5
    s = summarize_join(ms, states, [TAKEN, JOIN], profiling=(9.5, 20.5))
    assert s["before_s"] == 1.0 and s["while_profiling_s"] == 1.5 and s["profiling_s"] == 11.0
    assert summarize_join(ms, states, [TAKEN, JOIN])["while_profiling_s"] is None
