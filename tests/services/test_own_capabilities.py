"""A node's retained capabilities stay its own on a real broker: a forged announcement under its id,
an unreadable payload or an emptied topic is replaced by the node's own at once, not at its next
periodic announcement (a minute later); and two processes under one id do not answer each other
faster than once a second."""

from __future__ import annotations

import time

import pytest

from test_own_availability import Watcher, drive
from xronos.node.agent.config import NodeConfig
from xronos.node.agent.owncaps import REASSERT_EVERY_S
from xronos.node.agent.service import NodeService
from xronos.protocol import messages as m
from xronos.protocol.topics import TopicTable
from xronos.protocol.transport import BrokerSettings

FORGED = m.Capabilities(node_id="n0", hostname="forged", arch="aarch64", cpu_model="cpu", cores=64,
                        memory_total=1 << 40, memory_available=1 << 40, torch_version="2.13.0", data_host="192.0.2.9",
                        participate=True, cpu_temp_c=None, sent_at=5.0)


@pytest.fixture
def node(tmp_path, mqtt_broker):
    base = f"xc{tmp_path.name[-6:].replace('-', '')}"
    cfg = NodeConfig(node_id="n0", broker=BrokerSettings(host=mqtt_broker.host, port=mqtt_broker.port),
                     base_topic=base, state_dir=tmp_path / "state", allowed_dirs=[tmp_path], data_host="127.0.0.1",
                     threads=1)
    svc = NodeService(cfg)
    svc.start()
    drive(svc, lambda: svc.owncaps.confirmed, "the node hears its own capabilities")
    watcher = Watcher(mqtt_broker, TopicTable(base).build("node.capabilities", node_id="n0"), "watcher")
    yield svc, watcher
    watcher.close()
    svc.shutdown()


def own_after(svc, watcher, since: float, within: float) -> m.Capabilities:
    """The node's own announcement made after `since` (wall clock), stepping the node meanwhile (the
    retained one the watcher was handed on subscribing may arrive late: it is older)."""
    got: list[m.Capabilities] = []

    def ours() -> bool:
        for p in watcher.payloads():
            if p and b'"forged"' not in p and b"junk" not in p:
                caps = m.Capabilities.model_validate_json(p)
                if caps.sent_at >= since:
                    got.append(caps)
        return bool(got)

    t0 = time.monotonic()
    drive(svc, ours, "the node's own capabilities back on its topic", timeout=30)
    took = time.monotonic() - t0
    assert took < within, f"{took:.1f} s"
    return got[-1]


@pytest.mark.parametrize("payload", [FORGED.model_dump_json().encode(), b"junk", b""],
                         ids=["forged", "unreadable", "emptied"])
def test_what_replaces_its_capabilities_is_replaced_at_once(node, payload):
    svc, watcher = node
    watcher.payloads()
    time.sleep(REASSERT_EVERY_S)  # the first answer is never held back by an earlier one
    since = time.time()
    watcher.publish_retained(payload)
    caps = own_after(svc, watcher, since, within=2.0)  # at once: one turn of the loop, plus the broker's round trips
    assert caps.hostname != "forged" and caps.node_id == "n0" and svc.owncaps.reasserted == 1


def test_a_second_process_under_the_id_is_answered_at_most_once_a_second(node):
    svc, watcher = node
    time.sleep(REASSERT_EVERY_S)
    since = time.time()
    for i in range(5):  # a burst of another box's announcements
        watcher.publish_retained(FORGED.model_copy(update={"sent_at": 10.0 + i}).model_dump_json().encode())
    drive(svc, lambda: svc.owncaps.seen == 5, "the other process's announcements heard")
    own_after(svc, watcher, since, within=5.0)
    assert svc.owncaps.reasserted <= 2  # the first at once, the rest folded into one a second later
    for _ in range(int(REASSERT_EVERY_S / 0.05) + 10):
        svc.step(0.05)
    assert svc.owncaps.reasserted == 2
