"""An in-memory broker and bus with MqttBus's interface, for unit tests of gateway and node logic.

MQTT semantics kept: retained messages (an empty retained payload clears; delivered with
`retain=True` on subscribing, live publishes with `retain=False`), wildcards + and #,
delivery to the publisher when it is subscribed, last-will on `kill()` (not on `stop()`),
publishes while disconnected held in the same bounded outgoing queue, subscriptions restored and
on-connect hooks run on reconnect.
"""

from __future__ import annotations

import threading

from paho.mqtt.client import topic_matches_sub

from xronos.protocol.codec import MAX_PAYLOAD
from xronos.protocol.topics import TopicTable
from xronos.protocol.transport import BusBase, OutgoingQueue, Will


class FakeBroker:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.retained: dict[str, bytes] = {}
        self.buses: list[FakeBus] = []
        self.log: list[tuple[str, bytes, bool]] = []  # every publish the broker accepted

    def bus(self, client_id: str, will: Will | None = None, table: TopicTable | None = None,
            max_outgoing: int = 1000) -> FakeBus:
        return FakeBus(self, client_id, will, table, max_outgoing)

    def _route(self, topic: str, payload: bytes, retain: bool) -> None:
        with self._lock:
            self.log.append((topic, payload, retain))
            if retain:
                if payload:
                    self.retained[topic] = payload
                else:
                    self.retained.pop(topic, None)
            for bus in self.buses:
                if bus.connected and any(topic_matches_sub(p, topic) for p in bus.subscriptions):
                    bus._enqueue(topic, payload)

    def _attach(self, bus: FakeBus) -> None:
        with self._lock:
            if bus not in self.buses:
                self.buses.append(bus)

    def _detach(self, bus: FakeBus, send_will: bool) -> None:
        with self._lock:
            if bus in self.buses:
                self.buses.remove(bus)
            if send_will and bus.will is not None:
                topic, payload, retain = bus.will
                self._route(topic, payload.encode() if isinstance(payload, str) else payload, retain)


class FakeBus(BusBase):
    def __init__(self, broker: FakeBroker, client_id: str, will: Will | None = None,
                 table: TopicTable | None = None, max_outgoing: int = 1000) -> None:
        self._init_common(client_id, table, 10000)
        self.broker, self.will, self.max_payload = broker, will, MAX_PAYLOAD
        self.subscriptions: list[str] = []
        self.connected = False
        self._out = OutgoingQueue(max_outgoing)

    @property
    def dropped_outgoing(self) -> int:
        return self._out.dropped

    def start(self) -> None:
        self.reconnect()

    def stop(self) -> None:
        """Clean disconnect: no last-will."""
        self.connected = False
        self.broker._detach(self, send_will=False)

    def kill(self) -> None:
        """Connection lost without DISCONNECT: the broker publishes the last-will."""
        self.connected = False
        self.broker._detach(self, send_will=True)

    def reconnect(self) -> None:
        with self.broker._lock:
            self.broker._attach(self)
            self.connected = True
            for pattern in self.subscriptions:
                self._deliver_retained(pattern)
            for topic, payload, _qos, retain in self._out.drain():
                self.broker._route(topic, payload, retain)
        self._run_hooks()

    def wait_connected(self, timeout: float | None = None) -> bool:
        return self.connected

    def subscribe(self, pattern: str, qos: int = 1) -> None:
        with self.broker._lock:
            if pattern not in self.subscriptions:
                self.subscriptions.append(pattern)
            if self.connected:
                self._deliver_retained(pattern)

    def _deliver_retained(self, pattern: str) -> None:
        for topic, payload in list(self.broker.retained.items()):
            if topic_matches_sub(pattern, topic):
                self._enqueue(topic, payload, retain=True)

    def publish(self, topic: str, payload: bytes | str, retain: bool = False, qos: int = 1) -> None:
        if "+" in topic or "#" in topic or not topic:
            raise ValueError(f"publish topic {topic!r}: must be non-empty and without wildcards")
        data = payload.encode() if isinstance(payload, str) else bytes(payload)
        with self.broker._lock:
            if self.connected:
                self.broker._route(topic, data, retain)
            else:
                self._out.put(topic, data, qos, retain)

    def drain(self) -> list[tuple[str, bytes]]:
        """Everything queued right now (test convenience)."""
        items = []
        while (item := self.get(timeout=0)) is not None:
            items.append(item)
        return items
