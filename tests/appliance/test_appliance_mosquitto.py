"""The example Mosquitto setups, loaded by a real Mosquitto, both ways:

- a fresh broker (systemd/mosquitto/mosquitto.conf, users and ACL blocks made by add-user.sh as
  the README says): a node cannot publish (or read) under another node's topics; Home Assistant
  and the CLI can neither act as nodes nor impersonate the gateway; client ids are user names, so
  connecting with the gateway's client id does not knock it off; wrong passwords are refused;
- an existing broker with its own password_file and a zigbee2mqtt-like user (with and without an
  ACL of its own): the README's steps add the Xronos users without a duplicate option, and
  zigbee2mqtt and Home Assistant keep exactly the rights they had.
"""

from __future__ import annotations

import queue
import shutil
import subprocess
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from brokers import mosquitto_path, start_mosquitto

EXAMPLE = Path(__file__).resolve().parents[2] / "systemd" / "mosquitto"
ADD_USER = EXAMPLE / "add-user.sh"
USERS = {"gateway": "gw-pw", "homeassistant": "ha-pw", "xronos-cli": "cli-pw", "n1": "n1-pw", "n2": "n2-pw"}
ROLES = {"gateway": "gateway", "homeassistant": "homeassistant", "xronos-cli": "cli", "n1": "node", "n2": "node"}
NOT_AUTHORIZED = 135  # MQTT 5 reason code 0x87

pytestmark = pytest.mark.skipif(mosquitto_path() is None or shutil.which("mosquitto_passwd") is None,
                                reason="needs mosquitto and mosquitto_passwd")


def add_user(*args: str, password: str | None = None) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["bash", str(ADD_USER), *args], input=f"{password}\n{password}\n" if password else None,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    """The fresh-broker setup of the README: mosquitto.conf as the drop-in, add-user.sh per device."""
    bdir = tmp_path_factory.mktemp("acl-broker")
    passwd, acl = bdir / "xronos.passwd", bdir / "xronos.acl"
    for user, pw in USERS.items():
        add_user(ROLES[user], user, "--passwd", str(passwd), "--acl", str(acl), password=pw)
    # The example config with its file paths pointed into the temp dir and its `listener 1883`
    # replaced by the helper's listener on a free loopback port (every other line verbatim).
    conf = "\n".join(
        ln for ln in (EXAMPLE / "mosquitto.conf").read_text()
        .replace("/etc/mosquitto/xronos.passwd", str(passwd))
        .replace("/etc/mosquitto/xronos.acl", str(acl)).splitlines()
        if not ln.startswith("listener ")
    )
    with start_mosquitto(conf, anonymous=False, tmp_dir=bdir / "run") as running:
        yield running


class Client:
    """A paho MQTT 5 client that records deliveries and PUBACK reason codes."""

    def __init__(self, broker, user: str | None, password: str | None, client_id: str | None = None) -> None:
        self.inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.acks: dict[int, int] = {}
        self.connected: queue.Queue[int] = queue.Queue()
        self.disconnects: queue.Queue[int] = queue.Queue()
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id or f"test-{user}",
                             protocol=mqtt.MQTTv5, reconnect_on_failure=False)
        if user is not None:
            self.c.username_pw_set(user, password)
        self.c.on_connect = lambda c, u, f, rc, p: self.connected.put(rc.value)
        self.c.on_disconnect = lambda c, u, f, rc, p: self.disconnects.put(rc.value)
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

    def make(user: str, password: str | None = None, client_id: str | None = None) -> Client:
        made.append(Client(broker, user, USERS[user] if password is None else password, client_id))
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


def test_a_nodes_credentials_cannot_command_that_node(clients):
    """A node writes what it reports and reads what it is told; stolen node credentials (a leaked
    password file) cannot assign or start its jobs, or flip its Home Assistant switch."""
    gateway, n1 = clients("gateway"), clients("n1")
    gateway.subscribe("xronos/#")
    for leaf in ("assignment", "control", "profile/request", "inspect/request", "set"):
        assert n1.publish(f"xronos/node/n1/{leaf}", b"\x80") == NOT_AUTHORIZED, leaf
    assert n1.publish("xronos/node/n1/ack", b"\x80") == 0
    assert gateway.received_until("xronos/node/n1/ack") == [("xronos/node/n1/ack", b"\x80")]


def test_the_node_blocks_leaves_are_the_topic_tables(broker):
    """add-user.sh lists a node's topics by direction; they must be the table's, every one."""
    from xronos.protocol.topics import ENTRIES

    text = ADD_USER.read_text()
    listed = {d: text.split(f'NODE_{d}="', 1)[1].split('"', 1)[0].split() for d in ("WRITES", "READS")}
    own = {e.pattern.removeprefix("node/{node_id}/"): e.direction for e in ENTRIES if e.pattern.startswith("node/{node_id}/")}
    # "writer → reader, reader (note)"; the node reads a topic it writes when "itself" is a reader.
    writer = {leaf: d.split("→")[0].strip() for leaf, d in own.items()}
    readers = {leaf: {r.strip() for r in d.split("→")[1].split("(")[0].split(",")} for leaf, d in own.items()}
    assert sorted(listed["WRITES"]) == sorted(leaf for leaf, w in writer.items() if w == "node")
    assert sorted(listed["READS"]) == sorted(leaf for leaf, rs in readers.items()
                                             if "node" in rs or any(r.startswith("itself") for r in rs))
    assert "availability" in listed["READS"]  # the node answers an `offline` left under its name


