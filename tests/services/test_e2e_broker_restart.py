"""The broker restarted mid-job (a Home Assistant user restarting the Mosquitto add-on): the ranks
train on over Gloo meanwhile, gateway and nodes reconnect and announce themselves again (a broker
without persistence has lost every retained message), and the job completes without a recovery;
nothing the ranks published during the outage is lost (it is flushed on reconnect)."""

from __future__ import annotations

import time

import pytest

from jobkit import job_spec, make_case
from stack import Stack
from xronos.protocol import messages as m

pytestmark = pytest.mark.slow


def test_a_broker_restart_mid_job_costs_the_job_nothing(tmp_path, fresh_mqtt_broker):
    data_dir = tmp_path / "owner-data"
    data_dir.mkdir()
    stack = Stack(tmp_path, fresh_mqtt_broker, data_dir)
    try:
        model, data = make_case(stack.allowed, rows=80)
        stack.gateway()
        for n in ("n0", "n1"):
            stack.node(n)
        stack.wait_nodes(2)
        spec = job_spec(model, data, stack.allowed / "export", owner="n0", max_steps=300, checkpoint_interval=50,
                        batch_size=8)
        spec.pop("schema_version")
        job_id = stack.client.request("job/submit", 300.0, spec=m.JobSpec(**spec))["job_id"]
        seen: list[m.JobState] = []

        def on_state(s: m.JobState) -> None:
            seen.append(s)
            if s.step >= 20 or s.phase in ("completed", "failed", "cancelled"):
                raise StopIteration

        try:
            stack.client.follow(job_id, on_state, timeout=180)
        except StopIteration:
            pass
        assert seen and seen[-1].phase == "running", (seen[-1:], stack.logs())

        fresh_mqtt_broker.stop()
        time.sleep(3.0)  # longer than the services' keepalive (2 s): every client notices
        fresh_mqtt_broker.start()

        assert len(stack.wait_nodes(2, timeout=60)) == 2  # announced again on an empty broker
        final = stack.client.follow(job_id, lambda s: None, timeout=300)
    finally:
        stack.close()
    assert final.phase == "completed" and final.step == 300, (final, stack.logs())
    assert not any("recovering" in e for e in final.events), "\n".join(final.events)
    assert final.plan is not None and final.plan.version == 1, final.events
    assert (stack.allowed / "export" / "config.json").is_file()
