import pytest

from protocol_samples import SAMPLES
from xronos.protocol import messages as m
from xronos.protocol.codec import decode
from fakebus import FakeBroker
from xronos.protocol.transport import BrokerSettings, OutgoingQueue


def test_wildcards_retained_and_self_delivery():
    broker = FakeBroker()
    a, b = broker.bus("a"), broker.bus("b")
    a.start()
    b.start()
    a.publish("xronos/node/n1/capabilities", b"caps", retain=True)
    b.subscribe("xronos/node/+/capabilities")
    assert b.drain() == [("xronos/node/n1/capabilities", b"caps")]  # retained on subscribe
    b.subscribe("xronos/#")
    b.drain()
    a.subscribe("xronos/job/+/state")
    a.publish("xronos/job/j1/state", b"s")
    assert a.drain() == [("xronos/job/j1/state", b"s")]
    assert b.drain() == [("xronos/job/j1/state", b"s")]  # '#' matches, and only once per bus
    a.publish("xronos/node/n1/capabilities", b"", retain=True)  # empty retained payload clears
    assert "xronos/node/n1/capabilities" not in broker.retained
    with pytest.raises(ValueError, match="wildcards"):
        a.publish("xronos/+/x", b"")


def test_last_will_on_kill_not_on_stop():
    broker = FakeBroker()
    watcher = broker.bus("w")
    watcher.start()
    watcher.subscribe("xronos/node/+/availability")
    node = broker.bus("n", will=("xronos/node/n/availability", "offline", True))
    node.start()
    node.publish_message(m.Availability.ONLINE, node_id="n")
    assert decode(*watcher.drain()[0]) is m.Availability.ONLINE
    node.stop()
    assert watcher.drain() == []
    node.reconnect()
    node.kill()
    assert watcher.drain() == [("xronos/node/n/availability", b"offline")]
    assert broker.retained["xronos/node/n/availability"] == b"offline"


def test_disconnected_publishes_wait_and_subscriptions_and_hooks_return():
    broker = FakeBroker()
    bus = broker.bus("g", max_outgoing=2)
    bus.subscribe("xronos/job/+/state")
    republished = []
    bus.on_connect(lambda: republished.append(bus.publish_message(m.Availability.ONLINE)))
    bus.publish("xronos/a", b"1")
    bus.publish("xronos/b", b"2")
    bus.publish("xronos/c", b"3")  # over the bound: oldest non-retained dropped
    assert bus.dropped_outgoing == 1 and broker.log == []
    bus.start()
    assert [t for t, _, _ in broker.log] == ["xronos/b", "xronos/c", "xronos/gateway/availability"]
    assert republished == ["xronos/gateway/availability"]
    other = broker.bus("o")
    other.start()
    other.publish_message(SAMPLES["job.state"], job_id="j1")
    assert bus.drain()[0][0] == "xronos/job/j1/state"


def test_outgoing_queue_keeps_retained_and_latest_state():
    q = OutgoingQueue(2)
    q.put("s", b"old", 1, True)
    q.put("x", b"1", 1, False)
    q.put("s", b"new", 1, True)  # replaces the waiting retained on the same topic
    q.put("y", b"2", 1, False)  # bound 2: "x" (oldest non-retained) goes, the retained stays
    assert q.drain() == [("s", b"new", 1, True), ("y", b"2", 1, False)]
    assert q.dropped == 1 and len(q) == 0


def test_password_file_read_on_demand_and_never_in_repr(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    s = BrokerSettings(username="u", password_file=pw)
    assert s.read_password() == "s3cret" and "s3cret" not in repr(s)
    with pytest.raises(ValueError, match="password_file"):
        BrokerSettings(username="u", password_file=tmp_path / "missing").read_password()
    with pytest.raises(ValueError, match="port"):
        BrokerSettings(port=0)
    with pytest.raises(ValueError, match="tls_key"):
        BrokerSettings(tls_key=tmp_path / "k.pem")


def test_a_world_readable_password_file_is_named_in_a_warning_without_the_secret(tmp_path):
    from structlog.testing import capture_logs

    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    for mode, warned in ((0o644, True), (0o600, False), (0o640, False)):
        pw.chmod(mode)
        with capture_logs() as logs:
            assert BrokerSettings(username="u", password_file=pw).read_password() == "s3cret"
        hits = [e for e in logs if e["event"] == "broker.password_file_world_readable"]
        assert bool(hits) == warned, (oct(mode), logs)
        assert "s3cret" not in repr(logs)
        assert all(e["mode"] == "0o644" and e["fix"] == f"chmod 600 {pw}" for e in hits)