def test_node_reads_only_its_own_topics(clients):
    gateway, n1 = clients("gateway"), clients("n1")
    n1.subscribe("xronos/#")
    assert gateway.publish("xronos/node/n2/assignment", b"for n2") == 0
    assert gateway.publish("xronos/node/n2/availability", b"offline") == 0
    assert gateway.publish("xronos/job/j1/state", b"{}") == 0
    assert gateway.publish("xronos/node/n1/assignment", b"for n1") == 0
    # Its own availability, as another process's last will would leave it: the node must hear it.
    assert gateway.publish("xronos/node/n1/availability", b"offline") == 0
    assert n1.received_until("xronos/node/n1/availability") == [("xronos/node/n1/assignment", b"for n1"),
                                                                ("xronos/node/n1/availability", b"offline")]


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


def test_home_assistant_and_the_cli_cannot_act_as_nodes(clients):
    """The old `pattern readwrite xronos/node/%u/#` let the homeassistant user publish as a node
    named "homeassistant" (and the CLI user as "xronos-cli"); per-user blocks do not."""
    gateway, ha, cli = clients("gateway"), clients("homeassistant"), clients("xronos-cli")
    gateway.subscribe("xronos/#")
    for c, user in ((ha, "homeassistant"), (cli, "xronos-cli")):
        for leaf in ("availability", "capabilities", "ack", "job", "state"):
            assert c.publish(f"xronos/node/{user}/{leaf}", b"{}") == NOT_AUTHORIZED, (user, leaf)
    assert cli.publish("xronos/gateway/set", b'{"action": "pause"}') == NOT_AUTHORIZED
    assert cli.publish("xronos/gateway/request/nodes/list", b"{}") == 0
    assert ha.publish("xronos/gateway/request/job/submit", b"{}") == NOT_AUTHORIZED
    assert ha.publish("homeassistant/status", b"online") in (0, 16)  # its birth message (16: nobody listens)
    ha.subscribe("homeassistant/device/+/config")
    assert gateway.publish("homeassistant/device/xronos_gateway/config", b"{}") == 0  # discovery
    assert ha.received_until("homeassistant/device/xronos_gateway/config")[-1][1] == b"{}"
    got = gateway.received_until("xronos/gateway/request/nodes/list")
    assert got == [("xronos/gateway/request/nodes/list", b"{}")]


def test_the_gateways_client_id_cannot_be_taken_over(clients):
    """Client id = user name: another user connecting with the gateway's client id gets its own
    user name as id instead, and the gateway stays connected."""
    gateway = clients("gateway", client_id="xronos-gateway")
    gateway.subscribe("xronos/#")
    for user in ("homeassistant", "xronos-cli", "n1"):
        intruder = clients(user, client_id="xronos-gateway")
        assert intruder.rc == 0
        with pytest.raises(queue.Empty):
            gateway.disconnects.get(timeout=0.5)
    assert clients("n1").publish("xronos/node/n1/availability", b"online") == 0
    assert gateway.received_until("xronos/node/n1/availability")[-1] == ("xronos/node/n1/availability", b"online")


# --- an existing broker -------------------------------------------------------------------------

THEIRS = {"zigbee2mqtt": "z2m-pw", "homeassistant": "ha-pw"}
THEIR_ACL = """# the home's own ACL
user zigbee2mqtt
topic readwrite zigbee2mqtt/#
topic readwrite homeassistant/#

user homeassistant
topic readwrite #
"""


def _their_broker(bdir: Path, with_acl: bool) -> tuple[str, Path, Path]:
    """A home's Mosquitto: its own password_file (zigbee2mqtt, homeassistant), conf.d included."""
    (bdir / "conf.d").mkdir(parents=True)
    passwd, acl = bdir / "passwd", bdir / "acl"
    for i, (user, pw) in enumerate(THEIRS.items()):
        subprocess.run(["mosquitto_passwd", "-b", *(["-c"] if i == 0 else []), str(passwd), user, pw],
                       check=True, capture_output=True, timeout=30)
    conf = f"password_file {passwd}\n"
    if with_acl:
        acl.write_text(THEIR_ACL)
        conf += f"acl_file {acl}\n"
    return conf + f"include_dir {bdir / 'conf.d'}\n", passwd, acl


