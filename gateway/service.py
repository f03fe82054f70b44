"""The gateway service (`xronos gateway --config gateway.toml`): thin glue around the pure parts.

One control loop: bus messages become events of the job state machine (`jobs.handle`); the effects
it returns are carried out here (publish an inspection/profile request, run the planner, publish
assignments and controls, answer a request); every change is persisted (`store`) and published as
the job's retained JobState (and Home Assistant's state). Time is a `Tick` each turn of the loop.

Restart: the job table is reloaded, every unfinished job re-issues what it was waiting for, and
running jobs are re-attached, not restarted: their nodes keep training without the gateway, and
the retained NodeJobStatus and availability messages that arrive on subscribing tell it whether
they completed, failed or lost a node meanwhile (then it recovers from the last checkpoint).
"""

from __future__ import annotations

import json
import re
import time
import uuid
import zlib
from typing import Any

import structlog

from xronos.gateway import homeassistant as ha
from xronos.gateway import jobs as J
from xronos.gateway import registry as R
from xronos.gateway.config import GatewayConfig
from xronos.gateway.planner import InfeasiblePlan
from xronos.gateway.profiles import Loaded, plan_message, plan_reports
from xronos.gateway.progress import state_view
from xronos.gateway.store import JobStore
from xronos.protocol import sdnotify
from xronos.protocol import messages as m
from xronos.protocol.dispatch import DEFER, Dispatcher, RequestError
from xronos.protocol.topics import TopicTable
from xronos.protocol.transport import BusBase, MqttBus

log = structlog.get_logger(__name__)
STATE_EVERY_S = 0.5  # retained JobState at most this often while only metrics change
SAVE_EVERY_S = 5.0  # job table on disk at most this often while only metrics change
_CONTROLS = {"start": m.JobStart, "pause": m.JobPause, "resume": m.JobResume, "cancel": m.JobCancel}


