"""A running service keeps its own retained availability `online` on a real broker: a second
process's last will under the same node id (or the gateway's topic), or an `offline` published by
hand, is answered with `online` again and an error naming the likely cause; the stale `offline`
the broker hands over at start (a previous run's last will) is no false alarm."""

from __future__ import annotations

import queue
import time
from typing import Any, Callable

import paho.mqtt.client as paho
import pytest
from structlog.testing import capture_logs

from xronos.gateway.config import GatewayConfig
from xronos.gateway.service import GatewayService
from xronos.node.agent.config import NodeConfig
from xronos.node.agent.service import NodeService
from xronos.protocol.topics import TopicTable
from xronos.protocol.transport import BrokerSettings


class Watcher:
    """A plain MQTT client on one topic, as the gateway or Home Assistant sees it."""

    def __init__(self, broker: Any, topic: str, name: str) -> None:
        self.inbox: queue.Queue[tuple[bytes, bool]] = queue.Queue()
        subscribed: queue.Queue[int] = queue.Queue()
        self.c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"{name}-{time.monotonic_ns()}")
        self.c.on_message = lambda c, u, msg: self.inbox.put((bytes(msg.payload), bool(msg.retain)))
        self.c.on_subscribe = lambda c, u, mid, rcs, p: subscribed.put(mid)
        self.c.connect(broker.host, broker.port)
        self.c.loop_start()
        self.c.subscribe(topic, qos=1)
        subscribed.get(timeout=10)
        self.topic = topic

    def publish_retained(self, payload: bytes) -> None:
        self.c.publish(self.topic, payload, qos=1, retain=True).wait_for_publish(timeout=10)

    def payloads(self) -> list[bytes]:
        out = []
        while True:
            try:
                out.append(self.inbox.get_nowait()[0])
            except queue.Empty:
                return out

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def retained(broker: Any, topic: str) -> bytes:
    """What a client subscribing now is told (the broker's retained value)."""
    w = Watcher(broker, topic, "late")
    try:
        payload, was_retained = w.inbox.get(timeout=10)
        assert was_retained, payload
        return payload
    finally:
        w.close()


