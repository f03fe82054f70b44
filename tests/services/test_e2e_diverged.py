"""Over a real broker: a job whose training diverges (its loss stops being finite) ends failed,
with the rank's reason — the step — in the job's state and events, after its last checkpoint and
without an export; the gateway does not re-plan it on the other nodes (it used to recover it
as a node failure, and before the ranks checked their loss, complete it and export)."""

from __future__ import annotations

import json

import pytest

from jobkit import job_spec, make_case
from stack import Stack
from xronos.protocol import messages as m

pytestmark = pytest.mark.slow


def test_a_diverging_job_fails_with_its_step_and_is_not_re_planned(stack: Stack):
    model, data = make_case(stack.allowed, rows=40)
    stack.gateway()
    for n in ("n0", "n1"):
        stack.node(n)
    stack.wait_nodes(2)
    # A job's learning rate is at most 100: with a decay of 1 every step multiplies the weights by -99.
    spec = job_spec(model, data, stack.allowed / "export", owner="n0", lr=100.0, weight_decay=1.0, max_steps=30,
                    checkpoint_interval=2)
    spec.pop("schema_version")
    accepted = stack.client.request("job/submit", 900.0, spec=m.JobSpec(**spec))  # profiles: slow under load
    final = stack.client.follow(accepted["job_id"], lambda s: None, timeout=600)
    assert final.phase == "failed", (final, stack.logs())
    assert "not finite" in final.error and "step " in final.error, final.error
    assert any(" failed: rank " in e and "not finite" in e for e in final.events), final.events
    assert not any("recovering" in e for e in final.events), final.events
    # The last checkpoint is kept on the owner. Looked for on its disk, not in the events: the other
    # rank's report can fail the job before the owner's checkpoint status reaches the gateway.
    ckpt = stack.dir / "n0" / "jobs" / accepted["job_id"] / "checkpoint"
    state = json.loads((ckpt / "state.json").read_text())
    assert 1 <= state["step"] < int(final.error.split("step ")[1].split(":")[0]), (state, final.error)
    assert not (stack.allowed / "export").exists()