def _readme_existing_broker_steps(bdir: Path, passwd: Path, acl: Path, had_acl: bool) -> None:
    """README "Adding Xronos to an existing broker", with the broker's files in bdir."""
    if not had_acl:
        for user in [ln.split(":", 1)[0] for ln in passwd.read_text().splitlines() if ln]:
            add_user("keep", user, "--acl", str(acl))
        (bdir / "conf.d" / "xronos.conf").write_text(
            (EXAMPLE / "existing-broker.conf").read_text().replace("/etc/mosquitto/acl", str(acl)))
    for user in ("gateway", "xronos-cli", "n1"):
        add_user(ROLES[user], user, "--passwd", str(passwd), "--acl", str(acl), password=USERS[user])


@pytest.mark.parametrize("had_acl", [False, True], ids=["no-acl-before", "own-acl-before"])
def test_adding_xronos_to_an_existing_broker_leaves_zigbee2mqtt_alone(tmp_path, had_acl):
    conf, passwd, acl = _their_broker(tmp_path / "home", had_acl)
    # What the README warns about: the fresh broker's drop-in repeats password_file.
    (tmp_path / "home" / "conf.d" / "xronos.conf").write_text((EXAMPLE / "mosquitto.conf").read_text())
    with pytest.raises(RuntimeError, match="Duplicate password_file"):
        start_mosquitto(conf, anonymous=False, tmp_dir=tmp_path / "run-wrong").stop()
    (tmp_path / "home" / "conf.d" / "xronos.conf").unlink()

    _readme_existing_broker_steps(tmp_path / "home", passwd, acl, had_acl)
    if had_acl:
        assert acl.read_text().startswith(THEIR_ACL)  # their rules untouched, ours appended
    drop_in = [ln for ln in (EXAMPLE / "existing-broker.conf").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    assert drop_in == ["acl_file /etc/mosquitto/acl"]  # it repeats no global option
    with start_mosquitto(conf, anonymous=False, tmp_dir=tmp_path / "run") as b:
        z2m = Client(b, "zigbee2mqtt", THEIRS["zigbee2mqtt"])
        home = Client(b, "homeassistant", THEIRS["homeassistant"])
        gw = Client(b, "gateway", USERS["gateway"])
        n1 = Client(b, "n1", USERS["n1"])
        try:
            assert (z2m.rc, home.rc, gw.rc, n1.rc) == (0, 0, 0, 0)
            home.subscribe("zigbee2mqtt/#")
            home.subscribe("homeassistant/#")
            home.subscribe("xronos/#")
            z2m.subscribe("zigbee2mqtt/+/set")
            # zigbee2mqtt publishing alongside, as before: its bridge state and discovery.
            assert z2m.publish("zigbee2mqtt/bridge/state", b'{"state":"online"}') == 0
            assert z2m.publish("homeassistant/sensor/0x00158d/temperature/config", b"{}") == 0
            assert home.publish("zigbee2mqtt/lamp/set", b'{"state":"ON"}') == 0
            assert z2m.received_until("zigbee2mqtt/lamp/set")[-1] == ("zigbee2mqtt/lamp/set", b'{"state":"ON"}')
            # Xronos alongside: the gateway's state reaches Home Assistant; a node stays in its lane.
            assert gw.publish("xronos/gateway/state", b'{"phase":"idle"}') == 0
            assert n1.publish("zigbee2mqtt/lamp/set", b"{}") == NOT_AUTHORIZED
            assert n1.publish("xronos/node/n2/availability", b"online") == NOT_AUTHORIZED
            assert gw.publish("zigbee2mqtt/lamp/set", b"{}") == NOT_AUTHORIZED
            got = home.received_until("xronos/gateway/state")
            assert [t for t, _ in got] == ["zigbee2mqtt/bridge/state",
                                          "homeassistant/sensor/0x00158d/temperature/config",
                                          "zigbee2mqtt/lamp/set", "xronos/gateway/state"]
        finally:
            for c in (z2m, home, gw, n1):
                c.close()
    assert "Duplicate" not in b.log_text and "Error" not in b.log_text


def test_add_user_is_idempotent_and_removes_cleanly(tmp_path):
    acl, passwd = tmp_path / "acl", tmp_path / "passwd"
    acl.write_text(THEIR_ACL)
    add_user("node", "pi5", "--acl", str(acl), "--passwd", str(passwd), password="a")
    once = acl.read_text()
    add_user("node", "pi5", "--acl", str(acl), "--passwd", str(passwd), password="b")
    assert acl.read_text() == once and once.startswith(THEIR_ACL)
    assert passwd.read_text().count("pi5:") == 1
    add_user("--remove", "pi5", "--acl", str(acl), "--passwd", str(passwd))
    assert acl.read_text().rstrip("\n") == THEIR_ACL.rstrip("\n") and "pi5" not in passwd.read_text()
    bad = subprocess.run(["bash", str(ADD_USER), "node", "pi5/#", "--acl", str(acl)], capture_output=True, text=True)
    assert bad.returncode == 2 and "NAME" in bad.stderr
