"""The node agent (`xronos node --config node.toml`): announce, profile, inspect, train on assignment.

One control loop reads the bus and never blocks on work: inspections and profiles run on one
worker thread (`node/agent/requests.py`), training runs in a child process (`node/rank/process.py`). Everything the node tells the
world goes out from this loop: retained availability (last-will `offline`) and capabilities,
re-published on every reconnect; profile reports; inspection reports; assignment acks; per-
iteration metrics; and the retained NodeJobStatus a restarted gateway reconciles from. An
`offline` that another process leaves on this node's availability while it runs (a duplicate
node_id's last will) is answered with `online` and an error in the log (`protocol.ownavail`).

Assignments are two-phase: the node checks and acknowledges, and starts its rank only on the
gateway's `start`, once every rank has accepted. A newer plan version of the same job replaces the
running rank (that is how a recovery re-plans); another job while one runs is refused as busy.

No message can break the service: every message is bounded where it arrives (the protocol's
models), every turn of the loop is guarded part by part (dispatch, each outgoing message, each of
the rank process's events, the capabilities refresh), at most `requests.MAX_PENDING_WORK`
inspections and profiles wait for the worker thread (more are answered "busy"), a repeated request
id is done once, a job's directory is `state_dir/jobs/<job id>` with the id checked as one plain path
component, and an owner's paths are confined (`jobcheck.confined_spec`: inside `allowed_dirs`,
an export that overwrites neither the base model nor the node's job directories). No request can
take the box down: a profile or an assignment over its cores or memory is refused with the numbers
(`node/agent/boxcheck.py`); every child runs boxed — memory and task limits, dying with the node
(`node/box/limits.py`); a stop takes seconds at any point, a cancel does not hold the loop.
"""

from __future__ import annotations

import math
import os
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Any

import structlog

from xronos.common import sdnotify
from xronos.node.agent import jobdirs, participation
from xronos.node.agent.boxcheck import Box, assignment_problem_on_box, owner_arch, resident_bytes
from xronos.node.agent.catalog import CatalogPublisher
from xronos.node.agent.config import NodeConfig, detect_data_host, job_dir
from xronos.node.agent.jobcheck import assignment_problem, reshard_problem
from xronos.node.agent.owncaps import OwnCapabilities
from xronos.node.agent.rankstatus import status_update
from xronos.node.agent.requests import WorkerRequests
from xronos.node.box import limits
from xronos.node.rank import messages as msg
from xronos.node.rank.messages import order_for
from xronos.protocol import hastate
from xronos.protocol import messages as m
from xronos.protocol.dispatch import Dispatcher
from xronos.protocol.ownavail import OwnAvailability
from xronos.protocol.topics import TopicTable
from xronos.protocol.transport import BusBase, MqttBus

log = structlog.get_logger(__name__)
CAPS_EVERY_S = 60.0  # refresh memory_available and temperature for the planner and HA
STOP_GRACE_S = 1.0  # a rank's time to stop at its iteration boundary when the node stops