def drive(svc: Any, until: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        svc.step(0.05)
        if until():
            return
    raise AssertionError(f"not within {timeout} s: {what}")


def errors(logs: list[dict], event: str) -> list[dict]:
    return [e for e in logs if e["event"] == event and e["log_level"] == "error"]


def check_reasserted(broker: Any, svc: Any, topic: str, event: str) -> list[dict]:
    """A stale `offline` before the start is no alarm; an `offline` while it runs is answered."""
    stale = Watcher(broker, topic, "stale")
    stale.publish_retained(b"offline")  # the last will of a run before this one
    stale.close()
    watcher = Watcher(broker, topic, "watcher")
    try:
        with capture_logs() as logs:
            svc.start()
            drive(svc, lambda: svc.availability.confirmed, "the service hears its own online")
            for _ in range(10):  # anything that would follow the stale value has had time to arrive
                svc.step(0.05)
            assert errors(logs, event) == [] and svc.availability.reasserted == 0
            assert retained(broker, topic) == b"online"

            watcher.payloads()
            duplicate = Watcher(broker, topic, "duplicate")  # another process with the same id stops
            duplicate.publish_retained(b"offline")
            duplicate.close()
            seen: list[bytes] = []
            drive(svc, lambda: seen.extend(watcher.payloads()) or seen[-2:] == [b"offline", b"online"],
                  "online published again after the other process's offline")
        assert retained(broker, topic) == b"online"
        assert svc.availability.reasserted == 1
        (err,) = errors(logs, event)
        return [err]
    finally:
        watcher.close()


@pytest.fixture
def base(tmp_path):
    return f"xa{tmp_path.name[-6:].replace('-', '')}"


def test_a_node_answers_an_offline_left_under_its_id(tmp_path, mqtt_broker, base):
    cfg = NodeConfig(node_id="n0", broker=BrokerSettings(host=mqtt_broker.host, port=mqtt_broker.port),
                     base_topic=base, state_dir=tmp_path / "state", allowed_dirs=[tmp_path],
                     data_host="127.0.0.1", threads=1)
    svc = NodeService(cfg)
    topic = TopicTable(base).build("node.availability", node_id="n0")
    try:
        (err,) = check_reasserted(mqtt_broker, svc, topic, "node.availability_offline_while_running")
        assert "node_id" in err["hint"] and err["topic"] == topic
    finally:
        svc.shutdown()
    assert retained(mqtt_broker, topic) == b"offline"  # its own clean stop is not answered


def test_the_gateway_answers_an_offline_left_on_its_availability(tmp_path, mqtt_broker, base):
    cfg = GatewayConfig(broker=BrokerSettings(host=mqtt_broker.host, port=mqtt_broker.port), base_topic=base,
                        state_dir=tmp_path / "gw")
    svc = GatewayService(cfg)
    topic = TopicTable(base).build("gateway.availability")
    try:
        (err,) = check_reasserted(mqtt_broker, svc, topic, "gateway.availability_offline_while_running")
        assert "one gateway per base topic" in err["hint"]
    finally:
        svc.shutdown()
    assert retained(mqtt_broker, topic) == b"offline"


@pytest.mark.parametrize("host, data_host", [
    ("other-box", "192.0.2.7"),
    # The longest names the schema admits, each character escaped in print: the report was refused
    # (its message over 4096 characters) in place of being sent (found by the fuzzer).
    ("\U000e0001" * 255, "\U000e0002" * 255),
])
def test_a_node_reports_another_process_announcing_under_its_id(tmp_path, mqtt_broker, base, host, data_host):
    """Two boxes from one node.toml: each hears the other's capabilities on its own topic. Its own
    (the echo, and a previous run's retained one at start) are no alarm."""
    from xronos.protocol import messages as m

    table = TopicTable(base)
    topic = table.build("node.capabilities", node_id="n0")
    cfg = NodeConfig(node_id="n0", broker=BrokerSettings(host=mqtt_broker.host, port=mqtt_broker.port),
                     base_topic=base, state_dir=tmp_path / "state", allowed_dirs=[tmp_path],
                     data_host="127.0.0.1", threads=1)
    svc = NodeService(cfg)
    stale = Watcher(mqtt_broker, topic, "stale")  # a previous run's retained announcement
    other = m.Capabilities(node_id="n0", hostname=host, arch="aarch64", cpu_model="cpu", cores=4,
                           memory_total=8 << 30, memory_available=6 << 30, torch_version="2.13.0",
                           data_host=data_host, participate=True, cpu_temp_c=None, sent_at=1.0)
    stale.publish_retained(other.model_dump_json().encode())
    stale.close()
    errs = Watcher(mqtt_broker, table.build("node.error", node_id="n0"), "errors")
    try:
        with capture_logs() as logs:
            svc.start()
            drive(svc, lambda: svc.owncaps.confirmed, "the node hears its own capabilities")
            for _ in range(10):
                svc.step(0.05)
            assert errors(logs, "node.duplicate_node_id") == [] and svc.owncaps.seen == 0
            twin = Watcher(mqtt_broker, topic, "twin")  # the second box announces itself
            twin.publish_retained(other.model_copy(update={"sent_at": 2.0}).model_dump_json().encode())
            twin.publish_retained(other.model_copy(update={"sent_at": 3.0}).model_dump_json().encode())
            twin.close()
            drive(svc, lambda: svc.owncaps.seen == 2, "both announcements of the other box heard")
        (err,) = errors(logs, "node.duplicate_node_id")  # once per 10 minutes
        assert err["other_host"] == host and err["other_data_host"] == data_host
        deadline = time.monotonic() + 10
        reports = []
        while not reports and time.monotonic() < deadline:
            svc.step(0.05)
            reports = [m.ErrorResponse.model_validate_json(p) for p in errs.payloads()]
        (report,) = [r for r in reports if r.code == "duplicate_node_id"]
        assert repr(host[:64]) in report.message and "own node_id" in report.message and report.topic == topic
    finally:
        errs.close()
        svc.shutdown()


@pytest.mark.parametrize("who", ["node", "gateway"])
def test_junk_or_an_emptied_availability_is_answered_too(tmp_path, mqtt_broker, base, who):
    """Anything that replaces the running service's `online` — a payload that is neither value (Home
    Assistant reads it as unavailable too) or an empty retained one (the state removed) — gets
    `online` back; it used to be refused as bad input and left standing."""
    settings = BrokerSettings(host=mqtt_broker.host, port=mqtt_broker.port)
    if who == "node":
        svc: Any = NodeService(NodeConfig(node_id="n0", broker=settings, base_topic=base, state_dir=tmp_path / "state",
                                          allowed_dirs=[tmp_path], data_host="127.0.0.1", threads=1))
        topic, event = TopicTable(base).build("node.availability", node_id="n0"), "node.availability_offline_while_running"
    else:
        svc = GatewayService(GatewayConfig(broker=settings, base_topic=base, state_dir=tmp_path / "gw"))
        topic, event = TopicTable(base).build("gateway.availability"), "gateway.availability_offline_while_running"
    watcher = Watcher(mqtt_broker, topic, "watcher")
    try:
        with capture_logs() as logs:
            svc.start()
            drive(svc, lambda: svc.availability.confirmed, "the service hears its own online")
            for n, payload in enumerate((b"\xff\x00 not a state", b""), start=1):
                watcher.payloads()
                other = Watcher(mqtt_broker, topic, "other")
                other.publish_retained(payload)
                other.close()
                seen: list[bytes] = []
                drive(svc, lambda: seen.extend(watcher.payloads()) or seen[-2:] == [payload, b"online"],
                      f"online published again after {payload!r}")
                assert retained(mqtt_broker, topic) == b"online" and svc.availability.reasserted == n
        assert [e["found"] for e in errors(logs, event)] == ["unreadable", "cleared"]
    finally:
        watcher.close()
        svc.shutdown()
