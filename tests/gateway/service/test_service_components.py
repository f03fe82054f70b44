"""The gateway service as a core and its components (gateway/service/): every topic the gateway
reads has one handler, registered by one component (the core keeps only the retained job states it
publishes itself), and a component that breaks in a hook is logged and counted while the others
and the loop go on."""

from __future__ import annotations

import re

from fakebus import FakeBroker
from xronos.gateway.config import GatewayConfig
from xronos.gateway.service import GatewayService
from xronos.gateway.service.component import Component
from xronos.protocol.dispatch import Dispatcher
from xronos.protocol.topics import ENTRIES, TopicTable

T = TopicTable()


def _service(tmp_path) -> GatewayService:
    cfg = GatewayConfig(state_dir=tmp_path / "gw", homeassistant={"enabled": True, "job_dir": str(tmp_path)})
    bus = FakeBroker().bus("gw", will=(T.build("gateway.availability"), "offline", True), table=T)
    return GatewayService(cfg, bus)


def test_every_topic_the_gateway_reads_is_handled_by_one_component(tmp_path):
    svc = _service(tmp_path)
    assert [c.name for c in svc.components] == ["availability", "nodes", "requests", "Home Assistant"]
    by_component = {}
    for c in svc.components:
        d = Dispatcher(svc.bus)
        c.register(d)
        by_component[c.name] = set(d.handlers)
    keys = [k for ks in by_component.values() for k in ks]
    assert len(keys) == len(set(keys)), by_component  # a second handler would replace the first
    svc.start()
    try:
        assert set(svc.dispatcher.handlers) == set(keys) | {"job.state"}
    finally:
        svc.shutdown()
    # what the topic table says the gateway reads ("→ gateway", "→ all"), and its own job states
    reads = {e.key for e in ENTRIES if re.search(r"→ .*\b(gateway|all)\b", e.direction)}
    assert set(keys) == reads
    assert {"node.metrics", "gateway.request.job/submit", "gateway.set", "gateway.availability"} <= set(keys)


class _Broken(Component):
    name = "broken"

    def tick(self, now: float) -> None:
        raise RuntimeError("a bug in a component")


class _Counting(Component):
    name = "counting"

    def __init__(self) -> None:
        self.ticks = 0

    def tick(self, now: float) -> None:
        self.ticks += 1


def test_a_component_that_breaks_in_its_tick_is_counted_and_the_others_go_on(tmp_path):
    svc = _service(tmp_path)
    counting = _Counting()
    svc.components = (_Broken(), *svc.components, counting)
    svc.start()
    try:
        for _ in range(3):
            svc.step(0)
    finally:
        svc.shutdown()
    assert counting.ticks == 3 and svc.internal_errors == 3 and not svc.stopping
