"""The MQTT bus every Xronos service talks through (paho-mqtt 2.x, callback API v2).

Shape of a service: `bus.start()`, then a control loop that reads `bus.get(timeout)` and publishes.
paho's network thread only enqueues: incoming messages go to a thread-safe queue; nothing of the
service runs there except the on-connect hooks, which must only publish (e.g. retained state).
A broker that is down at boot or goes away later is retried with back-off; subscriptions are
(re)made on every connect; publishes made while disconnected wait in a bounded queue.
"""

from __future__ import annotations

import collections
import queue
import threading
from pathlib import Path
from typing import Any, Callable

import paho.mqtt.client as paho
import structlog
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .codec import MAX_PAYLOAD, encode
from .topics import TopicTable

log = structlog.get_logger(__name__)

Will = tuple[str, bytes | str, bool]  # (topic, payload, retain)
Hook = Callable[[], None]


class BrokerSettings(BaseModel):
    """Where and how to reach the broker. The password lives in a file, read at connect time."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    host: str = "127.0.0.1"
    port: int = Field(1883, gt=0, lt=65536)
    username: str | None = None
    password_file: Path | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_insecure: bool = False  # skip hostname verification (self-signed lab setups only)
    keepalive: int = Field(30, ge=1)
    client_id_prefix: str = "xronos"
    reconnect_min_s: int = Field(1, ge=1)
    reconnect_max_s: int = Field(30, ge=1)
    max_outgoing: int = Field(1000, ge=1)  # publishes kept while disconnected
    max_incoming: int = Field(10000, ge=1)
    max_payload: int = Field(MAX_PAYLOAD, ge=1)

    @model_validator(mode="after")
    def _tls_consistent(self) -> BrokerSettings:
        if self.tls_key is not None and self.tls_cert is None:
            raise ValueError("tls_key: set only together with tls_cert")
        if self.tls_insecure and self.tls_ca is None and self.tls_cert is None:
            raise ValueError("tls_insecure: only meaningful with TLS (tls_ca or tls_cert)")
        if self.reconnect_max_s < self.reconnect_min_s:
            raise ValueError("reconnect_max_s: must be >= reconnect_min_s")
        return self

    def read_password(self) -> str | None:
        if self.password_file is None:
            return None
        try:
            mode = self.password_file.stat().st_mode
            if mode & 0o004:  # a secret every local user can read; the service still connects (the broker decides)
                log.warning("broker.password_file_world_readable", path=str(self.password_file),
                            mode=oct(mode & 0o777), fix=f"chmod 600 {self.password_file}")
            return self.password_file.read_text(encoding="utf-8").rstrip("\r\n")
        except OSError as exc:
            raise ValueError(f"password_file {str(self.password_file)!r}: cannot read: {exc.strerror}") from None


class OutgoingQueue:
    """Publishes waiting for a connection. A retained publish replaces a waiting one on the same
    topic (only the latest state matters); past the bound the oldest non-retained goes first."""

    def __init__(self, bound: int) -> None:
        self.bound, self.dropped = bound, 0
        self._items: collections.deque[tuple[str, bytes, int, bool]] = collections.deque()

    def put(self, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        if retain:
            self._items = collections.deque(i for i in self._items if not (i[3] and i[0] == topic))
        self._items.append((topic, payload, qos, retain))
        while len(self._items) > self.bound:
            victim = next((i for i in self._items if not i[3]), self._items[0])
            self._items.remove(victim)
            self.dropped += 1
            log.warning("mqtt.outgoing_dropped", topic=victim[0], dropped_total=self.dropped)

    def drain(self) -> list[tuple[str, bytes, int, bool]]:
        items, self._items = list(self._items), collections.deque()
        return items

    def __len__(self) -> int:
        return len(self._items)


class Incoming(tuple):
    """One delivered message: unpacks as `(topic, payload)` like a plain pair, and carries
    `.retain`, whether the broker delivered it as a retained message (state from before this
    client subscribed) rather than as a live publish. A retained message is state, never a
    command: the dispatcher ignores (and clears) retained messages on topics not retained by design."""

    retain: bool

    def __new__(cls, topic: str, payload: bytes, retain: bool = False) -> Incoming:
        self = super().__new__(cls, (topic, payload))
        self.retain = bool(retain)
        return self

    @property
    def topic(self) -> str:
        return self[0]

    @property
    def payload(self) -> bytes:
        return self[1]


class BusBase:
    """What MqttBus and FakeBus share: the incoming queue and the typed publish helper."""

    client_id: str
    table: TopicTable
    max_payload: int

    def _init_common(self, client_id: str, table: TopicTable | None, max_incoming: int) -> None:
        self.client_id = client_id
        self.table = table or TopicTable()
        self.incoming: queue.Queue[Incoming] = queue.Queue(max_incoming)
        self.dropped_incoming = 0
        self.connect_hooks: list[Hook] = []

    def _enqueue(self, topic: str, payload: bytes, retain: bool = False) -> None:
        try:
            self.incoming.put_nowait(Incoming(topic, payload, retain))
        except queue.Full:
            self.dropped_incoming += 1
            log.warning("mqtt.incoming_dropped", topic=topic, client=self.client_id,
                        dropped_total=self.dropped_incoming)

    def _run_hooks(self) -> None:
        for hook in list(self.connect_hooks):
            try:
                hook()
            except Exception:
                log.exception("mqtt.connect_hook_failed", client=self.client_id)

    def get(self, timeout: float | None = None) -> Incoming | None:
        """Next incoming (topic, payload) pair (an `Incoming`, with `.retain`), or None after
        `timeout` seconds."""
        try:
            return self.incoming.get(timeout=timeout)
        except queue.Empty:
            return None

    def on_connect(self, hook: Hook) -> None:
        """Run `hook` after every (re)connect, e.g. to republish retained state. Publish only."""
        self.connect_hooks.append(hook)

    def publish(self, topic: str, payload: bytes | str, retain: bool = False, qos: int = 1) -> None:
        raise NotImplementedError

    def publish_message(self, message: Any, *, qos: int = 1, **topic_params: str) -> str:
        """Encode `message` and publish it on its table topic (retained as the table says)."""
        topic, entry = self.table.topic_for(message, **topic_params)
        self.publish(topic, encode(message, max_bytes=self.max_payload), retain=entry.retained, qos=qos)
        return topic


class MqttBus(BusBase):
    def __init__(self, settings: BrokerSettings, client_id: str, will: Will | None = None,
                 table: TopicTable | None = None) -> None:
        full_id = f"{settings.client_id_prefix}-{client_id}" if settings.client_id_prefix else client_id
        self._init_common(full_id, table, settings.max_incoming)
        self.settings, self.will, self.max_payload = settings, will, settings.max_payload
        self._lock = threading.RLock()
        self._subs: list[tuple[str, int]] = []
        self._connected = threading.Event()
        self._out = OutgoingQueue(settings.max_outgoing)
        self._last_info: paho.MQTTMessageInfo | None = None
        self.client = self._make_client()

    def _make_client(self) -> paho.Client:
        s = self.settings
        c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=self.client_id,
                        protocol=paho.MQTTv311, clean_session=True)
        c.on_connect, c.on_disconnect, c.on_message = self._cb_connect, self._cb_disconnect, self._cb_message
        c.reconnect_delay_set(s.reconnect_min_s, s.reconnect_max_s)
        c.max_queued_messages_set(s.max_outgoing)
        if self.will is not None:
            topic, payload, retain = self.will
            c.will_set(topic, payload, qos=1, retain=retain)
        if s.tls_ca or s.tls_cert:
            c.tls_set(ca_certs=_opt(s.tls_ca), certfile=_opt(s.tls_cert), keyfile=_opt(s.tls_key))
            c.tls_insecure_set(s.tls_insecure)
        return c

    # --- paho callbacks (network thread): enqueue and bookkeeping only -------------------------
    def _cb_connect(self, client: paho.Client, _ud: Any, _flags: Any, reason: Any, _props: Any) -> None:
        if reason.is_failure:
            log.warning("mqtt.connect_refused", client=self.client_id, reason=str(reason))
            return
        with self._lock:
            for pattern, qos in self._subs:
                client.subscribe(pattern, qos)
            pending = self._out.drain()
            for topic, payload, qos, retain in pending:  # under the lock: nothing overtakes them
                self._send(topic, payload, qos, retain)
            self._connected.set()
        log.info("mqtt.connected", client=self.client_id, host=self.settings.host, port=self.settings.port,
                 subscriptions=len(self._subs), flushed=len(pending))
        self._run_hooks()

    def _cb_disconnect(self, _c: Any, _ud: Any, _flags: Any, reason: Any, _props: Any) -> None:
        self._connected.clear()
        log.info("mqtt.disconnected", client=self.client_id, reason=str(reason))

    def _cb_message(self, _c: Any, _ud: Any, msg: paho.MQTTMessage) -> None:
        # The network thread must never raise (paho would end its loop): a topic that is not
        # UTF-8 (Mosquitto refuses those, others may not) is dropped here.
        try:
            topic = msg.topic
        except UnicodeDecodeError:
            log.warning("mqtt.bad_topic", client=self.client_id)
            return
        self._enqueue(topic, bytes(msg.payload), bool(msg.retain))

    # --- public ------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def dropped_outgoing(self) -> int:
        return self._out.dropped

    def wait_connected(self, timeout: float | None = None) -> bool:
        return self._connected.wait(timeout)

    def start(self) -> None:
        """Begin connecting in the background; returns at once even if the broker is down."""
        if self.settings.username is not None:
            self.client.username_pw_set(self.settings.username, self.settings.read_password())
        self.client.connect_async(self.settings.host, self.settings.port, self.settings.keepalive)
        self.client.loop_start()

    def stop(self, flush_timeout: float = 2.0) -> None:
        """Clean disconnect (no last-will), after waiting briefly for the last publish."""
        info = self._last_info
        if info is not None and self.connected:
            try:
                info.wait_for_publish(flush_timeout)
            except (RuntimeError, ValueError):
                pass  # already failed/disconnected: nothing left to wait for
        self.client.disconnect()
        self.client.loop_stop()
        self._connected.clear()

    def subscribe(self, pattern: str, qos: int = 1) -> None:
        with self._lock:
            if (pattern, qos) not in self._subs:
                self._subs.append((pattern, qos))
            if self._connected.is_set():
                self.client.subscribe(pattern, qos)

    def publish(self, topic: str, payload: bytes | str, retain: bool = False, qos: int = 1) -> None:
        data = payload.encode() if isinstance(payload, str) else bytes(payload)
        with self._lock:
            if not self._connected.is_set():
                self._out.put(topic, data, qos, retain)
                return
        self._send(topic, data, qos, retain)

    def _send(self, topic: str, data: bytes, qos: int, retain: bool) -> None:
        info = self.client.publish(topic, data, qos=qos, retain=retain)
        if info.rc == paho.MQTT_ERR_NO_CONN and qos == 0:
            with self._lock:
                self._out.put(topic, data, qos, retain)  # paho keeps qos>0 itself, but not qos 0
        elif info.rc == paho.MQTT_ERR_QUEUE_SIZE:
            self._out.dropped += 1
            log.warning("mqtt.outgoing_dropped", topic=topic, dropped_total=self._out.dropped)
        self._last_info = info


def _opt(p: Path | None) -> str | None:
    return None if p is None else str(p)