class GatewayService:
    def __init__(self, cfg: GatewayConfig, bus: BusBase | None = None,
                 timeouts: J.Timeouts | None = None) -> None:
        self.cfg = cfg
        self.table = TopicTable(cfg.base_topic, cfg.homeassistant.discovery_prefix)
        will = (self.table.build("gateway.availability"), "offline", True)
        # A random part: on a broker without use_username_as_clientid nobody can guess the id and
        # knock the gateway off by connecting with it.
        self.bus = bus or MqttBus(cfg.broker, f"{cfg.gateway_id}-{uuid.uuid4().hex[:8]}", will=will, table=self.table)
        self.dispatcher = Dispatcher(self.bus)
        self.timeouts = timeouts or J.Timeouts(profile_s=cfg.profile_timeout_s, ack_s=cfg.ack_timeout_s)
        self.store = JobStore(cfg.state_dir)
        self.jobs: dict[str, J.Job] = self.store.load()
        self.previews: dict[str, J.Job] = {}
        self.reg: R.Registry = {}
        self.requests: dict[str, tuple[str, str]] = {}  # request id -> (job id, node id)
        self.ha = ha.HAContext(cfg.base_topic, cfg.gateway_id, cfg.homeassistant.discovery_prefix) \
            if cfg.homeassistant.enabled else None
        self.habridge = ha.HABridge(self.ha, self.bus, cfg.homeassistant.job_dir, ha.Actions(
            job_command=self._ha_job_command, start=self._ha_start, remove_node=self._remove_node,
            nodes=self._known_caps, publish=self._publish_ha_state)) if self.ha is not None else None
        self._state_ids: set[str] = set(self.jobs)  # jobs whose retained JobState we publish
        self._dirty: set[str] = set()
        self._saved_at = self._published_at = 0.0
        self.stopping = False

    # --- wiring --------------------------------------------------------------------------------
    def start(self) -> None:
        d = self.dispatcher
        for key, fn in (("node.availability", self._on_availability), ("node.capabilities", self._on_caps),
                        ("node.profile_report", self._on_profile), ("node.inspect_report", self._on_inspect),
                        ("node.ack", self._on_ack), ("node.metrics", self._on_metrics),
                        ("node.job", self._on_node_job), ("node.error", self._on_node_error)):
            d.on(key, fn)
        for name, fn in (("job/submit", self._req_submit), ("job/status", self._req_status),
                         ("job/pause", self._req_command), ("job/resume", self._req_command),
                         ("job/cancel", self._req_command), ("nodes/list", self._req_nodes),
                         ("plan/preview", self._req_preview)):
            d.on(f"gateway.request.{name}", fn)
        d.on("job.state", self._on_job_state)  # retained states of jobs this gateway no longer has
        if self.habridge is not None:
            self.habridge.register(d)
        self.bus.on_connect(self._announce)
        self.bus.start()
        for job_id, job in list(self.jobs.items()):
            self._run(job_id, J.restart(job, self._ctx(job_id)))

    def _announce(self) -> None:
        self.bus.publish(self.table.build("gateway.availability"), "online", retain=True)
        self._discovery()

    def _discovery(self) -> None:
        if self.habridge is not None:
            self.habridge.publish_discovery()

    def _known_caps(self) -> list[m.Capabilities]:
        return [m.Capabilities(**n.capabilities) for n in self.reg.values() if n.capabilities]

    def run(self) -> None:
        self.start()
        watchdog = sdnotify.Watchdog.from_env()
        sdnotify.ready("gateway")
        try:
            while not self.stopping:
                self.step(0.25)
                watchdog.maybe_ping()
        finally:
            sdnotify.stopping()
            self.shutdown()

    def step(self, timeout: float) -> None:
        item = self.bus.get(timeout)
        if item is not None:
            self.dispatcher.dispatch(*item)
        if self.habridge is not None:
            self.habridge.tick()
        for job_id, job in list(self.jobs.items()) + list(self.previews.items()):
            if job.phase not in J.TERMINAL:
                self._event(job_id, J.Tick())
        self._flush()

    def shutdown(self) -> None:
        self._flush(force=True)
        self.bus.publish(self.table.build("gateway.availability"), "offline", retain=True)
        self.bus.stop()

    # --- the state machine's glue --------------------------------------------------------------
    def _ctx(self, job_id: str) -> J.Ctx:
        busy = any(J.occupies(j) for k, j in self.jobs.items() if k != job_id)
        return J.Ctx(now=time.time(), online=R.usable(self.reg), timeouts=self.timeouts, busy=busy)

    def _job(self, job_id: str) -> J.Job | None:
        return self.jobs.get(job_id) or self.previews.get(job_id)

    def _event(self, job_id: str, event: J.Event) -> None:
        job = self._job(job_id)
        if job is not None:
            self._run(job_id, J.handle(job, event, self._ctx(job_id)))

    def _run(self, job_id: str, out: J.Out) -> None:
        job, effects = out
        old = self._job(job_id)
        (self.previews if job.respond_to == "plan/preview" else self.jobs)[job_id] = job
        if old is None or job != old:
            self._dirty.add(job_id)
            if old is None or (job.phase, job.plan_version, job.checkpoint_step) != \
                    (old.phase, old.plan_version, old.checkpoint_step):
                self._flush(force=True, only=job_id)
        for effect in effects:
            self._do(effect)
        if job.phase in J.TERMINAL and job.respond_to == "plan/preview":
            self.previews.pop(job_id, None)
        self.jobs, more = J.schedule(self.jobs, self._ctx(""))
        for effect in more:
            self._do(effect)

    def _flush(self, force: bool = False, only: str | None = None) -> None:
        now = time.monotonic()
        if force or now - self._published_at > STATE_EVERY_S:
            for job_id in ([only] if only else list(self._dirty)):
                job = self.jobs.get(job_id)
                if job is not None:
                    self.bus.publish_message(m.JobState(**state_view(job)), job_id=job_id)
                    self._state_ids.add(job_id)
                self._dirty.discard(job_id)
            self._published_at = now
            self._clear_pruned()
            self._publish_ha_state()
        if force or now - self._saved_at > SAVE_EVERY_S:
            self.store.save(self.jobs)
            self._saved_at = now

    # --- effects -------------------------------------------------------------------------------
    def _do(self, e: J.Effect) -> None:
        if isinstance(e, J.Respond):
            if self.habridge is not None and e.name == "job/submit" and not e.ok:
                self.habridge.refused(e.error)  # Home Assistant's "Last error" shows why
            self.bus.publish_message(m.GatewayResponse(status="ok" if e.ok else "error", data=e.data,
                                                       error=e.error, transaction=e.transaction), name=e.name)
        elif isinstance(e, J.Inspect):
            rid = self._request_id(e.job_id, e.node_id)
            spec = m.JobSpec(**self._job(e.job_id).spec)
            self.bus.publish_message(m.InspectRequest(request_id=rid, job_id=e.job_id, spec=spec), node_id=e.node_id)
        elif isinstance(e, J.Profile):
            job = self._job(e.job_id)
            for node in e.nodes:
                req = m.ProfileRequest(request_id=self._request_id(e.job_id, node), job_id=e.job_id,
                                       arch=m.ArchSpec(**job.arch), task=job.spec["task"],
                                       batch_size=job.spec["batch_size"], seq_len=job.spec["seq_len"],
                                       weight_decay=job.spec.get("weight_decay", 0.0),
                                       clip=job.spec.get("max_grad_norm", 1.0) is not None)
                self.bus.publish_message(req, node_id=node)
        elif isinstance(e, J.MakePlan):
            self._event(e.job_id, self._plan(e))
        elif isinstance(e, J.Assign):
            self._assign(e)
        elif isinstance(e, J.Control):
            for node in e.nodes:
                self.bus.publish_message(_CONTROLS[e.action](job_id=e.job_id, plan_version=e.plan_version),
                                         node_id=node)

    def _request_id(self, job_id: str, node_id: str) -> str:
        rid = uuid.uuid4().hex[:12]
        self.requests[rid] = (job_id, node_id)
        return rid

    def _plan(self, e: J.MakePlan) -> J.Planned:
        """Run the cost model and planner on the job's profiles with each node's current memory."""
        job = self._job(e.job_id)
        loaded = []
        for node in e.nodes:
            report = m.ProfileReport(**job.profiles[node])
            caps = self.reg.get(node) and self.reg[node].capabilities
            if caps:
                report = report.model_copy(update={"capabilities": m.Capabilities(**caps)})
            loaded.append(Loaded(source=f"node {node}", report=report))
        try:
            result = plan_reports(loaded, job.spec["strategy"], reserve_mb=job.spec["reserve_mb"],
                                  bandwidth_Bps=self.cfg.bandwidth_mbps * 1e6 / 8,
                                  latency_s=self.cfg.latency_ms / 1000)
        except (InfeasiblePlan, ValueError) as exc:
            return J.Planned(None, str(exc))
        if not result.feasible:
            over = ", ".join(f"{r.node_id} needs {r.predicted_memory / 2**20:.0f} MiB of {r.memory_cap / 2**20:.0f}"
                             for r in result.rows if r.over_cap)
            return J.Planned(None, f"the {result.strategy} plan exceeds memory caps: {over}")
        return J.Planned(plan_message(result, e.job_id, e.version).model_dump(mode="json"))

    def _assign(self, e: J.Assign) -> None:
        job = self.jobs[e.job_id]
        owner = self.reg.get(job.owner)
        host = (owner.capabilities or {}).get("data_host") if owner else None
        lo, hi = self.cfg.rendezvous_port_min, self.cfg.rendezvous_port_max
        port = lo + (zlib.crc32(e.job_id.encode()) + e.plan["version"]) % (hi - lo + 1)
        entries = e.plan["entries"]
        layout = m.Plan.model_validate(e.plan).layout()
        for x in entries:
            self.bus.publish_message(m.Assignment(
                job_id=e.job_id, plan_version=e.plan["version"], node_id=x["node_id"], rank=x["rank"],
                world_size=len(entries), rendezvous_host=host or "127.0.0.1", rendezvous_port=port, layout=layout,
                spec=m.JobSpec(**job.spec), resume_step=e.resume_step), node_id=x["node_id"])

    # --- node topics ---------------------------------------------------------------------------
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
        if change == "down":
            self._to_jobs(J.NodeDown(node))
        self._newly_usable(before)

    def _newly_usable(self, before: frozenset[str]) -> None:
        for node in sorted(R.usable(self.reg) - before):
            self._to_jobs(J.NodeUp(node))

    def _on_caps(self, msg: m.Capabilities, params: dict[str, str]) -> None:
        self._same_node(msg.node_id, params)
        before = R.usable(self.reg)
        known = msg.node_id in self.reg and self.reg[msg.node_id].capabilities is not None
        self.reg = R.on_capabilities(self.reg, msg.model_dump(mode="json"), time.time())
        if self.ha is not None and not known:
            topic, payload = ha.node_discovery(self.ha, msg)
            self.bus.publish(topic, json.dumps(payload), retain=True)
        self._newly_usable(before)

    def _on_profile(self, msg: m.ProfileReport, params: dict[str, str]) -> None:
        self._same_node(msg.node_id, params)
        if self.requests.pop(msg.request_id, None) is not None:
            self._event(msg.job_id, J.Profiled(msg.node_id, msg.model_dump(mode="json")))

    def _on_node_error(self, msg: m.ErrorResponse, params: dict[str, str]) -> None:
        log.warning("node reported an error", node=params["node_id"], code=msg.code, message=msg.message)
        if msg.code == "profile_failed":
            rid, _, text = msg.message.partition(": ")
            job_node = self.requests.pop(rid, None)
            if job_node is not None and job_node[1] == params["node_id"]:
                self._event(job_node[0], J.Profiled(job_node[1], None, text))

    def _on_inspect(self, msg: m.InspectReport, params: dict[str, str]) -> None:
        self._same_node(msg.node_id, params)
        if self.requests.pop(msg.request_id, None) is not None:
            self._event(msg.job_id, J.Inspected(msg.node_id, msg.ok, msg.arch and msg.arch.model_dump(mode="json"),
                                                msg.total_steps, msg.error))

    def _on_ack(self, msg: m.AssignmentAck, params: dict[str, str]) -> None:
        self._same_node(msg.node_id, params)
        self._event(msg.job_id, J.Acked(msg.node_id, msg.plan_version, msg.accepted, msg.reason))

    def _on_metrics(self, msg: m.IterationMetrics, params: dict[str, str]) -> None:
        self._same_node(msg.node_id, params)
        self._event(msg.job_id, J.Metrics(msg.model_dump(mode="json")))

    def _on_node_job(self, msg: m.NodeJobStatus, params: dict[str, str]) -> None:
        self._same_node(msg.node_id, params)
        self._event(msg.job_id, J.Status(msg.model_dump(mode="json")))

    # --- requests ------------------------------------------------------------------------------
    def _new_id(self, name: str) -> str:
        slug = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:40] or "job"
        return f"{slug}-{uuid.uuid4().hex[:6]}"

    def _req_submit(self, req: m.JobSubmitRequest, _p: dict[str, str]) -> Any:
        job_id = self._new_id(req.spec.name)
        self._run(job_id, J.new_job(job_id, req.spec.model_dump(mode="json"), req.transaction, self._ctx(job_id)))
        return DEFER

    def _req_preview(self, req: m.PlanPreviewRequest, _p: dict[str, str]) -> Any:
        job_id = "preview-" + self._new_id(req.spec.name)
        self._run(job_id, J.new_job(job_id, req.spec.model_dump(mode="json"), req.transaction,
                                    self._ctx(job_id), respond_to="plan/preview"))
        return DEFER

    def _req_status(self, req: m.JobStatusRequest, _p: dict[str, str]) -> Any:
        if req.job_id is None:
            recent = sorted(self.jobs.values(), key=lambda j: j.created_at)[-50:]
            return {"jobs": [_summary(j) for j in recent]}
        job = self.jobs.get(req.job_id)
        if job is None:
            raise RequestError(f"unknown job {req.job_id!r}")
        return {"job": m.JobState(**state_view(job)).model_dump(mode="json")}

    def _req_command(self, req: Any, params: dict[str, str]) -> Any:
        action = type(req).__name__.removeprefix("Job").removesuffix("Request").lower()
        if req.job_id not in self.jobs:
            raise RequestError(f"unknown job {req.job_id!r}")
        self._event(req.job_id, J.Command(action, req.transaction))
        return DEFER

    def _req_nodes(self, _req: m.NodesListRequest, _p: dict[str, str]) -> Any:
        return {"nodes": R.listing(self.reg)}

    # --- Home Assistant ------------------------------------------------------------------------
    def _current(self) -> J.Job | None:
        if not self.jobs:
            return None
        live = [j for j in self.jobs.values() if j.phase not in J.TERMINAL]
        return max(live or self.jobs.values(), key=lambda j: j.created_at)

    def _publish_ha_state(self) -> None:
        if self.habridge is None:
            return
        job = self._current()
        online = sum(1 for n in self.reg.values() if n.online)
        self.habridge.publish_state(m.JobState(**state_view(job)) if job else None,
                                    job.created_at if job else None, online)

    def _ha_job_command(self, action: str) -> str:
        job = self._current()
        if job is None or job.phase in J.TERMINAL:
            raise ValueError(f"no unfinished job to {action}")
        self._event(job.job_id, J.Command(action, None))
        return self.jobs[job.job_id].phase

    def _ha_start(self, spec: m.JobSpec, name: str) -> str:
        job_id = self._new_id(spec.name)
        log.info("job started from Home Assistant", spec=name, job=job_id)
        self._run(job_id, J.new_job(job_id, spec.model_dump(mode="json"), None, self._ctx(job_id)))
        return job_id

    def _remove_node(self, node_id: str) -> None:
        """Forget a retired node: its registry entry, its retained topics (or its capabilities
        would bring it back on the next start) and its Home Assistant device."""
        node = self.reg.get(node_id)
        if node is None:
            raise ValueError(f"unknown node {node_id!r}")
        if node.online:
            raise ValueError(f"node {node_id!r} is online: stop its service first")
        users = [j.job_id for j in self.jobs.values() if j.phase not in J.TERMINAL and node_id in _nodes_of(j)]
        if users:
            raise ValueError(f"node {node_id!r} is in unfinished job {users[0]}")
        self.reg = {k: v for k, v in self.reg.items() if k != node_id}
        for key in ("node.availability", "node.capabilities", "node.job", "node.ha_state"):
            self.bus.publish(self.table.build(key, node_id=node_id), b"", retain=True)
        if self.ha is not None:
            self.bus.publish(*ha.node_removal(self.ha, node_id), retain=True)
        log.info("node removed", node=node_id)

    def _on_job_state(self, _msg: m.JobState, params: dict[str, str]) -> None:
        """A retained state of a job this gateway does not have (pruned, or jobs.json replaced):
        clear it, or the CLI and Home Assistant would show it forever."""
        job_id = params["job_id"]
        if job_id not in self.jobs and job_id not in self.previews:
            self.bus.publish(self.table.build("job.state", job_id=job_id), b"", retain=True)

    def _clear_pruned(self) -> None:
        """Jobs dropped from the table since their state was published: clear that state."""
        for job_id in sorted(self._state_ids - set(self.jobs)):
            self.bus.publish(self.table.build("job.state", job_id=job_id), b"", retain=True)
            self._state_ids.discard(job_id)


def _nodes_of(job: J.Job) -> set[str]:
    entries = (job.plan or {}).get("entries") or []
    return {e.get("node_id") for e in entries if isinstance(e, dict)} | {job.owner}


def _summary(job: J.Job) -> dict[str, Any]:
    return {"job_id": job.job_id, "name": job.spec["name"], "phase": job.phase, "step": job.step,
            "total_steps": job.total_steps, "loss": job.loss, "error": job.error, "created_at": job.created_at}
