"""Home Assistant, as a component of the gateway service: the discovery of the gateway's and the
nodes' devices, the gateway's state (the current job, the nodes online, the last command), and
what Home Assistant asks of the gateway (start a job from the form, pause / resume / cancel the
current one, remove a retired node). The bridge (gateway/homeassistant/bridge.py) speaks to Home
Assistant; this component connects it to the job table and the node registry.
"""

from __future__ import annotations

import json

import structlog

from xronos.gateway import registry as R
from xronos.gateway.homeassistant import discovery as ha
from xronos.gateway.homeassistant.bridge import Actions, HABridge, Refused
from xronos.gateway.job import machine as J
from xronos.gateway.job.progress import state_view
from xronos.gateway.job.views import current, nodes_of
from xronos.protocol import messages as m
from xronos.protocol.dispatch import Dispatcher, RequestError

from .component import Component, Core

log = structlog.get_logger(__name__)
# A removed node's retained topics: left, its capabilities would bring it back on the next start.
NODE_RETAINED = ("node.availability", "node.capabilities", "node.job", "node.ha_state", "node.catalog")


class HomeAssistant(Component):
    name = "Home Assistant"

    def __init__(self, core: Core) -> None:
        self.core = core
        cfg = core.cfg
        self.ha = ha.HAContext(cfg.base_topic, cfg.gateway_id, cfg.homeassistant.discovery_prefix)
        self.bridge = HABridge(self.ha, core.bus, cfg.homeassistant.job_dir, Actions(
            job_command=self._job_command, start=self._start, remove_node=self._remove_node,
            nodes=self._known_caps, publish=self.publish_state),
            form_file=cfg.state_dir / "homeassistant-form.json")

    def register(self, dispatcher: Dispatcher) -> None:
        self.bridge.register(dispatcher)

    def reconnected(self, now: float) -> None:
        """A broker restarted without persistence has forgotten the discovery and the gateway's
        state: both go out again. Here in the control loop, not in the connect hook (the bus's
        network thread), because discovery walks the catalogs and the gateway's config entities,
        which the control loop changes."""
        self.bridge.publish_discovery()
        self.bridge.forget_published()

    def tick(self, now: float) -> None:
        self.bridge.tick()

    def published(self) -> None:
        self.publish_state()

    def responding(self, answer: J.Respond) -> None:
        if answer.name == "job/submit":
            if not answer.ok:
                self.bridge.refused(answer.error)  # Home Assistant's "Last error" shows why
            self.bridge.answered((answer.data or {}).get("job_id"), answer.ok, answer.error)  # and Last command

    def nodes_changed(self, before: R.Registry, after: R.Registry) -> None:
        """A node whose capabilities are new to the registry gets its device."""
        for node_id, info in after.items():
            old = before.get(node_id)
            if info.capabilities is not None and (old is None or old.capabilities is None):
                topic, payload = ha.node_discovery(self.ha, info.capabilities)
                self.core.bus.publish(topic, json.dumps(payload), retain=True)

    def _known_caps(self) -> list[m.Capabilities]:
        return [n.capabilities for n in self.core.reg.values() if n.capabilities]

    def publish_state(self) -> None:
        job = current(self.core.jobs.values())
        online = sum(1 for n in self.core.reg.values() if n.online)
        self.bridge.publish_state(state_view(job) if job else None, job.created_at if job else None, online,
                                  spec=job.spec if job else None)

    # --- what Home Assistant asks ----------------------------------------------------------------
    def _job_command(self, action: str) -> str:
        job = current(self.core.jobs.values())
        if job is None or job.phase in J.TERMINAL:
            raise ValueError(f"no unfinished job to {action}")
        self.core.event(job.job_id, J.Command(action, None))
        return self.core.jobs[job.job_id].phase

    def _start(self, spec: m.JobSpec, name: str) -> str:
        """Submit a job from Home Assistant; Refused with the reason when it is refused at once
        (then no job exists: nothing may say it was submitted or started)."""
        try:
            job = self.core.submit(spec, None)
        except RequestError as exc:
            raise Refused(str(exc)) from None
        if J.refused(job):
            raise Refused(job.error or "refused")
        log.info("job submitted from Home Assistant", spec=name, job=job.job_id)
        return job.job_id

    def _remove_node(self, node_id: str) -> None:
        """Forget a retired node: its registry entry, its retained topics and its device."""
        node = self.core.reg.get(node_id)
        if node is None:
            raise ValueError(f"unknown node {node_id!r}")
        if node.online:
            raise ValueError(f"node {node_id!r} is online: stop its service first")
        users = [j.job_id for j in self.core.jobs.values() if j.phase not in J.TERMINAL and node_id in nodes_of(j)]
        if users:
            raise ValueError(f"node {node_id!r} is in unfinished job {users[0]}")
        self.core.set_registry({k: v for k, v in self.core.reg.items() if k != node_id})
        for key in NODE_RETAINED:
            self.core.bus.publish(self.core.bus.table.build(key, node_id=node_id), b"", retain=True)
        self.core.bus.publish(*ha.node_removal(self.ha, node_id), retain=True)
        self.bridge.forget_node(node_id)
        log.info("node removed", node=node_id)
