import json

import msgpack
import pytest

from protocol_samples import SAMPLES
from xronos.protocol import messages as m
from xronos.protocol.codec import decode, encode
from xronos.protocol.dispatch import Dispatcher, RequestError
from fakebus import FakeBroker


@pytest.fixture
def wired():
    broker = FakeBroker()
    service, client = broker.bus("gateway"), broker.bus("client")
    service.start()
    client.start()
    client.subscribe("xronos/gateway/response/#")
    client.subscribe("xronos/node/+/error")
    return service, client, Dispatcher(service)


def _responses(client):
    return [(t, decode(t, p)) for t, p in client.drain()]


def test_request_answered_with_data_and_transaction(wired):
    service, client, disp = wired
    disp.on("gateway.request.job/pause", lambda req, params: {"job_id": req.job_id, "paused": True})
    client.publish("xronos/gateway/request/job/pause", json.dumps({"transaction": "t7", "job_id": "j1"}))
    assert disp.run_once(0)
    [(topic, resp)] = _responses(client)
    assert topic == "xronos/gateway/response/job/pause"
    assert resp == m.GatewayResponse(status="ok", data={"job_id": "j1", "paused": True}, transaction="t7")
    assert not disp.run_once(0)


@pytest.mark.parametrize("payload,reason,text", [
    (b"not json", "bad_encoding", "not json"),
    (b'{"transaction": "t1", "job_id": "j", "schema_version": 9}', "schema_version", "saw schema_version 9"),
    (b'{"transaction": "t1", "job_id": "j", "colour": "red"}', "unknown_field", "colour"),
    (b'{"transaction": "t1"}', "missing_field", "job_id"),
    (b'{"transaction": "t1", "job_id": 3}', "invalid", "job_id"),
    (b'{"transaction": "t1", "job_id": "' + b"x" * 300_000 + b'"}', "too_large", "exceeds cap"),
])
def test_bad_request_is_counted_and_answered_never_fatal(wired, payload, reason, text):
    service, client, disp = wired
    calls = []
    disp.on("gateway.request.job/cancel", lambda req, params: calls.append(req))
    client.publish("xronos/gateway/request/job/cancel", payload)
    disp.run_once(0)
    [(topic, resp)] = _responses(client)
    assert topic == "xronos/gateway/response/job/cancel"
    assert resp.status == "error" and text in resp.error
    assert resp.transaction == ("t1" if reason not in ("bad_encoding", "too_large") else None)
    assert disp.errors[reason] == 1 and calls == []


def test_handler_exceptions_are_answered(wired):
    service, client, disp = wired

    def boom(req, params):
        raise RuntimeError("disk on fire")

    disp.on("gateway.request.nodes/list", boom)
    disp.on("gateway.request.job/status", lambda req, params: (_ for _ in ()).throw(RequestError("no job x")))
    disp.on("gateway.request.job/resume", lambda req, params: 42)  # not a dict/list: cannot be data
    client.publish_message(m.NodesListRequest(transaction="a"))
    client.publish_message(m.JobStatusRequest(transaction="b", job_id="x"))
    client.publish_message(m.JobResumeRequest(transaction="c", job_id="x"))
    while disp.run_once(0):
        pass
    by_txn = {r.transaction: r for _, r in _responses(client)}
    assert "internal error: RuntimeError: disk on fire" in by_txn["a"].error
    assert by_txn["b"].error == "no job x"
    assert by_txn["c"].status == "error" and "cannot send response" in by_txn["c"].error
    assert disp.errors == {"handler_error": 1, "rejected": 1, "response_error": 1}


def test_node_topics_bad_input_reported_on_own_error_topic(wired):
    broker_bus, client, _ = wired
    node = broker_bus.broker.bus("node-n1")
    node.start()
    disp = Dispatcher(node, node_id="n1")
    got = []
    disp.on("node.assignment", lambda a, params: got.append(a), node_id="n1")
    disp.on("node.control", lambda c, params: got.append(c), node_id="n1")
    client.publish("xronos/node/n1/assignment", msgpack.packb({"job_id": "j"}))
    client.publish_message(m.JobCancel(job_id="j", plan_version=1), node_id="n1")
    client.publish("xronos/node/n1/control", encode(SAMPLES["node.control"]))
    while disp.run_once(0):
        pass
    assert [type(x) for x in got] == [m.JobCancel, m.JobPause]
    [(topic, err)] = _responses(client)
    assert topic == "xronos/node/n1/error" and err.code == "missing_field"
    assert err.topic == "xronos/node/n1/assignment"


def test_unknown_topic_counted_not_answered(wired):
    service, client, disp = wired
    service.subscribe("xronos/#")
    client.publish("xronos/whatever", b"{}")
    disp.run_once(0)
    assert disp.errors["unknown_topic"] == 1
    assert _responses(client) == []
