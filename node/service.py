"""The node agent (`xronos node --config node.toml`): announce, profile, inspect, train on assignment.

One control loop reads the bus and never blocks on work: inspections and profiles run on one
worker thread, training runs in a child process (`node.child`). Everything the node tells the
world goes out from this loop: retained availability (last-will `offline`) and capabilities,
re-published on every reconnect; profile reports; inspection reports; assignment acks; per-
iteration metrics; and the retained NodeJobStatus a restarted gateway reconciles from.

Assignments are two-phase: the node checks and acknowledges, and starts its rank only on the
gateway's `start`, once every rank has accepted. A newer plan version of the same job replaces the
running rank (that is how a recovery re-plans); another job while one runs is refused as busy.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog

from xronos.node.config import NodeConfig, detect_data_host
from xronos.node.jobcheck import assignment_problem
from xronos.protocol import hastate, sdnotify
from xronos.protocol import messages as m
from xronos.protocol.dispatch import Dispatcher
from xronos.protocol.topics import TopicTable
from xronos.protocol.transport import BusBase, MqttBus

log = structlog.get_logger(__name__)
CAPS_EVERY_S = 60.0  # refresh memory_available and temperature for the planner and HA


class NodeService:
    def __init__(self, cfg: NodeConfig, bus: BusBase | None = None, data_host: str | None = None) -> None:
        self.cfg, self.node_id = cfg, cfg.node_id
        self.table = TopicTable(cfg.base_topic)
        self.data_host = data_host or detect_data_host(cfg)
        will = (self.table.build("node.availability", node_id=self.node_id), "offline", True)
        self.bus = bus or MqttBus(cfg.broker, f"node-{self.node_id}", will=will, table=self.table)
        self.dispatcher = Dispatcher(self.bus, node_id=self.node_id)
        self.participate = cfg.participate
        self.work = ThreadPoolExecutor(1, thread_name_prefix="node-work")
        self.outbox: queue.Queue[Any] = queue.Queue()  # messages the worker thread wants published
        self.assignment: m.Assignment | None = None
        self.spec: dict[str, Any] | None = None  # the assignment's spec, owner paths confined
        self.child: Any = None  # RankProcess
        self.status: m.NodeJobStatus | None = None
        self.last_shares: tuple[float, float] | None = None
        self.stopping = threading.Event()
        self.state_dir = Path(cfg.state_dir)
        self._caps_at = 0.0
        self._set_topic = self.table.base + "/" + hastate.NODE_SET.format(node_id=self.node_id)

    # --- wiring --------------------------------------------------------------------------------
    def start(self) -> None:
        own = {"node_id": self.node_id}
        self.dispatcher.on("node.profile_request", self._on_profile, **own)
        self.dispatcher.on("node.inspect_request", self._on_inspect, **own)
        self.dispatcher.on("node.assignment", self._on_assignment, **own)
        self.dispatcher.on("node.control", self._on_control, **own)
        self.bus.subscribe(self._set_topic)
        self.bus.on_connect(self._announce)
        self.bus.start()
        self.work.submit(_warm_up)

    def _announce(self) -> None:
        """Runs after every (re)connect: the retained view of this node, afresh."""
        self.bus.publish(self.table.build("node.availability", node_id=self.node_id), "online", retain=True)
        self._publish_caps()
        if self.status is not None:
            self.bus.publish_message(self.status, node_id=self.node_id)
        self._publish_ha()

    def _publish_caps(self) -> None:
        from xronos.node.capabilities import probe

        self._caps_at = time.monotonic()
        self.bus.publish_message(probe(self.node_id, self.data_host, self.participate), node_id=self.node_id)

    def _publish_ha(self) -> None:
        from xronos.node.capabilities import cpu_temperature

        a = self.assignment if self.status and self.status.status in ("accepted", "running", "paused") else None
        compute, idle = self.last_shares or (None, None)
        st = hastate.NodeHAState(
            participate=self.participate, job_id=a.job_id if a else None, units=a.layout.attn[a.rank] if a else None,
            units_total=sum(a.layout.attn) if a else None,
            ratio_pct=100.0 * a.layout.share("attn", a.rank) if a else None,
            compute_pct=compute if a else None, idle_pct=idle if a else None,
            cpu_temp_c=cpu_temperature(), updated_at=time.time())
        topic = self.table.base + "/" + hastate.NODE_STATE.format(node_id=self.node_id)
        self.bus.publish(topic, st.model_dump_json(), retain=True)

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
        """One turn of the control loop (tests drive it directly)."""
        item = self.bus.get(timeout)
        if item is not None:
            topic, payload = item
            if topic == self._set_topic:
                self._on_ha_command(payload)
            else:
                self.dispatcher.dispatch(topic, payload)
        while True:
            try:
                msg = self.outbox.get_nowait()
            except queue.Empty:
                break
            self.bus.publish_message(msg, node_id=self.node_id)
        self._pump_child()
        if time.monotonic() - self._caps_at > CAPS_EVERY_S:
            self._publish_caps()
            self._publish_ha()

    def shutdown(self) -> None:
        if self.child is not None:
            self.child.kill(grace_s=1.0)
            self._set_status("cancelled", detail="node service stopped")
        self.work.shutdown(wait=False, cancel_futures=True)
        self.bus.publish(self.table.build("node.availability", node_id=self.node_id), "offline", retain=True)
        self.bus.stop()

    # --- Home Assistant switch -----------------------------------------------------------------
    def _on_ha_command(self, payload: bytes) -> None:
        try:
            cmd = hastate.parse_command(hastate.NodeCommand, payload, self._set_topic)
        except ValueError as exc:
            log.warning("bad Home Assistant command", detail=str(exc))
            self.bus.publish_message(m.ErrorResponse(code="invalid", message=str(exc)[:2000], topic=self._set_topic),
                                     node_id=self.node_id)
            return
        self.participate = cmd.participate
        log.info("participation switched", participate=self.participate)
        self._publish_caps()
        self._publish_ha()

    # --- inspection and profiling (worker thread) ----------------------------------------------
    def _on_inspect(self, req: m.InspectRequest, _params: dict[str, str]) -> None:
        self.work.submit(self._inspect, req)

    def _inspect(self, req: m.InspectRequest) -> None:
        from xronos.node.jobcheck import inspect_job

        ids = {"node_id": self.node_id, "request_id": req.request_id, "job_id": req.job_id}
        try:
            if req.spec.owner != self.node_id:
                raise ValueError(f"spec.owner is {req.spec.owner!r}, not this node")
            found = inspect_job(req.spec, self.cfg.allowed_dirs)
            report = m.InspectReport(**ids, ok=True, arch=m.ArchSpec(**found.pop("arch")), **found)
        except Exception as exc:  # every failure is an answer, never a silent drop
            log.info("inspection refused", job=req.job_id, reason=str(exc))
            report = m.InspectReport(**ids, ok=False, error=f"{exc}"[:2000])
        self.outbox.put(report)

    def _on_profile(self, req: m.ProfileRequest, _params: dict[str, str]) -> None:
        self.work.submit(self._profile, req)

    def _profile(self, req: m.ProfileRequest) -> None:
        from xronos.node.capabilities import probe
        from xronos.node.profilechild import ProfileJob, profile_in_child
        from xronos.node.profiler import config_for

        try:
            # In a child process: measured under the training ranks' allocator setting, and the
            # service does not keep a full-width block's memory afterwards (node/profilechild.py).
            job = ProfileJob(config=config_for(arch=req.arch), task=req.task, batch_size=req.batch_size,
                             seq_len=req.seq_len, threads=req.threads or self._threads(),
                             weight_decay=req.weight_decay, clip=req.clip, node_id=self.node_id,
                             request_id=req.request_id, job_id=req.job_id,
                             capabilities=probe(self.node_id, self.data_host, self.participate),
                             cache_dir=str(self.state_dir / "profiles"))
            report = profile_in_child(job)
        except Exception as exc:
            log.warning("profiling failed", job=req.job_id, reason=str(exc))
            topic = self.table.build("node.profile_request", node_id=self.node_id)
            self.outbox.put(m.ErrorResponse(code="profile_failed", message=f"{req.request_id}: {exc}"[:2000],
                                            topic=topic))
            return
        self.outbox.put(report)

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
            self._ack(a, None)  # a repeat (the gateway restarted while waiting for acks)
            return
        if cur is not None and cur.job_id == a.job_id and cur.plan_version > a.plan_version:
            raise ValueError(f"assignment v{a.plan_version} of {a.job_id} is older than v{cur.plan_version}")
        busy = self.child is not None and cur is not None and cur.job_id != a.job_id
        reason = f"busy with job {cur.job_id}" if busy and cur else self._check(a)
        if reason is None:
            if self.child is not None:  # the same job re-planned: the old rank makes way
                self.child.kill()
                self.child = None
            self.assignment = a
            self._set_status("accepted", job=a, step=a.resume_step)
        log.info("assignment", job=a.job_id, version=a.plan_version, rank=a.rank, accepted=reason is None,
                 reason=reason)
        self._ack(a, reason)

    def _check(self, a: m.Assignment) -> str | None:
        """Why this node cannot take the assignment, or None."""
        if not self.participate:
            return "participation is switched off"
        if a.rank == 0 and a.spec.owner != self.node_id:
            return f"rank 0 must be the owner {a.spec.owner!r}"
        if a.rank != 0 and a.spec.owner == self.node_id:
            return "the owner must be rank 0"
        if a.rank == 0:
            from xronos.node.jobcheck import confined_spec

            try:
                self.spec = confined_spec(a.spec, self.cfg.allowed_dirs)
            except ValueError as exc:
                return str(exc)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("", a.rendezvous_port))
                except OSError as exc:
                    return f"rendezvous port {a.rendezvous_port} is not free: {exc.strerror}"
        else:
            self.spec = a.spec.model_dump(mode="json")
        return assignment_problem(a, self.spec)  # the layout: refused before any rank starts

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
            if self.child is not None:
                self.child.kill()
                self.child = None
            self._set_status("cancelled")
            self.assignment = None
        elif self.child is not None:
            self.child.send(c.action)

    def _start_child(self, a: m.Assignment) -> None:
        from xronos.node.child import RankProcess, child_env
        from xronos.node.jobproc import spec_run_config

        assert self.spec is not None
        threads = self._threads()
        run = spec_run_config(self.spec, layout=a.layout, rank=a.rank, host=a.rendezvous_host,
                              port=a.rendezvous_port, threads=threads, gloo_timeout_s=self.cfg.gloo_timeout_s)
        jobdir = self.state_dir / "jobs" / a.job_id
        config = {"job_id": a.job_id, "plan_version": a.plan_version, "node_id": self.node_id,
                  "spec": self.spec, "run": run.model_dump(mode="json"), "resume_step": a.resume_step,
                  "checkpoint_dir": str(jobdir / "checkpoint") if a.rank == 0 else None}
        ifname = self.cfg.data_interface or ("lo" if a.rendezvous_host.startswith("127.") else None)
        self.child = RankProcess(jobdir / f"v{a.plan_version}", config, child_env(threads, ifname))

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
            kind = ev.pop("type")
            if kind == "metrics":
                self._metrics(a, ev)
            elif kind == "status":
                self._set_status(ev["status"])
            elif kind == "eval":
                key = "eval_initial" if ev["when"] == "before" else "eval_metric"
                self._set_status(self.status.status if self.status else "running",
                                 **{key: ev["metric"], "eval_metric_name": ev["name"]})
            elif kind == "checkpoint":
                self._set_status("running", checkpoint_step=ev["step"], step=ev["step"])
            elif kind == "completed":
                self._set_status("completed", step=ev["step"], epoch=ev["epoch"], export_dir=ev["export_dir"])
            elif kind in ("failed", "cancelled"):
                self._set_status(kind, detail=ev.get("detail"))
        if child.finished():
            code = child.poll()
            if self.status is None or self.status.status not in ("completed", "failed", "cancelled"):
                self._set_status("failed", detail=f"rank process exited with code {code}: {child.tail(600)}")
            child.kill(0)
            self.child = None

    def _metrics(self, a: m.Assignment, ev: dict[str, Any]) -> None:
        self.bus.publish_message(m.IterationMetrics(job_id=a.job_id, plan_version=a.plan_version,
                                                    node_id=self.node_id, rank=a.rank, **ev), node_id=self.node_id)
        if ev["iteration_s"] > 0:
            self.last_shares = hastate.iteration_shares(ev["compute_s"], ev["idle_s"], ev["iteration_s"])
        if self.status is not None:
            self.status = self.status.model_copy(update={"step": ev["step"], "epoch": ev["epoch"]})


def _warm_up() -> None:
    """Import the heavy libraries on the worker thread at start, so that the first inspection
    (which the gateway times) does not pay for them. Profiles run in a child process."""
    import datasets  # noqa: F401
    import transformers  # noqa: F401

    import xronos.node.jobcheck  # noqa: F401
