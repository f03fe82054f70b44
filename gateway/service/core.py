"""The gateway service (`xronos gateway --config gateway.toml`): thin glue around the pure parts.

One control loop: bus messages become events of the job state machine (`job.machine.handle`, which also
plans); the effects it returns are carried out here, as the messages `effects` makes of them (an
inspection or profile request, assignments, controls, a re-shard order, a request's answer);
every change is persisted (`store`) and published as the job's retained JobState (and Home
Assistant's state). Time is a `Tick` each turn of the loop. The handlers of the nodes' topics are
in `nodetopics` (a mixin of the service).

No message can break the service: every turn of the loop is guarded part by part (the message's
dispatch, each job's tick, each effect, each publish, the save), and an unexpected error in one
job's handling fails that job alone, with a short reason, while the service carries on. Submits
refused at check time are answered and not kept; finished jobs are pruned from the history
(`history_max_jobs`, `history_max_age_days`); at most `max_unfinished_jobs` are checked or wait at
a time.

Restart: the job table is reloaded, every unfinished job re-issues what it was waiting for, and
running jobs are re-attached, not restarted: their nodes keep training without the gateway, and
the retained NodeJobStatus and availability messages that arrive on subscribing tell it whether
they completed, failed or lost a node meanwhile (then it recovers from the last checkpoint).
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import replace
from typing import Any

import structlog

from xronos.common import sdnotify
from xronos.gateway import registry as R
from xronos.gateway.config import GatewayConfig
from xronos.gateway.homeassistant import discovery as ha
from xronos.gateway.homeassistant.bridge import Actions, HABridge, Refused
from xronos.gateway.job import machine as J
from xronos.gateway.job.effects import messages as effect_messages
from xronos.gateway.job.offline import OfflineGrace
from xronos.gateway.job.planning import plan_job
from xronos.gateway.job.progress import state_view
from xronos.gateway.job.rebalancers import Rebalancers
from xronos.gateway.job.store import JobStore
from xronos.gateway.job.views import current, milestone, nodes_of, summary
from xronos.gateway.nodetopics import NodeTopics
from xronos.gateway.plan.rebalance import PolicyConfig
from xronos.protocol import messages as m
from xronos.protocol.dispatch import DEFER, Dispatcher, RequestError
from xronos.protocol.ownavail import OwnAvailability
from xronos.protocol.topics import TopicTable
from xronos.protocol.transport import BusBase, MqttBus

log = structlog.get_logger(__name__)
STATE_EVERY_S = 0.5  # retained JobState at most this often while only metrics change
SAVE_EVERY_S = 5.0  # job table on disk at most this often while only metrics change


def _reason(what: str, exc: BaseException) -> str:
    return f"internal error {what}: {type(exc).__name__}: {exc}"[:300]


class GatewayService(NodeTopics):
    def __init__(self, cfg: GatewayConfig, bus: BusBase | None = None,
                 timeouts: J.Timeouts | None = None, policy: PolicyConfig | None = None) -> None:
        self.cfg = cfg
        # Live re-balancing: per running job, its plan version's policy (None: it could not start).
        self.policy = policy or PolicyConfig()
        # A node that joins a running job (`job.join`): the bar is the live policy's unless configured.
        self.join = J.JoinPolicy(min_gain=self.policy.threshold if cfg.join_min_gain is None else cfg.join_min_gain,
                                 restart_s=cfg.join_restart_s)
        self.rebal = Rebalancers(self.policy)
        self.table = TopicTable(cfg.base_topic, cfg.homeassistant.discovery_prefix)
        will = (self.table.build("gateway.availability"), "offline", True)
        # A random part: on a broker without use_username_as_clientid nobody can guess the id and
        # knock the gateway off by connecting with it.
        self.bus = bus or MqttBus(cfg.broker, f"{cfg.gateway_id}-{uuid.uuid4().hex[:8]}", will=will, table=self.table)
        self.dispatcher = Dispatcher(self.bus)
        self.availability = OwnAvailability(
            self.bus, "gateway.availability", event="gateway.availability_offline_while_running",
            hint=f"another gateway on base topic {cfg.base_topic!r} ran and stopped, or an 'offline' was "
                 "published by hand: run one gateway per base topic; 'online' published again")
        self.timeouts = timeouts or J.Timeouts(profile_s=cfg.profile_timeout_s, ack_s=cfg.ack_timeout_s)
        self.net = J.Net(bandwidth_Bps=cfg.bandwidth_mbps * 1e6 / 8, latency_s=cfg.latency_ms / 1000)
        self.store = JobStore(cfg.state_dir)
        self.jobs: dict[str, J.Job] = self.store.load()
        self.previews: dict[str, J.Job] = {}
        self.reg: R.Registry = {}
        # After a reconnect the nodes get a reconnect back-off and a keepalive to say "online" again.
        self.offline = OfflineGrace(short_s=cfg.offline_grace_s,
                                    settle_s=float(cfg.broker.reconnect_max_s + cfg.broker.keepalive)) \
            if cfg.offline_grace_s > 0 else None
        self._connected_at: float | None = None  # set by the connect hook (network thread)
        self._connect_seen: float | None = None  # the latest connect the control loop has handled
        self._seen_disconnected = False
        self.ha = ha.HAContext(cfg.base_topic, cfg.gateway_id, cfg.homeassistant.discovery_prefix) \
            if cfg.homeassistant.enabled else None
        self.habridge = HABridge(self.ha, self.bus, cfg.homeassistant.job_dir, Actions(
            job_command=self._ha_job_command, start=self._ha_start, remove_node=self._remove_node,
            nodes=self._known_caps, publish=self._publish_ha_state),
            form_file=cfg.state_dir / "homeassistant-form.json") if self.ha is not None else None
        self.internal_errors = 0  # unexpected exceptions caught by a guard (each logged with its traceback)
        self._dirty: set[str] = set()
        self._unsaved = False
        self._saved_at = self._published_at = 0.0
        self.stopping = False

    # --- wiring --------------------------------------------------------------------------------
    def start(self) -> None:
        d = self.dispatcher
        for key, fn in (("node.availability", self._on_availability), ("node.capabilities", self._on_caps),
                        ("node.profile_report", self._on_profile), ("node.inspect_report", self._on_inspect),
                        ("node.ack", self._on_ack), ("node.metrics", self._on_metrics),
                        ("node.job", self._on_node_job), ("node.error", self._on_node_error)):
            d.on(key, fn, on_refused=self._profile_refused if key == "node.profile_report" else None,
                 on_cleared=self._availability_cleared if key == "node.availability" else None)
        for name, fn in (("job/submit", self._req_submit), ("job/status", self._req_status),
                         ("job/pause", self._req_command), ("job/resume", self._req_command),
                         ("job/cancel", self._req_command), ("nodes/list", self._req_nodes),
                         ("plan/preview", self._req_preview)):
            d.on(f"gateway.request.{name}", fn)
        # retained states of jobs this gateway no longer has, and unreadable ones (garbage, another schema version)
        d.on("job.state", self._on_job_state, on_refused=self._job_state_refused)
        self.availability.register(d)  # Home Assistant's entities follow it
        if self.habridge is not None:
            self.habridge.register(d)
        self.bus.on_connect(self._announce)
        self.bus.start()
        for job_id, job in list(self.jobs.items()):  # each job's restart alone: one bad job fails alone
            try:
                out = J.restart(job, self._ctx(job_id))
            except Exception as exc:
                self._internal("restart", job_id, exc)
                out = J.abort(job, self._ctx(job_id), _reason("on restart", exc))
            self._run(job_id, out)

    def _announce(self) -> None:
        self._connected_at = time.monotonic()  # read by the control loop (`step`)
        self.availability.announce()
        self._discovery()

    def _discovery(self) -> None:
        if self.habridge is not None:
            self.habridge.publish_discovery()

    def _known_caps(self) -> list[m.Capabilities]:
        return [n.capabilities for n in self.reg.values() if n.capabilities]

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
        """One turn of the control loop. Each part is guarded: nothing raises out of it."""
        self.dispatcher.run_once(timeout)  # never raises
        try:
            if self._reconnected():
                self._after_connect()
        except Exception as exc:
            self._internal("reconnect", None, exc)
        try:
            self._offline_due()
        except Exception as exc:
            self._internal("offline nodes", None, exc)
        if self.habridge is not None:
            try:
                self.habridge.tick()
            except Exception as exc:
                self._internal("Home Assistant", None, exc)
        for job_id, job in list(self.jobs.items()) + list(self.previews.items()):
            if job.phase not in J.TERMINAL:
                self._event(job_id, J.Tick())
        try:
            self._flush()
        except Exception as exc:
            self._internal("flush", None, exc)

    def _reconnected(self) -> bool:
        """Whether the bus (re)connected since the last turn: this loop saw it down, or the connect
        hook ran since. Both signs, because the bus says "connected" a moment before its hook runs
        (so one reconnect may count twice: what follows it is idempotent)."""
        if not self.bus.connected:
            self._seen_disconnected = True
            return False
        if self._seen_disconnected or self._connected_at != self._connect_seen:
            self._seen_disconnected, self._connect_seen = False, self._connected_at
            return True
        return False

    def _after_connect(self) -> None:
        """The nodes get their settle time from now (gateway/job/offline.py). And every job's retained
        state and Home Assistant's gateway state go out again, as the connect hook does for
        availability and discovery: a broker restarted without persistence (Mosquitto's default)
        has forgotten them, and a finished job's state would never change again to bring them back
        (the CLI and Home Assistant would show nothing for it)."""
        if self.offline is not None:
            self.offline.reconnected(time.monotonic())
        self._dirty.update(job_id for job_id, job in self.jobs.items() if job.accepted)
        if self.habridge is not None:
            self.habridge.forget_published()
        self._flush(force=True)

    def shutdown(self) -> None:
        try:
            self._flush(force=True)
        except Exception as exc:
            self._internal("flush", None, exc)
        self.availability.withdraw()
        self.bus.stop()

    def _internal(self, where: str, job_id: str | None, exc: BaseException) -> None:
        self.internal_errors += 1
        log.error("gateway.internal_error", where=where, job=job_id, error=f"{type(exc).__name__}: {exc}"[:300],
                  exc_info=exc)

    # --- the state machine's glue --------------------------------------------------------------
    def _ctx(self, job_id: str) -> J.Ctx:
        busy = any(J.occupies(j) for k, j in self.jobs.items() if k != job_id)
        return J.Ctx(now=time.time(), online=R.usable(self.reg), timeouts=self.timeouts, busy=busy,
                     caps=R.capabilities(self.reg), net=self.net, planner=plan_job, join=self.join)

    def _job(self, job_id: str) -> J.Job | None:
        return self.jobs.get(job_id) or self.previews.get(job_id)

    def _event(self, job_id: str, event: J.Event) -> None:
        job = self._job(job_id)
        if job is None:
            return
        try:
            out = J.handle(job, event, self._ctx(job_id))
        except Exception as exc:  # this job's transition broke: it fails alone
            self._internal(type(event).__name__, job_id, exc)
            self._abort(job_id, _reason(f"handling {type(event).__name__}", exc))
            return
        self._run(job_id, out)

    def _abort(self, job_id: str, reason: str) -> None:
        job = self._job(job_id)
        if job is None or job.phase in J.TERMINAL:
            return
        try:
            out = J.abort(job, self._ctx(job_id), reason)
        except Exception as exc:  # even failing it failed: mark it failed without effects
            self._internal("abort", job_id, exc)
            out = replace(job, phase="failed", error=reason, transaction=None, awaiting="", deadline=None,
                          recover_deadline=None), []
        self._run(job_id, out)

    def _run(self, job_id: str, out: J.Out) -> None:
        job, effects = out
        job = J.finished(job)
        old = self._job(job_id)
        stored = job_id in self.jobs  # in the table on disk (saved when it was created)
        (self.previews if job.respond_to == "plan/preview" else self.jobs)[job_id] = job
        if J.refused(job) or (job.phase in J.TERMINAL and job.respond_to == "plan/preview"):
            # Answered and done: a refused submit or a preview is not kept (nor its state retained).
            self.jobs.pop(job_id, None)
            self.previews.pop(job_id, None)
            self._dirty.discard(job_id)
            if old is not None and old.accepted:
                self._clear_state(job_id)
            if stored:  # off the disk at once too: a restart must not bring a refused submit back to run
                self._unsaved = True
                self._flush(force=True, only=job_id)
        elif old is None or job != old:
            self._dirty.add(job_id)
            self._unsaved = True
            if old is None or milestone(job) != milestone(old):
                self._flush(force=True, only=job_id)
        for effect in effects:
            self._effect(job_id, effect)
        try:
            self.jobs, more = J.schedule(self.jobs, self._ctx(""))
        except Exception as exc:
            self._internal("schedule", None, exc)
            return
        for effect in more:
            self._effect(getattr(effect, "job_id", ""), effect)

    def _effect(self, job_id: str, effect: J.Effect) -> None:
        try:
            self._do(effect)
        except Exception as exc:  # e.g. a message that cannot be encoded: the job fails alone
            self._internal(type(effect).__name__, job_id, exc)
            if job_id:
                self._abort(job_id, _reason(f"carrying out {type(effect).__name__}", exc))

    def _flush(self, force: bool = False, only: str | None = None) -> None:
        now = time.monotonic()
        if force or now - self._published_at > STATE_EVERY_S:
            for job_id in ([only] if only else sorted(self._dirty)):
                self._dirty.discard(job_id)
                job = self.jobs.get(job_id)
                if job is None or not job.accepted:  # only accepted jobs have a retained state
                    continue
                try:
                    self.bus.publish_message(state_view(job), job_id=job_id)
                except Exception as exc:
                    self._internal("publish JobState", job_id, exc)
                    self._abort(job_id, _reason("publishing its state", exc))
            self._published_at = now
            try:
                self._publish_ha_state()
            except Exception as exc:
                self._internal("publish Home Assistant state", None, exc)
        if (force or now - self._saved_at > SAVE_EVERY_S) and self._unsaved:
            self._prune()
            try:
                self.store.save(self.jobs)
            except (OSError, ValueError, TypeError) as exc:  # a full disk must not stop the service
                self._internal("save", None, exc)
            else:
                self._unsaved = False
            self._saved_at = now

    def _prune(self) -> None:
        self.jobs, dropped = J.prune(self.jobs, time.time(), self.cfg.history_max_jobs,
                                     self.cfg.history_max_age_days * 86400)
        for job_id in dropped:
            log.info("job pruned from the history", job=job_id)
            self._clear_state(job_id)

    def _clear_state(self, job_id: str) -> None:
        try:
            self.bus.publish(self.table.build("job.state", job_id=job_id), b"", retain=True)
        except Exception as exc:
            self._internal("clear JobState", job_id, exc)

    # --- effects -------------------------------------------------------------------------------
    def _do(self, e: J.Effect) -> None:
        if isinstance(e, J.Respond) and self.habridge is not None and e.name == "job/submit":
            if not e.ok:
                self.habridge.refused(e.error)  # Home Assistant's "Last error" shows why
            self.habridge.answered((e.data or {}).get("job_id"), e.ok, e.error)  # and Last command
        job = self._job(e.job_id) if not isinstance(e, J.Respond) else None
        ports = (self.cfg.rendezvous_port_min, self.cfg.rendezvous_port_max)
        for msg, params in effect_messages(e, job, self.reg, ports):
            self.bus.publish_message(msg, **params)

    # --- requests ------------------------------------------------------------------------------
    def _new_id(self, name: str) -> str:
        slug = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:40] or "job"
        while True:  # 24 random bits: rare, but a collision would replace a job (maybe a running one)
            job_id = f"{slug}-{uuid.uuid4().hex[:6]}"
            if job_id not in self.jobs and f"preview-{job_id}" not in self.previews:
                return job_id

    def _room_for_one_more(self) -> None:
        unfinished = sum(1 for j in list(self.jobs.values()) + list(self.previews.values())
                         if j.phase not in J.TERMINAL)
        if unfinished >= self.cfg.max_unfinished_jobs:
            raise RequestError(f"{unfinished} jobs are unfinished (max_unfinished_jobs = "
                               f"{self.cfg.max_unfinished_jobs}): try again when one has ended")

    def _req_submit(self, req: m.JobSubmitRequest, _p: dict[str, str]) -> Any:
        self._room_for_one_more()
        job_id = self._new_id(req.spec.name)
        self._run(job_id, J.new_job(job_id, req.spec, req.transaction, self._ctx(job_id)))
        return DEFER

    def _req_preview(self, req: m.PlanPreviewRequest, _p: dict[str, str]) -> Any:
        self._room_for_one_more()
        job_id = "preview-" + self._new_id(req.spec.name)
        self._run(job_id, J.new_job(job_id, req.spec, req.transaction, self._ctx(job_id), respond_to="plan/preview"))
        return DEFER

    def _req_status(self, req: m.JobStatusRequest, _p: dict[str, str]) -> Any:
        if req.job_id is None:
            recent = sorted(self.jobs.values(), key=lambda j: j.created_at)[-50:]
            return {"jobs": [summary(j) for j in recent]}
        job = self.jobs.get(req.job_id)
        if job is None:
            raise RequestError(f"unknown job {req.job_id!r}")
        return {"job": state_view(job).model_dump(mode="json")}

    def _req_command(self, req: Any, params: dict[str, str]) -> Any:
        action = type(req).__name__.removeprefix("Job").removesuffix("Request").lower()
        if req.job_id not in self.jobs:
            raise RequestError(f"unknown job {req.job_id!r}")
        self._event(req.job_id, J.Command(action, req.transaction))
        return DEFER

    def _req_nodes(self, _req: m.NodesListRequest, _p: dict[str, str]) -> Any:
        return {"nodes": R.listing(self.reg)}

    # --- Home Assistant ------------------------------------------------------------------------
    def _publish_ha_state(self) -> None:
        if self.habridge is None:
            return
        job = current(self.jobs.values())
        online = sum(1 for n in self.reg.values() if n.online)
        self.habridge.publish_state(state_view(job) if job else None, job.created_at if job else None, online,
                                    spec=job.spec if job else None)

    def _ha_job_command(self, action: str) -> str:
        job = current(self.jobs.values())
        if job is None or job.phase in J.TERMINAL:
            raise ValueError(f"no unfinished job to {action}")
        self._event(job.job_id, J.Command(action, None))
        return self.jobs[job.job_id].phase

    def _ha_start(self, spec: m.JobSpec, name: str) -> str:
        """Submit a job from Home Assistant; Refused with the reason when it is refused at once
        (then no job exists: nothing may say it was submitted or started)."""
        try:
            self._room_for_one_more()
        except RequestError as exc:
            raise Refused(str(exc)) from None
        job_id = self._new_id(spec.name)
        job, effects = J.new_job(job_id, spec, None, self._ctx(job_id))
        self._run(job_id, (job, effects))
        if J.refused(J.finished(job)):
            raise Refused(job.error or "refused")
        log.info("job submitted from Home Assistant", spec=name, job=job_id)
        return job_id

    def _remove_node(self, node_id: str) -> None:
        """Forget a retired node: its registry entry, its retained topics (or its capabilities
        would bring it back on the next start) and its Home Assistant device."""
        node = self.reg.get(node_id)
        if node is None:
            raise ValueError(f"unknown node {node_id!r}")
        if node.online:
            raise ValueError(f"node {node_id!r} is online: stop its service first")
        users = [j.job_id for j in self.jobs.values() if j.phase not in J.TERMINAL and node_id in nodes_of(j)]
        if users:
            raise ValueError(f"node {node_id!r} is in unfinished job {users[0]}")
        self.reg = {k: v for k, v in self.reg.items() if k != node_id}
        for key in ("node.availability", "node.capabilities", "node.job", "node.ha_state", "node.catalog"):
            self.bus.publish(self.table.build(key, node_id=node_id), b"", retain=True)
        if self.ha is not None and self.habridge is not None:
            self.bus.publish(*ha.node_removal(self.ha, node_id), retain=True)
            self.habridge.forget_node(node_id)
        log.info("node removed", node=node_id)

    def _on_job_state(self, _msg: m.JobState, params: dict[str, str]) -> None:
        """A retained state of a job this gateway does not have (pruned, or jobs.json replaced):
        clear it, or the CLI and Home Assistant would show it forever."""
        job_id = params["job_id"]
        if job_id not in self.jobs and job_id not in self.previews:
            self.bus.publish(self.table.build("job.state", job_id=job_id), b"", retain=True)

    def _job_state_refused(self, _text: str, params: dict[str, str], _payload: bytes) -> None:
        """An unreadable retained state on a topic only this gateway publishes (garbage, or a state
        of another schema version left by an upgrade): its own job's is published again, any other
        cleared, or the CLI and Home Assistant would trip on it forever."""
        job_id = params.get("job_id")
        if not job_id:
            return
        job = self.jobs.get(job_id)
        if job is not None and job.accepted:
            self._dirty.add(job_id)  # re-published by the next flush
        elif job_id not in self.previews:
            self._clear_state(job_id)
