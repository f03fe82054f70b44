"""The example Mosquitto config and ACL, loaded by a real Mosquitto: a node cannot publish (or read)
under another node's topics; Home Assistant can only command; wrong passwords are refused."""

from __future__ import annotations

import queue
import shutil
import subprocess
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from brokers import mosquitto_path, start_mosquitto

EXAMPLE = Path(__file__).resolve().parents[2] / "systemd" / "mosquitto"
USERS = {"gateway": "gw-pw", "homeassistant": "ha-pw", "n1": "n1-pw", "n2": "n2-pw"}
NOT_AUTHORIZED = 135  # MQTT 5 reason code 0x87

pytestmark = pytest.mark.skipif(mosquitto_path() is None or shutil.which("mosquitto_passwd") is None,
                                reason="needs mosquitto and mosquitto_passwd")


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    bdir = tmp_path_factory.mktemp("acl-broker")
    passwd = bdir / "passwd"
    for i, (user, pw) in enumerate(USERS.items()):
        subprocess.run(["mosquitto_passwd", "-b", *(["-c"] if i == 0 else []), str(passwd), user, pw],
                       check=True, capture_output=True, timeout=30)
    shutil.copy(EXAMPLE / "acl", bdir / "acl")  # the example ACL, verbatim
    # The example config minus its listeners (the helper adds one on a free loopback port),
    # with its file paths pointed into the temp dir.
    conf = "\n".join(
        ln for ln in (EXAMPLE / "mosquitto.conf").read_text()
        .replace("/etc/mosquitto/xronos.passwd", str(passwd))
        .replace("/etc/mosquitto/xronos.acl", str(bdir / "acl")).splitlines()
        if not ln.startswith("listener ")
    )
    with start_mosquitto(conf, anonymous=False, tmp_dir=bdir / "run") as running:
        yield running


class Client:
    """A paho MQTT 5 client that records deliveries and PUBACK reason codes."""

    def __init__(self, broker, user: str | None, password: str | None) -> None:
        self.inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.acks: dict[int, int] = {}
        self.connected: queue.Queue[int] = queue.Queue()
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"test-{user}",
                             protocol=mqtt.MQTTv5)
        if user is not None:
            self.c.username_pw_set(user, password)
        self.c.on_connect = lambda c, u, f, rc, p: self.connected.put(rc.value)
        self.c.on_message = lambda c, u, m: self.inbox.put((m.topic, m.payload))
        self.c.on_publish = lambda c, u, mid, rc, p: self.acks.__setitem__(mid, rc.value)
        self.c.connect(broker.host, broker.port)
        self.c.loop_start()
        self.rc = self.connected.get(timeout=10)

    def publish(self, topic: str, payload: bytes) -> int:
        info = self.c.publish(topic, payload, qos=1)
        info.wait_for_publish(timeout=10)
        return self.acks[info.mid]

    def subscribe(self, pattern: str) -> None:
        done: queue.Queue[int] = queue.Queue()
        self.c.on_subscribe = lambda c, u, mid, rcs, p: done.put(mid)
        self.c.subscribe(pattern, qos=1)
        done.get(timeout=10)

    def received_until(self, topic: str, timeout: float = 10) -> list[tuple[str, bytes]]:
        """Everything delivered up to and including the first message on `topic`."""
        got = []
        while True:
            item = self.inbox.get(timeout=timeout)
            got.append(item)
            if item[0] == topic:
                return got

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


@pytest.fixture
def clients(broker):
    made: list[Client] = []

    def make(user: str, password: str | None = None) -> Client:
        made.append(Client(broker, user, USERS[user] if password is None else password))
        return made[-1]

    yield make
    for c in made:
        c.close()


def test_node_cannot_publish_under_another_node(clients):
    gateway, n1 = clients("gateway"), clients("n1")
    assert gateway.rc == 0 and n1.rc == 0
    gateway.subscribe("xronos/#")
    assert n1.publish("xronos/node/n2/availability", b"online") == NOT_AUTHORIZED
    assert n1.publish("xronos/node/n2/metrics", b"\x80") == NOT_AUTHORIZED
    assert n1.publish("xronos/job/j1/state", b"{}") == NOT_AUTHORIZED
    assert n1.publish("xronos/gateway/set", b'{"action": "cancel"}') == NOT_AUTHORIZED
    assert n1.publish("xronos/node/n1/availability", b"online") == 0
    # Same connection, in order: once n1's own message is in, the refused ones would have been too.
    got = gateway.received_until("xronos/node/n1/availability")
    assert got == [("xronos/node/n1/availability", b"online")]


def test_node_reads_only_its_own_topics(clients):
    gateway, n1 = clients("gateway"), clients("n1")
    n1.subscribe("xronos/#")
    assert gateway.publish("xronos/node/n2/assignment", b"for n2") == 0
    assert gateway.publish("xronos/job/j1/state", b"{}") == 0
    assert gateway.publish("xronos/node/n1/assignment", b"for n1") == 0
    assert n1.received_until("xronos/node/n1/assignment") == [("xronos/node/n1/assignment", b"for n1")]


def test_home_assistant_commands_but_does_not_impersonate(clients):
    gateway, ha = clients("gateway"), clients("homeassistant")
    gateway.subscribe("xronos/#")
    assert ha.publish("xronos/node/n1/assignment", b"x") == NOT_AUTHORIZED
    assert ha.publish("xronos/gateway/state", b"{}") == NOT_AUTHORIZED
    assert ha.publish("xronos/node/n1/set", b'{"participate": false}') == 0
    assert ha.publish("xronos/gateway/set", b'{"action": "pause"}') == 0
    got = gateway.received_until("xronos/gateway/set")
    assert got == [("xronos/node/n1/set", b'{"participate": false}'),
                   ("xronos/gateway/set", b'{"action": "pause"}')]


def test_wrong_password_and_anonymous_are_refused(broker, clients):
    bad = clients("n1", "wrong")
    anonymous = Client(broker, None, None)
    anonymous.close()
    # MQTT 5: 134 "Bad user name or password", 135 "Not authorized".
    assert bad.rc in (134, 135) and anonymous.rc in (134, 135), (bad.rc, anonymous.rc)
