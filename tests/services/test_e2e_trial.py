"""A job that lets the planner choose its overlap mode (`overlap: auto`), end to end over a real
broker: the plan carries an overlap trial, the ranks measure the modes against each other, the
owner tells the gateway which mode it kept, and the job completes (the trial changes only the
timing: tests/node/test_overlap_run.py compares such a run with single-device training)."""

from __future__ import annotations

import pytest

from jobkit import job_spec, make_case
from xronos.gateway.plan.auto import TRIAL_MIN_RUN
from xronos.protocol import messages as m

pytestmark = pytest.mark.slow


def test_an_auto_overlap_job_tries_its_modes_and_reports_the_one_it_kept(stack):
    model, data = make_case(stack.allowed, rows=80)
    stack.gateway()
    for n in ("n0", "n1"):
        stack.node(n)
    stack.wait_nodes(2)
    steps = TRIAL_MIN_RUN * (2 + 4 * 3)  # the shortest run a three-mode trial is planned for
    spec = job_spec(model, data, stack.allowed / "export", owner="n0", max_steps=steps, checkpoint_interval=steps,
                    rebalance=False, overlap="auto")
    spec.pop("schema_version")
    accepted = stack.client.request("job/submit", 300.0, spec=m.JobSpec(**spec))
    trial = m.OverlapTrial.model_validate(accepted["plan"]["trial"])
    labels = [m.overlap_label(x) for x in trial.modes]
    assert len(labels) == 3 and "off" in labels and trial.steps == 14, accepted["plan"]
    final = stack.client.follow(accepted["job_id"], lambda s: None, timeout=300)
    assert final.phase == "completed" and final.step == steps, (final, stack.logs())
    assert any(f"overlap trial of {', '.join(labels)} over its first 14 steps" in e for e in final.events)
    (told,) = [e for e in final.events if "overlap trial (" in e]
    assert all(f"{x} " in told for x in labels) and "from step 14" in told and " kept " in told, told
