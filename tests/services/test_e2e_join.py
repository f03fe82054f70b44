"""End to end over a real broker: a node that joins a running job (issue 14). A job starts on the one
node service that takes part; a second is online but switched off (its Participate switch, as Home
Assistant leaves it in `state_dir/participate.json`). Switched on mid-job (the switch's own
command), it is profiled, the gateway plans with it, and at the owner's next checkpoint the job
moves to a two-rank plan resuming from that checkpoint; it completes and its events say so.

The job is paused while the newcomer profiles (a person may do so; here it keeps the profile
honest: on 2 cores a profile taken beside a training rank is one of a box half as fast).
One rank to two, not two to three: this machine has 2 cores, so a third single-thread rank cannot
make a job faster, and the planner, from the profiles, says so ("not taken: predicted 0.0204 ->
0.0249 s/iteration (22.2% slower)" when this test started two ranks on a model a quarter this size).
The model is sized (H = 768, 32 tokens) for compute to outweigh the all-reduces' cost on loopback.
The gateway runs with `join_restart_s = 0`: a real restart here (seconds: processes importing
torch on a loaded 2-core machine) is not repaid within the steps of a test, and what this test
checks is the path, not the arithmetic of repayment (`tests/gateway/test_jobjoin.py` does that).
The bar on the predicted gain stays the live policy's 5 %. The gateway models the boxes' link as
10 Gbit/s, what their loopback is faster than: at the default 1 Gbit/s the predicted gain of the
second rank was 4.9-8 % (the modelled all-reduces cost about what the second rank saves), so the
test passed or failed by the profile's noise (CI, 2026-12-05: "predicted 0.174 -> 0.166 s/iteration
(4.9% faster): the bar is 5% faster")."""

from __future__ import annotations

import json
import re

import pytest

from jobkit import job_spec, runkit
from stack import Stack
from test_e2e import _load, _wait_step
from xronos.protocol import hastate
from xronos.protocol import messages as m

pytestmark = pytest.mark.slow
STEPS = 80

JOINS = re.compile(r"node 'n1' joins: plan v1 -> v2, predicted ([\d.]+) -> ([\d.]+) s/iteration; "
                   r"resuming from step (\d+)")


def make_case(tmp, rows=80):
    """A GPT-2 classifier whose compute outweighs its all-reduces (H = 768, 3072 MLP columns), and a CSV."""
    return runkit.wide_classifier(tmp, 768, 3072, rows)


def _wait_event(stack, job_id: str, *texts: str, timeout: float = 120.0) -> str:
    """The first event of the job's retained state containing one of `texts`."""
    found: list[str] = []

    def on_state(s: m.JobState) -> None:
        found.extend(e for e in s.events if any(t in e for t in texts))
        if found:
            raise StopIteration

    try:
        stack.client.follow(job_id, on_state, timeout=timeout)
    except StopIteration:
        return found[0]
    raise AssertionError(f"no event with {texts}:\n{stack.logs()}")


def test_a_node_switched_back_to_participate_joins_the_job_at_its_next_checkpoint(tmp_path, mqtt_broker):
    data_dir = tmp_path / "owner-data"
    data_dir.mkdir()
    stack = Stack(tmp_path, mqtt_broker, data_dir, base=f"xr{tmp_path.name[-6:].replace('-', '')}")
    try:
        model, data = make_case(stack.allowed, rows=80)
        stack.gateway(join_restart_s=0.0, bandwidth_mbps=10000.0)
        (tmp_path / "n1").mkdir()
        (tmp_path / "n1" / "participate.json").write_text(json.dumps({"participate": False}))
        for n in ("n0", "n1"):
            stack.node(n)
        nodes = stack.wait_nodes(2)
        assert [x["participate"] for x in sorted(nodes, key=lambda x: x["node_id"])] == [True, False]
        spec = job_spec(model, data, stack.allowed / "export", owner="n0", max_steps=STEPS, checkpoint_interval=10,
                        batch_size=8, seq_len=32, rebalance=True)
        spec.pop("schema_version")
        accepted = stack.client.request("job/submit", 300.0, spec=m.JobSpec(**spec))
        job_id = accepted["job_id"]
        assert [e["node_id"] for e in accepted["plan"]["entries"]] == ["n0"]
        state = _wait_step(stack, job_id, 2)
        assert state.phase == "running", stack.logs()
        # Paused while the newcomer profiles: on 2 cores a profile taken beside a training rank is
        # one of a box half as fast (and its all-reduce probe, one of a slow link).
        stack.client.request("job/pause", 60.0, job_id=job_id)
        stack.client.bus.publish_message(hastate.NodeCommand(participate=True), node_id="n1")
        decided = _wait_event(stack, job_id, "node 'n1' taken", "node 'n1' not taken")
        print(decided)
        stack.client.request("job/resume", 60.0, job_id=job_id)
        assert "node 'n1' taken" in decided, decided
        final = stack.client.follow(job_id, lambda s: None, timeout=300)
        assert final.phase == "completed", (final, stack.logs())
    finally:
        stack.close()

    events = "\n".join(final.events)
    assert final.step == STEPS and final.plan.version == 2, events
    assert [e.node_id for e in final.plan.entries] == ["n0", "n1"]
    assert "node 'n1' is online: profiling it" in events
    assert "node 'n1' taken for plan v2 at the checkpoint of step" in events
    joined = JOINS.findall(events)
    assert len(joined) == 1, events
    old_s, new_s, step = float(joined[0][0]), float(joined[0][1]), int(joined[0][2])
    assert new_s < old_s and step % 10 == 0 and 0 < step < STEPS, events
    assert f"plan v2 (segment): n0=" in events and f"resume from step {step}" in events
    assert "recovering" not in events
    assert final.replans >= 1  # the join counts as a re-plan (and shows as the last one unless a re-shard followed)
    assert _load(stack.allowed / "export") is not None
