"""The nodes, as the gateway service hears them: availability, capabilities, profile and inspection
reports, acknowledgements, metrics, job status and errors. Each message is checked to come from
the node whose topic it is on, then turned into registry updates and events of the job state
machine. Also here: the grace a node's "offline" stands through before its jobs hear of it
(gateway/job/offline.py), and the live re-balancing policy the metrics feed (`Rebalancers`).
"""

from __future__ import annotations

import time

import structlog

from xronos.gateway import registry as R
from xronos.gateway.job import machine as J
from xronos.gateway.job.offline import OfflineGrace
from xronos.gateway.job.rebalancers import Rebalancers
from xronos.gateway.plan.profiles import falling_times, refused_request_id, screen_report
from xronos.gateway.plan.rebalance import PolicyConfig
from xronos.protocol import messages as m
from xronos.protocol.dispatch import Dispatcher

from .component import Component, Core

log = structlog.get_logger(__name__)


def _same_node(claimed: str, params: dict[str, str]) -> None:
    if claimed != params["node_id"]:  # only the node itself may speak under its topics
        raise ValueError(f"payload claims node {claimed!r} on node {params['node_id']!r}'s topic: ignored")


class Nodes(Component):
    name = "nodes"

    def __init__(self, core: Core, policy: PolicyConfig) -> None:
        self.core = core
        cfg = core.cfg
        # Live re-balancing: per running job, its plan version's policy (None: it could not start).
        self.rebal = Rebalancers(policy)
        # After a reconnect the nodes get a reconnect back-off and a keepalive to say "online" again.
        # None: a node's "offline" reaches its jobs at once.
        self.offline = OfflineGrace(short_s=cfg.offline_grace_s,
                                    settle_s=float(cfg.broker.reconnect_max_s + cfg.broker.keepalive)) \
            if cfg.offline_grace_s > 0 else None

    def register(self, dispatcher: Dispatcher) -> None:
        dispatcher.on("node.availability", self._on_availability, on_cleared=self._availability_cleared)
        dispatcher.on("node.capabilities", self._on_caps)
        dispatcher.on("node.profile_report", self._on_profile, on_refused=self._profile_refused)
        dispatcher.on("node.inspect_report", self._on_inspect)
        dispatcher.on("node.ack", self._on_ack)
        dispatcher.on("node.metrics", self._on_metrics)
        dispatcher.on("node.job", self._on_node_job)
        dispatcher.on("node.error", self._on_node_error)

    def reconnected(self, now: float) -> None:
        """The nodes get their settle time from now (gateway/job/offline.py)."""
        if self.offline is not None:
            self.offline.reconnected(now)

    def tick(self, now: float) -> None:
        """Tell the jobs of the nodes whose "offline" has stood through its grace."""
        if self.offline is None or not self.core.bus.connected:
            return
        for node in self.offline.due(now, True):
            info = self.core.reg.get(node)
            if info is not None and info.online:  # back meanwhile (the registry heard it)
                continue
            log.info("node.offline", node=node, hint="its last will stood through the grace: its jobs re-plan")
            self.core.to_jobs(J.NodeDown(node))

    # --- the registry --------------------------------------------------------------------------
    def _on_availability(self, msg: m.Availability, params: dict[str, str]) -> None:
        node = params["node_id"]
        before = self.core.reg
        reg, change = R.on_availability(before, node, msg == m.Availability.ONLINE, time.time())
        self.core.set_registry(reg)
        if node not in reg:
            log.warning("gateway.registry_full", node=node, known=len(reg),
                        hint="every known node is online: this one is not recorded")
        if msg == m.Availability.ONLINE and self.offline is not None:
            self.offline.online(node)
        if change == "down":
            if self.offline is None:
                self.core.to_jobs(J.NodeDown(node))
            else:
                self.offline.offline(node, time.monotonic())
        self._newly_usable(before)

    def _availability_cleared(self, params: dict[str, str]) -> None:
        """A node's retained availability removed (an operator cleaning the broker of what a flood or
        a buggy fleet left): a node that never announced its capabilities is forgotten. One that did
        stays as it is: a cleared retained message says nothing about whether the node runs (its
        last will does)."""
        node = params["node_id"]
        info = self.core.reg.get(node)
        if info is not None and info.capabilities is None:
            self.core.set_registry({k: v for k, v in self.core.reg.items() if k != node})

    def _on_caps(self, msg: m.Capabilities, params: dict[str, str]) -> None:
        _same_node(msg.node_id, params)
        before = self.core.reg
        self.core.set_registry(R.on_capabilities(before, msg, time.time()))
        self._newly_usable(before)

    def _newly_usable(self, before: R.Registry) -> None:
        for node in sorted(R.usable(self.core.reg) - R.usable(before)):
            self.core.to_jobs(J.NodeUp(node))

    # --- a job's messages ----------------------------------------------------------------------
    def _on_profile(self, msg: m.ProfileReport, params: dict[str, str]) -> None:
        _same_node(msg.node_id, params)
        report, why = screen_report(msg)
        warnings = tuple(falling_times(report)) if report is not None else ()  # usable, but likely disturbed
        for text in warnings:
            self.core.dispatcher.warn_throttled("profile.time_falls_with_width", ("profile.falling", msg.node_id),
                                                node=msg.node_id, job=msg.job_id, detail=text)
        self.core.event(msg.job_id, J.Profiled(msg.node_id, msg.request_id, report, why, warnings))  # bad: left out

    def _on_node_error(self, msg: m.ErrorResponse, params: dict[str, str]) -> None:
        self.core.dispatcher.warn_throttled("node reported an error", ("node.error", params["node_id"], msg.code),
                                            node=params["node_id"], code=msg.code, message=msg.message[:500])
        if msg.code == "profile_failed":  # "<request id>: <reason>"
            rid, _, text = msg.message.partition(": ")
            self._profile_refused(text, params, rid)

    def _profile_refused(self, text: str, params: dict[str, str], rid: bytes | str) -> None:
        rid = rid if isinstance(rid, str) else refused_request_id(rid) or ""  # a refused report: read from it
        if rid.rpartition(".")[0]:  # request ids are "<job id>.<seq>"; the job checks it asked this very node
            self.core.event(rid.rpartition(".")[0], J.Profiled(params["node_id"], rid, None, text[:500]))

    def _on_inspect(self, msg: m.InspectReport, params: dict[str, str]) -> None:
        _same_node(msg.node_id, params)
        self.core.event(msg.job_id, J.Inspected(msg))

    def _on_ack(self, msg: m.AssignmentAck, params: dict[str, str]) -> None:
        _same_node(msg.node_id, params)
        self.core.event(msg.job_id, J.Acked(msg.node_id, msg.plan_version, msg.accepted, msg.reason))

    def _on_metrics(self, msg: m.IterationMetrics, params: dict[str, str]) -> None:
        _same_node(msg.node_id, params)
        self.core.event(msg.job_id, J.Metrics(msg))
        self._rebalance(msg)

    def _rebalance(self, x: m.IterationMetrics) -> None:
        """Feed the job's re-balancing policy; its decision goes through the state machine
        (`J.Rebalanced`), which orders the re-shard."""
        try:
            decision = self.rebal.observe(self.core.jobs.get(x.job_id), x)
        except ValueError as exc:  # e.g. a node without a profile: the job runs on, unbalanced
            log.warning("gateway.rebalance_off", job=x.job_id, reason=str(exc)[:300])
            return
        except Exception as exc:  # the policy broke: this plan version goes on without it
            self.core.internal("rebalance", x.job_id, exc)
            return
        if decision is not None:
            self.core.event(x.job_id, decision)

    def _on_node_job(self, msg: m.NodeJobStatus, params: dict[str, str]) -> None:
        _same_node(msg.node_id, params)
        self.core.event(msg.job_id, J.Status(msg))
        self.rebal.moved(msg)
