"""The gateway service's core (`xronos gateway --config gateway.toml`): thin glue around the pure parts.

One control loop: bus messages become events of the job state machine (`job.machine.handle`, which also
plans); the effects it returns are carried out here, as the messages `effects` makes of them (an
inspection or profile request, assignments, controls, a re-shard order, a request's answer);
every change is persisted (`store`) and published as the job's retained JobState. Time is a `Tick`
each turn of the loop. The topics are handled by the service's components (`component.Component`),
each in its module beside this one: the nodes (`nodes`), the requests (`requests`), Home Assistant
(`homeassistant`, when enabled) and the gateway's own availability (`availability`); they reach the
job table, the registry and the bus through this core (`component.Core`). The core itself keeps
only the retained JobState topics, which it publishes.

No message can break the service: every turn of the loop is guarded part by part (the message's
dispatch, each component's tick, each job's tick, each effect, each publish, the save), and an
unexpected error in one job's handling fails that job alone, with a short reason, while the service
carries on. Submits refused at check time are answered and not kept; finished jobs are pruned from
the history (`history_max_jobs`, `history_max_age_days`); at most `max_unfinished_jobs` are checked
or wait at a time.

Restart: the job table is reloaded, every unfinished job re-issues what it was waiting for, and
running jobs are re-attached, not restarted: their nodes keep training without the gateway, and
the retained NodeJobStatus and availability messages that arrive on subscribing tell it whether
they completed, failed or lost a node meanwhile (then it recovers from the last checkpoint).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

import structlog

from xronos.common import sdnotify
from xronos.gateway import registry as R
from xronos.gateway.config import GatewayConfig
from xronos.gateway.job import machine as J
from xronos.gateway.job.effects import messages as effect_messages
from xronos.gateway.job.planning import plan_job
from xronos.gateway.job.progress import state_view
from xronos.gateway.job.store import JobStore
from xronos.gateway.job.types import RespondTo
from xronos.gateway.job.views import milestone
from xronos.gateway.plan.rebalance import PolicyConfig
from xronos.protocol import messages as m
from xronos.protocol.dispatch import Dispatcher, RequestError
from xronos.protocol.topics import TopicTable
from xronos.protocol.transport import BusBase, MqttBus

from .availability import GatewayAvailability
from .component import Component
from .homeassistant import HomeAssistant
from .nodes import Nodes
from .requests import Requests

log = structlog.get_logger(__name__)
STATE_EVERY_S = 0.5  # retained JobState at most this often while only metrics change
SAVE_EVERY_S = 5.0  # job table on disk at most this often while only metrics change


def _reason(what: str, exc: BaseException) -> str:
    return f"internal error {what}: {type(exc).__name__}: {exc}"[:300]


class GatewayService:
    """The core its components see as `component.Core`; `step` is one turn of the control loop."""

    def __init__(self, cfg: GatewayConfig, bus: BusBase | None = None,
                 timeouts: J.Timeouts | None = None, policy: PolicyConfig | None = None) -> None:
        self.cfg = cfg
        policy = policy or PolicyConfig()  # live re-balancing's settings (the nodes' component applies them)
        # A node that joins a running job (`job.join`): the bar is the live policy's unless configured.
        self.join = J.JoinPolicy(min_gain=policy.threshold if cfg.join_min_gain is None else cfg.join_min_gain,
                                 restart_s=cfg.join_restart_s)
        self.table = TopicTable(cfg.base_topic, cfg.homeassistant.discovery_prefix)
        will = (self.table.build("gateway.availability"), "offline", True)
        # A random part: on a broker without use_username_as_clientid nobody can guess the id and
        # knock the gateway off by connecting with it.
        self.bus = bus or MqttBus(cfg.broker, f"{cfg.gateway_id}-{uuid.uuid4().hex[:8]}", will=will, table=self.table)
        self.dispatcher = Dispatcher(self.bus)
        self.timeouts = timeouts or J.Timeouts(profile_s=cfg.profile_timeout_s, ack_s=cfg.ack_timeout_s)
        self.net = J.Net(bandwidth_Bps=cfg.bandwidth_mbps * 1e6 / 8, latency_s=cfg.latency_ms / 1000)
        self.store = JobStore(cfg.state_dir)
        self.jobs: dict[str, J.Job] = self.store.load()
        self.previews: dict[str, J.Job] = {}
        self.reg: R.Registry = {}
        self._connected_at: float | None = None  # set by the connect hook (network thread)
        self._connect_seen: float | None = None  # the latest connect the control loop has handled
        self._seen_disconnected = False
        self.internal_errors = 0  # unexpected exceptions caught by a guard (each logged with its traceback)
        self._dirty: set[str] = set()
        self._unsaved = False
        self._saved_at = self._published_at = 0.0
        self.stopping = False
        # The components, in the order their hooks run: the own availability goes out before the
        # discovery of the entities that follow it.
        self.availability = GatewayAvailability(self.bus, cfg.base_topic)
        self.nodes = Nodes(self, policy)
        self.requests = Requests(self)
        self.homeassistant = HomeAssistant(self) if cfg.homeassistant.enabled else None
        self.components: tuple[Component, ...] = tuple(
            c for c in (self.availability, self.nodes, self.requests, self.homeassistant) if c is not None)

    # --- wiring --------------------------------------------------------------------------------
    def start(self) -> None:
        for c in self.components:
            c.register(self.dispatcher)
        # retained states of jobs this gateway no longer has, and unreadable ones (garbage, another schema version)
        self.dispatcher.on("job.state", self._on_job_state, on_refused=self._job_state_refused)
        self.bus.on_connect(self._connected)
        self.bus.start()
        for job_id, job in list(self.jobs.items()):  # each job's restart alone: one bad job fails alone
            try:
                out = J.restart(job, self._ctx(job_id))
            except Exception as exc:
                self.internal("restart", job_id, exc)
                out = J.abort(job, self._ctx(job_id), _reason("on restart", exc))
            self._run(job_id, out)

    def _connected(self) -> None:
        self._connected_at = time.monotonic()  # read by the control loop (`step`)
        for c in self.components:
            c.connected()

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
            self.internal("reconnect", None, exc)
        now = time.monotonic()
        self._each("tick", lambda c: c.tick(now))
        self.to_jobs(J.Tick())
        try:
            self._flush()
        except Exception as exc:
            self.internal("flush", None, exc)

    def _each(self, hook: str, call: Callable[[Component], None]) -> None:
        """A hook of every component, each guarded alone."""
        for c in self.components:
            try:
                call(c)
            except Exception as exc:
                self.internal(f"{c.name} ({hook})", None, exc)

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
        """The components' own (the nodes' settle time starts: gateway/job/offline.py). And every
        job's retained state goes out again, as the connect hook does for availability and
        discovery: a broker restarted without persistence (Mosquitto's default) has forgotten them,
        and a finished job's state would never change again to bring them back (the CLI and Home
        Assistant would show nothing for it)."""
        now = time.monotonic()
        self._each("reconnected", lambda c: c.reconnected(now))
        self._dirty.update(job_id for job_id, job in self.jobs.items() if job.accepted)
        self._flush(force=True)

    def shutdown(self) -> None:
        try:
            self._flush(force=True)
        except Exception as exc:
            self.internal("flush", None, exc)
        self._each("stop", lambda c: c.stop())
        self.bus.stop()

    def internal(self, where: str, job_id: str | None, exc: BaseException) -> None:
        self.internal_errors += 1
        log.error("gateway.internal_error", where=where, job=job_id, error=f"{type(exc).__name__}: {exc}"[:300],
                  exc_info=exc)

    # --- what the components change ------------------------------------------------------------
    def set_registry(self, reg: R.Registry) -> None:
        before, self.reg = self.reg, reg
        for c in self.components:
            c.nodes_changed(before, reg)

    def submit(self, spec: m.JobSpec, transaction: str | None, respond_to: RespondTo = "job/submit") -> J.Job:
        self._room_for_one_more()
        job_id = ("preview-" if respond_to == "plan/preview" else "") + self._new_id(spec.name)
        if spec.reserve_mb is None:  # the job leaves it to the gateway (gateway.toml's reserve_mb)
            spec = spec.model_copy(update={"reserve_mb": self.cfg.reserve_mb})
        job, effects = J.new_job(job_id, spec, transaction, self._ctx(job_id), respond_to=respond_to)
        self._run(job_id, (job, effects))
        return J.finished(job)

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

    def to_jobs(self, event: J.Event) -> None:
        for job_id, job in list(self.jobs.items()) + list(self.previews.items()):
            if job.phase not in J.TERMINAL:
                self.event(job_id, event)

    # --- the state machine's glue --------------------------------------------------------------
    def _ctx(self, job_id: str) -> J.Ctx:
        busy = any(J.occupies(j) for k, j in self.jobs.items() if k != job_id)
        return J.Ctx(now=time.time(), online=R.usable(self.reg), timeouts=self.timeouts, busy=busy,
                     caps=R.capabilities(self.reg), net=self.net, planner=plan_job, join=self.join)

    def _job(self, job_id: str) -> J.Job | None:
        return self.jobs.get(job_id) or self.previews.get(job_id)

    def event(self, job_id: str, event: J.Event) -> None:
        job = self._job(job_id)
        if job is None:
            return
        try:
            out = J.handle(job, event, self._ctx(job_id))
        except Exception as exc:  # this job's transition broke: it fails alone
            self.internal(type(event).__name__, job_id, exc)
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
            self.internal("abort", job_id, exc)
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
            self.internal("schedule", None, exc)
            return
        for effect in more:
            self._effect(getattr(effect, "job_id", ""), effect)

    def _effect(self, job_id: str, effect: J.Effect) -> None:
        try:
            self._do(effect)
        except Exception as exc:  # e.g. a message that cannot be encoded: the job fails alone
            self.internal(type(effect).__name__, job_id, exc)
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
                    self.internal("publish JobState", job_id, exc)
                    self._abort(job_id, _reason("publishing its state", exc))
            self._published_at = now
            self._each("published", lambda c: c.published())
        if (force or now - self._saved_at > SAVE_EVERY_S) and self._unsaved:
            self._prune()
            try:
                self.store.save(self.jobs)
            except (OSError, ValueError, TypeError) as exc:  # a full disk must not stop the service
                self.internal("save", None, exc)
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
            self.internal("clear JobState", job_id, exc)

    # --- effects -------------------------------------------------------------------------------
    def _do(self, e: J.Effect) -> None:
        if isinstance(e, J.Respond):
            for c in self.components:
                c.responding(e)
        job = self._job(e.job_id) if not isinstance(e, J.Respond) else None
        ports = (self.cfg.rendezvous_port_min, self.cfg.rendezvous_port_max)
        for msg, params in effect_messages(e, job, self.reg, ports):
            self.bus.publish_message(msg, **params)

    # --- the retained JobState topics --------------------------------------------------------
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
