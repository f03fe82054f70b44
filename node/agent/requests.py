"""The gateway's inspection and profile requests, answered on the node's one worker thread.

The control loop (`node/agent/service.py`) must never block on them: an inspection reads the
owner's checkpoint and data, a profile trains a model's blocks for minutes. So they are queued on
one worker thread, at most `MAX_PENDING_WORK` at a time (more are answered "busy"), each request
id once; a profile over the box's cores or memory is refused with the numbers before it starts
(`node/agent/boxcheck.py`) and runs boxed in a child process (`node/measure/profilechild.py`).
Answers go into the service's outbox, which the loop publishes; a refusal at arrival is
published at once. The shape a job's profile named is kept (`shape`): an assignment of that job
is sized against the box with it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog

from xronos.node.agent.boxcheck import Box, profile_problem
from xronos.node.agent.config import NodeConfig
from xronos.node.box import limits
from xronos.protocol import messages as m
from xronos.protocol.dispatch import Dispatcher
from xronos.protocol.topics import TopicTable
from xronos.protocol.transport import BusBase

log = structlog.get_logger(__name__)
MAX_PENDING_WORK = 4  # inspections and profiles queued or running on the worker thread
RECENT_SHAPES = 64  # jobs whose profiled shape is kept for their assignments


class WorkerRequests:
    """Inspections and profiles of one node. `capabilities()` is the node's probe now, `threads()`
    its ranks' torch threads, `reserved` the directories of its own no export may overwrite."""

    def __init__(self, cfg: NodeConfig, bus: BusBase, table: TopicTable, outbox: queue.Queue[Any],
                 capabilities: Callable[[], m.Capabilities], threads: Callable[[], int],
                 reserved: list[Path]) -> None:
        self.cfg, self.node_id, self.bus, self.table, self.outbox = cfg, cfg.node_id, bus, table, outbox
        self.capabilities, self.threads, self.reserved = capabilities, threads, reserved
        self.work = ThreadPoolExecutor(1, thread_name_prefix="node-work")
        self._pending: set[str] = set()  # request ids queued or running on the worker thread
        self._pending_lock = threading.Lock()
        self._shapes: dict[str, tuple[m.ArchSpec, str]] = {}  # job id -> the shape its profile named

    def register(self, dispatcher: Dispatcher) -> None:
        dispatcher.on("node.profile_request", self._on_profile, node_id=self.node_id)
        dispatcher.on("node.inspect_request", self._on_inspect, node_id=self.node_id)
        self.work.submit(_warm_up)

    def shape(self, job_id: str) -> tuple[m.ArchSpec, str] | None:
        """The model's shape and task a profile request of `job_id` named (None: none seen)."""
        return self._shapes.get(job_id)

    def shutdown(self) -> None:
        self.work.shutdown(wait=False, cancel_futures=True)

    def child_limits(self) -> limits.ChildLimits:
        return Box.now(self.cfg.reserve_mb).child_limits()

    def _queue(self, request_id: str, fn: Any, req: Any) -> str | None:
        """Queue `fn(req)` on the worker thread once per request id; why not, if it cannot be."""
        with self._pending_lock:
            if request_id in self._pending:
                return "duplicate"
            if len(self._pending) >= MAX_PENDING_WORK:
                return f"busy: {len(self._pending)} inspections or profiles are already waiting"
            self._pending.add(request_id)

        def run() -> None:
            try:
                fn(req)
            finally:
                with self._pending_lock:
                    self._pending.discard(request_id)

        self.work.submit(run)
        return None

    # --- inspection ----------------------------------------------------------------------------
    def _on_inspect(self, req: m.InspectRequest, _params: dict[str, str]) -> None:
        why = self._queue(req.request_id, self._inspect, req)
        if why is not None and why != "duplicate":
            self.bus.publish_message(m.InspectReport(node_id=self.node_id, request_id=req.request_id,
                                                     job_id=req.job_id, ok=False, error=why), node_id=self.node_id)

    def _inspect(self, req: m.InspectRequest) -> None:
        from xronos.node.agent.jobcheck import inspect_job

        ids = {"node_id": self.node_id, "request_id": req.request_id, "job_id": req.job_id}
        try:
            if req.spec.owner != self.node_id:
                raise ValueError(f"spec.owner is {req.spec.owner!r}, not this node")
            found = inspect_job(req.spec, self.cfg.allowed_dirs, reserved=self.reserved)
            report = m.InspectReport(**ids, ok=True, arch=m.ArchSpec(**found.pop("arch")), **found)
        except Exception as exc:  # every failure is an answer, never a silent drop
            log.info("inspection refused", job=req.job_id, reason=str(exc))
            report = m.InspectReport(**ids, ok=False, error=f"{exc}"[:2000])
        self.outbox.put(report)

    # --- profile -------------------------------------------------------------------------------
    def _on_profile(self, req: m.ProfileRequest, _params: dict[str, str]) -> None:
        why = profile_problem(req, Box.now(self.cfg.reserve_mb))  # threads and memory, before it starts
        if why is not None:
            log.info("profile refused", job=req.job_id, reason=why)
            self._profile_failed(req, why)
            return
        if len(self._shapes) >= RECENT_SHAPES:
            self._shapes.pop(next(iter(self._shapes)))
        self._shapes[req.job_id] = (req.arch, req.key.task)  # what an assignment of that job is checked with
        why = self._queue(req.request_id, self._profile, req)
        if why is not None and why != "duplicate":
            self._profile_failed(req, why)

    def _profile_failed(self, req: m.ProfileRequest, why: str) -> None:
        topic = self.table.build("node.profile_request", node_id=self.node_id)
        self.outbox.put(m.ErrorResponse(code="profile_failed", message=f"{req.request_id}: {why}"[:2000], topic=topic))

    def _profile(self, req: m.ProfileRequest) -> None:
        from xronos.node.measure.profilechild import ProfileJob, profile_in_child
        from xronos.node.measure.profiler import config_for

        try:
            # In a child process: measured under the training ranks' allocator setting, and the
            # service does not keep a full-width block's memory afterwards (node/measure/profilechild.py).
            job = ProfileJob(config=config_for(arch=req.arch), key=req.key, threads=req.threads or self.threads(),
                             node_id=self.node_id, request_id=req.request_id, job_id=req.job_id,
                             capabilities=self.capabilities(), cache_dir=str(Path(self.cfg.state_dir) / "profiles"))
            report = profile_in_child(job, limits=self.child_limits())
        except Exception as exc:
            log.warning("profiling failed", job=req.job_id, reason=str(exc))
            self._profile_failed(req, str(exc))
            return
        self.outbox.put(report)


def _warm_up() -> None:
    """Import the heavy libraries on the worker thread at start, so that the first inspection
    (which the gateway times) does not pay for them. Profiles run in a child process."""
    import datasets  # noqa: F401
    import transformers  # noqa: F401

    import xronos.node.agent.jobcheck  # noqa: F401