class NodeService:
    def __init__(self, cfg: NodeConfig, bus: BusBase | None = None, data_host: str | None = None) -> None:
        self.cfg, self.node_id = cfg, cfg.node_id
        self.table = TopicTable(cfg.base_topic)
        self.data_host = data_host or detect_data_host(cfg)
        will = (self.table.build("node.availability", node_id=self.node_id), "offline", True)
        # A random part, so that the client id cannot be guessed (see the gateway).
        self.bus = bus or MqttBus(cfg.broker, f"node-{self.node_id}-{os.urandom(4).hex()}", will=will,
                                  table=self.table)
        self.dispatcher = Dispatcher(self.bus, node_id=self.node_id)
        self.availability = OwnAvailability(
            self.bus, "node.availability", node_id=self.node_id, event="node.availability_offline_while_running",
            hint="another process with this node_id (a copied node.toml?) ran and stopped, or an 'offline' "
                 "was published by hand: every box needs its own node_id; 'online' published again")
        self.owncaps = OwnCapabilities(self.bus, self.node_id)  # another box under this id (node/agent/owncaps.py)
        self.participate = participation.load(cfg.state_dir, cfg.participate)  # HA's last choice wins
        self.outbox: queue.Queue[Any] = queue.Queue()  # messages the worker thread wants published
        self.assignment: m.Assignment | None = None
        self.spec: m.JobSpec | None = None  # the assignment's spec, owner paths confined
        self.child: Any = None  # node/rank/process.py's RankProcess
        self.status: m.NodeJobStatus | None = None
        self.last_shares: tuple[float, float] | None = None
        self.internal_errors = 0  # unexpected exceptions caught by a guard (each logged)
        self.stopping = threading.Event()
        self.state_dir = Path(cfg.state_dir)
        self._caps_at = 0.0
        self._ha_published: hastate.NodeHAState | None = None
        # What allowed_dirs holds, for Home Assistant's job form (node/agent/catalog.py).
        self.catalog = CatalogPublisher(self.bus, self.node_id, cfg.allowed_dirs, skip=self._reserved_dirs())
        # Inspections and profiles, on the worker thread (node/agent/requests.py).
        self.requests = WorkerRequests(cfg, self.bus, self.table, self.outbox, self._capabilities, self._threads,
                                       self._reserved_dirs())
        self.work = self.requests.work
        self._leaving: list[Any] = []  # RankProcesses told to stop, not yet gone (killed at a new start)

    # --- wiring --------------------------------------------------------------------------------
    def start(self) -> None:
        own = {"node_id": self.node_id}
        self.requests.register(self.dispatcher)
        self.dispatcher.on("node.assignment", self._on_assignment, **own)
        self.dispatcher.on("node.control", self._on_control, **own)
        self.dispatcher.on("node.set", self._on_ha_command, **own)  # Home Assistant's switch
        self.availability.register(self.dispatcher)
        self.owncaps.register(self.dispatcher)
        self.catalog.register(self.dispatcher)
        self.bus.on_connect(self._announce)
        limits.sweep(limits.group_bases())  # empty child groups a killed run of the node left
        self.bus.start()

    def _announce(self) -> None:
        """Runs after every (re)connect: the retained view of this node, afresh."""
        self.availability.announce()
        self.owncaps.connected()
        self._publish_caps()
        if self.status is not None:
            self.bus.publish_message(self.status, node_id=self.node_id)
        self._publish_ha(force=True)
        self.catalog.announce()

    def _capabilities(self) -> m.Capabilities:
        from xronos.node.box.capabilities import probe

        return probe(self.node_id, self.data_host, self.participate, self.cfg.reserve_mb)

    def _publish_caps(self) -> None:
        self._caps_at = time.monotonic()
        self.owncaps.publish(self._capabilities())

    def _publish_ha(self, force: bool = False) -> None:
        """node/<id>/state for Home Assistant, only when something but its timestamp changed."""
        from xronos.node.box.capabilities import cpu_temperature

        a = self.assignment if self.status and self.status.status in ("accepted", "running", "paused") else None
        compute, idle = self.last_shares or (None, None)
        share = hastate.node_share(a)
        temp = cpu_temperature()
        st = hastate.NodeHAState(
            participate=self.participate, job_id=a.job_id if a else None, **share,
            compute_pct=compute if a else None, idle_pct=idle if a else None,
            cpu_temp_c=round(temp, 1) if temp is not None and math.isfinite(temp) else None,
            updated_at=time.time())
        if not force and hastate.same_state(st, self._ha_published):
            return
        self.bus.publish_message(st, node_id=self.node_id)
        self._ha_published = st

    # --- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        self.start()
        watchdog = sdnotify.Watchdog.from_env()
        sdnotify.ready(f"node {self.node_id}")
        try:
            while not self.stopping.is_set():
                self.step(0.2)
                watchdog.maybe_ping()
        finally:
            sdnotify.stopping()
            self.shutdown()

    def step(self, timeout: float) -> None:
        """One turn of the control loop (tests drive it directly). Each part is guarded: nothing
        raises out of it."""
        item = self.bus.get(timeout)
        if item is not None:
            self.dispatcher.dispatch(*item, retain=getattr(item, "retain", False))  # never raises
        while True:
            try:
                msg = self.outbox.get_nowait()
            except queue.Empty:
                break
            try:
                self.bus.publish_message(msg, node_id=self.node_id)
            except Exception as exc:
                self._internal(f"publish {type(msg).__name__}", exc)
        try:
            self._pump_child()
        except Exception as exc:
            self._internal("rank process", exc)
        self.catalog.tick()  # guarded inside
        self._leaving = [c for c in self._leaving if c.poll() is None]
        try:
            self.owncaps.tick()
        except Exception as exc:
            self._internal("re-assert capabilities", exc)
        if time.monotonic() - self._caps_at > CAPS_EVERY_S:
            try:
                self._publish_caps()
                self._publish_ha()
            except Exception as exc:
                self._caps_at = time.monotonic()
                self._internal("publish capabilities", exc)

    def _internal(self, where: str, exc: BaseException) -> None:
        self.internal_errors += 1
        log.error("node.internal_error", where=where, error=f"{type(exc).__name__}: {exc}"[:300], exc_info=exc)

    def shutdown(self) -> None:
        """Seconds at any point: the rank gets STOP_GRACE_S (a checkpoint it writes is abandoned, the
        previous one stays whole), every other child (a profile, its heap probes) is killed at once."""
        self.requests.shutdown()
        if self.child is not None:
            self.child.kill(grace_s=STOP_GRACE_S)
            self._set_status("cancelled", detail="node service stopped")
        limits.LIVE.kill_all()
        self.availability.withdraw()
        self.bus.stop()

    # --- Home Assistant switch -----------------------------------------------------------------
    def _on_ha_command(self, cmd: hastate.NodeCommand, _params: dict[str, str]) -> None:
        """A bad payload is answered on node/<id>/error by the dispatcher."""
        self.participate = cmd.participate
        participation.save(self.state_dir, cmd.participate)
        log.info("participation switched", participate=self.participate)
        self._publish_caps()
        self._publish_ha()

    def _reserved_dirs(self) -> list[Path]:
        """Directories of this node's own that no export may overwrite."""
        return [self.state_dir / "jobs", self.state_dir / "profiles"]

    # --- the box's bounds (node/agent/boxcheck.py, node/box/limits.py) ----------------------------------
    def _assignment_bounds(self, a: m.Assignment, spec: m.JobSpec) -> str | None:
        """The rank's size against the box; the model's shape from the owner's checkpoint or from the
        job's profile request (a rank of a job this node has neither for is bounded by its limits alone)."""
        shape = (owner_arch(spec) if a.rank == 0 else None) or self.requests.shape(a.job_id)
        mine = self.child is not None and self.assignment is not None and self.assignment.job_id == a.job_id
        freed = resident_bytes(self.child.proc.pid) if mine else 0  # a re-plan's old rank makes way
        return assignment_problem_on_box(a, spec, shape, Box.now(self.cfg.reserve_mb), freed)

    def _threads(self) -> int:
        """Torch threads of this node's profiles and training ranks (the same, so the one predicts the other)."""
        return self.cfg.threads or max(os.cpu_count() or 1, 1)

    # --- assignment and control ----------------------------------------------------------------
    def _ack(self, a: m.Assignment, reason: str | None) -> None:
        self.bus.publish_message(m.AssignmentAck(job_id=a.job_id, plan_version=a.plan_version, node_id=self.node_id,
                                                 accepted=reason is None, reason=reason), node_id=self.node_id)

    def _on_assignment(self, a: m.Assignment, params: dict[str, str]) -> None:
        if a.node_id != self.node_id:  # a payload claiming another node: not ours to act on
            raise ValueError(f"assignment names node {a.node_id!r} but arrived on {params['node_id']!r}'s topic")
        cur = self.assignment
        if cur is not None and cur.job_id == a.job_id and cur.plan_version == a.plan_version:
            if self.child is None:  # not started: the repeat's group key is the one the others hold now
                self.assignment = a
            self._ack(a, None)  # a repeat (the gateway restarted while waiting for acks)
            return
        if cur is not None and cur.job_id == a.job_id and cur.plan_version > a.plan_version:
            raise ValueError(f"assignment v{a.plan_version} of {a.job_id} is older than v{cur.plan_version}")
        busy = self.child is not None and cur is not None and cur.job_id != a.job_id
        reason, spec = (f"busy with job {cur.job_id}", None) if busy and cur else self._check(a)
        if reason is None:
            if self.child is not None:  # the same job re-planned: the old rank makes way
                self._leaving.append(self.child)
                self.child.stop()
                self.child = None
            # the spec the rank is built from: only an accepted assignment's (a refused one's
            # would otherwise stand beside the assignment still held)
            self.assignment, self.spec = a, spec
            self._set_status("accepted", job=a, step=a.resume_step)
        log.info("assignment", job=a.job_id, version=a.plan_version, rank=a.rank, accepted=reason is None,
                 reason=reason)
        self._ack(a, reason)

    def _check(self, a: m.Assignment) -> tuple[str | None, m.JobSpec | None]:
        """(why this node cannot take the assignment, None) or (None, the spec its rank runs:
        the owner's with its paths confined to the allowed directories)."""
        if not self.participate:
            return "participation is switched off", None
        if a.rank == 0 and a.spec.owner != self.node_id:
            return f"rank 0 must be the owner {a.spec.owner!r}", None
        if a.rank != 0 and a.spec.owner == self.node_id:
            return "the owner must be rank 0", None
        try:
            job_dir(self.state_dir, a.job_id)
        except ValueError as exc:
            return str(exc), None
        spec = a.spec
        if a.rank == 0:
            from xronos.node.agent.jobcheck import confined_spec

            try:
                spec = confined_spec(a.spec, self.cfg.allowed_dirs, reserved=self._reserved_dirs())
            except ValueError as exc:
                return str(exc), None
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("", a.rendezvous_port))
                except OSError as exc:
                    return f"rendezvous port {a.rendezvous_port} is not free: {exc.strerror}", None
        # the layout, then the rank's size: refused before any rank starts
        reason = assignment_problem(a, spec) or self._assignment_bounds(a, spec)
        return reason, None if reason else spec

    def _on_control(self, c: Any, _params: dict[str, str]) -> None:
        a = self.assignment
        if a is None or a.job_id != c.job_id or a.plan_version != c.plan_version:
            if c.action == "cancel":
                return  # nothing of that plan runs here: already as asked
            raise ValueError(f"{c.action} for {c.job_id} v{c.plan_version}: no such assignment here")
        if c.action == "start":
            if self.child is None and self.status is not None and self.status.status == "accepted":
                self._start_child(a)  # once per assignment: a repeated start never re-runs a rank
        elif c.action == "cancel":
            if self.child is not None:  # stopped on a thread of its own: the loop goes on
                self._leaving.append(self.child)
                self.child.stop()
                self.child = None
            self._set_status("cancelled")
            self.assignment = None
        elif c.action == "reshard":
            if a.rank != 0:
                raise ValueError(f"reshard for {c.job_id} v{c.plan_version}: only the owner (rank 0) takes it, "
                                 f"this node is rank {a.rank}")
            reshard_problem(c, a)  # ValueError naming the field: refused here, nothing sent to the ranks
            if self.child is not None:  # the owner broadcasts it to every rank at the boundary
                self.child.send(order_for(c))
        elif self.child is not None:
            self.child.send(order_for(c))

    def _start_child(self, a: m.Assignment) -> None:
        from xronos.node.rank.process import RankProcess, child_env
        from xronos.node.runconfig import JobRankConfig, RunConfig

        assert self.spec is not None
        threads = self._threads()
        run = RunConfig.for_job(self.spec, layout=a.layout, rank=a.rank, host=a.rendezvous_host,
                                port=a.rendezvous_port, threads=threads, gloo_timeout_s=self.cfg.gloo_timeout_s,
                                group_key=a.group_key, shares=tuple(a.shares) if a.shares else None,
                                overlap=a.overlap, trial=a.trial)
        jobdir = job_dir(self.state_dir, a.job_id)
        config = JobRankConfig(job_id=a.job_id, plan_version=a.plan_version, node_id=self.node_id, run=run,
                               checkpoint_interval=self.spec.checkpoint_interval, resume_step=a.resume_step,
                               checkpoint_dir=str(jobdir / "checkpoint") if a.rank == 0 else None,
                               allowed_dirs=[str(d) for d in self.cfg.allowed_dirs])
        ifname = self.cfg.data_interface or ("lo" if a.rendezvous_host.startswith("127.") else None)
        for old in self._leaving:  # a rank still in its grace holds memory and ports the new one needs
            old.process.kill()
        gone = jobdirs.prune(jobdir.parent, a.job_id, a.plan_version)  # bounded: every assignment adds one
        if gone:
            log.info("old job directories removed", count=len(gone))
        self.child = RankProcess(jobdir / f"v{a.plan_version}", config, child_env(threads, ifname),
                                 limits=self.requests.child_limits())

    # --- child events --------------------------------------------------------------------------
    def _set_status(self, status: str, job: m.Assignment | None = None, **fields: Any) -> None:
        a = job or self.assignment
        if a is None:
            return
        keep = self.status.model_dump() if self.status and self.status.job_id == a.job_id and job is None else {}
        keep.update(node_id=self.node_id, job_id=a.job_id, plan_version=a.plan_version, rank=a.rank,
                    status=status, sent_at=time.time(), **fields)
        if status != "failed":
            keep.setdefault("detail", None)
        self.status = m.NodeJobStatus(**keep)
        self.bus.publish_message(self.status, node_id=self.node_id)
        self._publish_ha()

    def _pump_child(self) -> None:
        child, a = self.child, self.assignment
        if child is None or a is None:
            return
        for ev in child.drain():
            try:
                self._child_event(a, ev)
            except Exception as exc:  # one malformed event is logged, the next ones still count
                self._internal(f"rank process event {str(ev)[:100]}", exc)
        if child.finished():
            if self.status is None or self.status.status not in ("completed", "failed", "cancelled"):
                self._set_status("failed", detail=f"rank process ended ({child.why()}): {child.tail(600)}")
            child.kill(0)
            self.child = None
            if a.rank == 0 and self.status is not None and self.status.status == "completed":
                self._drop_checkpoints(a.job_id)

    def _drop_checkpoints(self, job_id: str) -> None:
        """The owner's checkpoints of a job it completed (its export is written): no resume point any
        more, and a model's weights with the optimizer's moments, twice, on this node's disk."""
        from xronos.node.rank.checkpoint import remove_checkpoints

        try:
            removed = remove_checkpoints(job_dir(self.state_dir, job_id) / "checkpoint")
        except OSError as exc:  # a disk problem is the operator's to see, not the job's to fail on
            log.warning("could not remove a completed job's checkpoints", job_id=job_id, error=str(exc))
            return
        if removed:
            log.info("completed job's checkpoints removed", job_id=job_id, paths=removed)

    def _child_event(self, a: m.Assignment, ev: msg.RankEvent) -> None:
        """One typed event of the rank as this node's job status (`rankstatus`) or metrics."""
        if isinstance(ev, msg.Metrics):
            self._metrics(a, ev)
            return
        update = status_update(a.job_id, ev, self.status.status if self.status else "running")
        if update is not None:
            self._set_status(update[0], **update[1])

    def _metrics(self, a: m.Assignment, ev: msg.Metrics) -> None:
        self.bus.publish_message(m.IterationMetrics(job_id=a.job_id, plan_version=a.plan_version, node_id=self.node_id,
                                                    rank=a.rank, **ev.numbers()), node_id=self.node_id)
        if ev.iteration_s > 0:
            self.last_shares = hastate.iteration_shares(ev.compute_s, ev.idle_s, ev.iteration_s)
        if self.status is not None:
            self.status = self.status.model_copy(update={"step": ev.step, "epoch": ev.epoch})

