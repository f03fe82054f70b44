"""The gateway's handlers of the nodes' topics (availability, capabilities, profile and inspection
reports, acknowledgements, metrics, job status, errors): each message checked to come from the node
whose topic it is on, then turned into registry updates and events of the job state machine.

A mixin of `GatewayService` (gateway/service.py), which provides what these handlers use: the
registry `reg`, the tables `jobs` and `previews`, `bus`, `dispatcher`, `ha`, `rebal`, and
`_event(job_id, event)` / `_internal(where, job_id, exc)`.
"""

from __future__ import annotations

import json
import time
from typing import Any

import structlog

from xronos.gateway import registry as R
from xronos.gateway.homeassistant import discovery as ha
from xronos.gateway.job import machine as J
from xronos.gateway.job.offline import OfflineGrace
from xronos.gateway.plan.profiles import falling_times, refused_request_id, screen_report
from xronos.protocol import messages as m

# The service's logger: these lines read as they did when the handlers lived in service.py.
log = structlog.get_logger("xronos.gateway.service")


class NodeTopics:
    reg: R.Registry
    jobs: dict[str, J.Job]
    previews: dict[str, J.Job]
    bus: Any
    dispatcher: Any
    ha: ha.HAContext | None
    rebal: Any
    offline: OfflineGrace | None  # None: a node's "offline" reaches its jobs at once

    @staticmethod
    def _same_node(claimed: str, params: dict[str, str]) -> None:
        if claimed != params["node_id"]:  # only the node itself may speak under its topics
            raise ValueError(f"payload claims node {claimed!r} on node {params['node_id']!r}'s topic: ignored")

    def _to_jobs(self, event: J.Event) -> None:
        for job_id, job in list(self.jobs.items()) + list(self.previews.items()):
            if job.phase not in J.TERMINAL:
                self._event(job_id, event)

    def _on_availability(self, msg: m.Availability, params: dict[str, str]) -> None:
        node = params["node_id"]
        before = R.usable(self.reg)
        self.reg, change = R.on_availability(self.reg, node, msg == m.Availability.ONLINE, time.time())
        if node not in self.reg:
            log.warning("gateway.registry_full", node=node, known=len(self.reg),
                        hint="every known node is online: this one is not recorded")
        if msg == m.Availability.ONLINE and self.offline is not None:
            self.offline.online(node)
        if change == "down":
            if self.offline is None:
                self._to_jobs(J.NodeDown(node))
            else:
                self.offline.offline(node, time.monotonic())
        self._newly_usable(before)

    def _offline_due(self) -> None:
        """Tell the jobs of the nodes whose "offline" has stood through its grace (gateway/job/offline.py)."""
        if self.offline is None or not self.bus.connected:
            return
        for node in self.offline.due(time.monotonic(), True):
            info = self.reg.get(node)
            if info is not None and info.online:  # back meanwhile (the registry heard it)
                continue
            log.info("node.offline", node=node, hint="its last will stood through the grace: its jobs re-plan")
            self._to_jobs(J.NodeDown(node))

    def _availability_cleared(self, params: dict[str, str]) -> None:
        """A node's retained availability removed (an operator cleaning the broker of what a flood or
        a buggy fleet left): a node that never announced its capabilities is forgotten. One that did
        stays as it is: a cleared retained message says nothing about whether the node runs (its
        last will does)."""
        node = params["node_id"]
        info = self.reg.get(node)
        if info is not None and info.capabilities is None:
            self.reg = {k: v for k, v in self.reg.items() if k != node}

    def _newly_usable(self, before: frozenset[str]) -> None:
        for node in sorted(R.usable(self.reg) - before):
            self._to_jobs(J.NodeUp(node))

    def _on_caps(self, msg: m.Capabilities, params: dict[str, str]) -> None:
        self._same_node(msg.node_id, params)
        before = R.usable(self.reg)
        known = msg.node_id in self.reg and self.reg[msg.node_id].capabilities is not None
        self.reg = R.on_capabilities(self.reg, msg, time.time())
        if self.ha is not None and not known and msg.node_id in self.reg:
            topic, payload = ha.node_discovery(self.ha, msg)
            self.bus.publish(topic, json.dumps(payload), retain=True)
        self._newly_usable(before)

    def _on_profile(self, msg: m.ProfileReport, params: dict[str, str]) -> None:
        self._same_node(msg.node_id, params)
        report, why = screen_report(msg)
        warnings = tuple(falling_times(report)) if report is not None else ()  # usable, but likely disturbed
        for text in warnings:
            self.dispatcher.warn_throttled("profile.time_falls_with_width", ("profile.falling", msg.node_id),
                                           node=msg.node_id, job=msg.job_id, detail=text)
        self._event(msg.job_id, J.Profiled(msg.node_id, msg.request_id, report, why, warnings))  # bad: node left out

    def _on_node_error(self, msg: m.ErrorResponse, params: dict[str, str]) -> None:
        self.dispatcher.warn_throttled("node reported an error", ("node.error", params["node_id"], msg.code),
                                       node=params["node_id"], code=msg.code, message=msg.message[:500])
        if msg.code == "profile_failed":  # "<request id>: <reason>"
            rid, _, text = msg.message.partition(": ")
            self._profile_refused(text, params, rid)

    def _profile_refused(self, text: str, params: dict[str, str], rid: bytes | str) -> None:
        rid = rid if isinstance(rid, str) else refused_request_id(rid) or ""  # a refused report: read from it
        if rid.rpartition(".")[0]:  # request ids are "<job id>.<seq>"; the job checks it asked this very node
            self._event(rid.rpartition(".")[0], J.Profiled(params["node_id"], rid, None, text[:500]))

    def _on_inspect(self, msg: m.InspectReport, params: dict[str, str]) -> None:
        self._same_node(msg.node_id, params)
        self._event(msg.job_id, J.Inspected(msg))

    def _on_ack(self, msg: m.AssignmentAck, params: dict[str, str]) -> None:
        self._same_node(msg.node_id, params)
        self._event(msg.job_id, J.Acked(msg.node_id, msg.plan_version, msg.accepted, msg.reason))

    def _on_metrics(self, msg: m.IterationMetrics, params: dict[str, str]) -> None:
        self._same_node(msg.node_id, params)
        self._event(msg.job_id, J.Metrics(msg))
        self._rebalance(msg)

    def _rebalance(self, x: m.IterationMetrics) -> None:
        """Feed the job's re-balancing policy; its decision goes through the state machine
        (`J.Rebalanced`), which orders the re-shard."""
        try:
            decision = self.rebal.observe(self.jobs.get(x.job_id), x)
        except ValueError as exc:  # e.g. a node without a profile: the job runs on, unbalanced
            log.warning("gateway.rebalance_off", job=x.job_id, reason=str(exc)[:300])
            return
        except Exception as exc:  # the policy broke: this plan version goes on without it
            self._internal("rebalance", x.job_id, exc)
            return
        if decision is not None:
            self._event(x.job_id, decision)

    def _on_node_job(self, msg: m.NodeJobStatus, params: dict[str, str]) -> None:
        self._same_node(msg.node_id, params)
        self._event(msg.job_id, J.Status(msg))
        self.rebal.moved(msg)
