"""The node service over the in-memory FakeBus: announcing, the owner's inspection, assignment
checks (including payloads claiming another node), the participate switch."""

from __future__ import annotations

import json

import pytest

from jobkit import job_spec, make_case
from nodekit import msgs, pump, replies
from xronos.node.agent.config import NodeConfig
from xronos.node.agent.service import NodeService
from xronos.node.rank.local import free_port
from xronos.protocol import messages as m
from xronos.protocol.codec import decode, encode
from xronos.protocol.layout import Layout
from fakebus import FakeBroker
from xronos.protocol.topics import TopicTable

T = TopicTable()


@pytest.fixture
def node(tmp_path):
    broker = FakeBroker()
    cfg = NodeConfig(node_id="n0", state_dir=tmp_path / "state", allowed_dirs=[tmp_path / "allowed"],
                     data_host="127.0.0.1", threads=1)
    (tmp_path / "allowed").mkdir()
    will = (T.build("node.availability", node_id="n0"), "offline", True)
    svc = NodeService(cfg, broker.bus("n0", will=will))
    client = broker.bus("gw")
    client.subscribe("#")
    client.start()
    svc.start()
    # Its own `online` and capabilities come back to it first: then it hears only what a test sends.
    pump(svc, until=lambda: svc.availability.confirmed and svc.owncaps.confirmed)
    yield svc, client, broker, tmp_path
    svc.work.shutdown(wait=True)


def test_announces_and_last_will(node):
    svc, client, broker, _ = node
    svc.step(0)
    assert broker.retained["xronos/node/n0/availability"] == b"online"
    caps = decode("xronos/node/n0/capabilities", broker.retained["xronos/node/n0/capabilities"])
    assert caps.node_id == "n0" and caps.data_host == "127.0.0.1" and caps.participate
    ha = json.loads(broker.retained["xronos/node/n0/state"])
    assert ha["participate"] is True and ha["job_id"] is None
    svc.bus.reconnect()  # announced again after every reconnect
    assert msgs(client, "node.capabilities")
    svc.bus.kill()
    assert broker.retained["xronos/node/n0/availability"] == b"offline"


def test_participate_switch_from_home_assistant(node):
    svc, client, broker, _ = node
    client.publish("xronos/node/n0/set", b'{"participate": false}')
    pump(svc, until=lambda: not svc.participate)
    caps = decode("xronos/node/n0/capabilities", broker.retained["xronos/node/n0/capabilities"])
    assert caps.participate is False
    client.publish("xronos/node/n0/set", b'{"participate": "nope"}')
    (err,) = replies(svc, client, "node.error")
    assert err.code == "invalid" and "participate" in err.message


def test_inspection_refuses_paths_outside_allowed_dirs_and_accepts_a_good_job(node):
    svc, client, broker, tmp = node
    model, data = make_case(tmp / "allowed", rows=40)
    outside = m.JobSpec(**{**job_spec(model, "/etc/passwd", tmp / "allowed" / "out", owner="n0")})
    good = m.JobSpec(**job_spec(model, data, tmp / "allowed" / "out", owner="n0", max_steps=None, epochs=2))
    missing = m.JobSpec(**job_spec(tmp / "allowed" / "nope", data, tmp / "allowed" / "out", owner="n0"))
    for rid, spec in (("r1", outside), ("r2", good), ("r3", missing)):
        svc.bus.publish(T.build("node.inspect_request", node_id="n0"),
                        encode(m.InspectRequest(request_id=rid, job_id="j", spec=spec)))
    got: list[m.InspectReport] = []
    pump(svc, until=lambda: _collect(got, client) >= 3, timeout=120)
    by = {r.request_id: r for r in got}
    assert not by["r1"].ok and "outside the allowed directories" in by["r1"].error
    assert by["r2"].ok and by["r2"].arch.family == "gpt2" and by["r2"].arch.sizes().attn == 12
    assert by["r2"].train_rows == 32 and by["r2"].eval_rows == 8 and by["r2"].total_steps == 16
    assert not by["r3"].ok and "does not exist" in by["r3"].error


def _collect(got, client):
    got += msgs(client, "node.inspect_report")
    return len(got)


def test_assignments_checked(node):
    svc, client, broker, tmp = node
    spec = m.JobSpec(**job_spec(tmp / "allowed" / "m", tmp / "allowed" / "d.csv", tmp / "allowed" / "o", owner="n0"))
    base = dict(job_id="j", plan_version=1, rank=0, world_size=2, rendezvous_host="127.0.0.1",
                rendezvous_port=free_port(),  # a fixed port inside the ephemeral range collided once in CI
                group_key="ab" * 32,
                layout=Layout(attn=(6, 6), mlp=(64, 36), vocab=(32, 5)), spec=spec)
    client.drain()
    # A payload naming another node on n0's topic: ignored, logged, answered on n0's error topic.
    svc.bus.publish(T.build("node.assignment", node_id="n0"), encode(m.Assignment(node_id="n1", **base)))
    (err,) = replies(svc, client, "node.error")
    assert err.code == "rejected" and "names node 'n1'" in err.message and svc.assignment is None
    # Rank 1 for the owner is refused with a reason in the ack.
    svc.bus.publish(T.build("node.assignment", node_id="n0"),
                    encode(m.Assignment(node_id="n0", **{**base, "rank": 1})))
    (ack,) = replies(svc, client, "node.ack")
    assert not ack.accepted and "owner must be rank 0" in ack.reason
    svc.bus.publish(T.build("node.assignment", node_id="n0"), encode(m.Assignment(node_id="n0", **base)))
    (ack,) = replies(svc, client, "node.ack")
    assert ack.accepted and svc.assignment.plan_version == 1
    # The same plan again (a gateway restarted while waiting for acks), with the key it drew anew:
    # acked again, and the key of the repeat is the one the rank will prove.
    svc.bus.publish(T.build("node.assignment", node_id="n0"),
                    encode(m.Assignment(node_id="n0", **{**base, "group_key": "cd" * 32})))
    (ack,) = replies(svc, client, "node.ack")
    assert ack.accepted and svc.assignment.group_key == "cd" * 32
    status = decode("xronos/node/n0/job", broker.retained["xronos/node/n0/job"])
    assert status.status == "accepted" and status.rank == 0
    # A re-shard order for another world size is refused before it reaches the rank process.
    svc.bus.publish(T.build("node.control", node_id="n0"), encode(m.JobReshard(
        job_id="j", plan_version=1, at_step=4, reason="test",
        layout=Layout(attn=(4, 4, 4), mlp=(40, 30, 30), vocab=(20, 10, 7)))))
    (err,) = replies(svc, client, "node.error")
    assert "layout has 3 ranks, the job 2" in err.message
    # Controls for a plan this node does not hold are errors; a stale cancel is fine. The real cancel
    # comes last: once it is done, so are the two before it (one loop, in order).
    for control in (m.JobPause(job_id="j", plan_version=7), m.JobCancel(job_id="j", plan_version=7),
                    m.JobCancel(job_id="j", plan_version=1)):
        svc.bus.publish(T.build("node.control", node_id="n0"), encode(control))
    errors: list[m.ErrorResponse] = []
    pump(svc, until=lambda: bool(errors.extend(msgs(client, "node.error"))) or svc.assignment is None)
    (err,) = errors + msgs(client, "node.error")
    assert "no such assignment" in err.message
    assert svc.assignment is None
    assert decode("xronos/node/n0/job", broker.retained["xronos/node/n0/job"]).status == "cancelled"
