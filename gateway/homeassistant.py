"""Home Assistant MQTT discovery for the gateway and every node (pure builders, no I/O).

Like Zigbee2MQTT's bridge, the gateway publishes discovery for all devices: one retained
device-based discovery message per device on `{prefix}/device/{object_id}/config`, and again
whenever Home Assistant announces itself with `online` on `{prefix}/status`. Entities read the
JSON state topics of INTERFACES.md §7 (`xronos.protocol.hastate`) and send JSON commands.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from importlib.metadata import PackageNotFoundError, version
from typing import Any, get_args

import structlog

from xronos.protocol import hastate
from xronos.protocol.messages import Capabilities, JobSpec, JobState, Phase
from xronos.protocol.topics import TopicTable

log = structlog.get_logger(__name__)

try:
    SW_VERSION = version("xronos")
except PackageNotFoundError:  # running from a bare checkout
    SW_VERSION = "0.0.0"

ORIGIN = {"name": "xronos", "sw": SW_VERSION}
PHASE_OPTIONS = ["idle", *get_args(Phase)]  # "idle": no job yet
BUTTONS = ("pause", "resume", "cancel")


@dataclass(frozen=True)
class HAContext:
    """Where things live: the Xronos base topic, the gateway's id and HA's discovery prefix."""

    base_topic: str = "xronos"
    gateway_id: str = "gateway"
    discovery_prefix: str = "homeassistant"

    def topic(self, relative: str, **params: str) -> str:
        return f"{self.base_topic}/{relative.format(**params)}"

    @property
    def status_topic(self) -> str:
        return f"{self.discovery_prefix}/status"

    @property
    def gateway_availability(self) -> str:
        return TopicTable(self.base_topic).build("gateway.availability")

    def node_availability(self, node_id: str) -> str:
        return TopicTable(self.base_topic).build("node.availability", node_id=node_id)

    @property
    def gateway_device_id(self) -> str:
        return f"xronos_{self.gateway_id}"

    def node_device_id(self, node_id: str) -> str:
        return f"xronos_{self.gateway_id}_node_{node_id}"

    def discovery_topic(self, device_id: str) -> str:
        return f"{self.discovery_prefix}/device/{device_id}/config"


def _avail(*topics: str) -> dict[str, Any]:
    return {"availability": [{"topic": t, "payload_available": "online",
                              "payload_not_available": "offline"} for t in topics],
            "availability_mode": "all"}


def _sensor(uid: str, name: str, state_topic: str, field: str, avail: dict[str, Any],
            **extra: Any) -> dict[str, Any]:
    return {"p": "sensor", "unique_id": uid, "name": name, "state_topic": state_topic,
            "value_template": f"{{{{ value_json.{field} }}}}", **avail, **extra}


def gateway_discovery(ctx: HAContext, specs: Iterable[str] = ()) -> tuple[str, dict[str, Any]]:
    """(topic, payload) of the gateway device: the current job's sensors and control buttons;
    with job specs in the gateway's job_dir, a "Job spec" select and a "Start job" button."""
    specs = tuple(specs)
    dev = ctx.gateway_device_id
    state = ctx.topic(hastate.GATEWAY_STATE)
    avail = _avail(ctx.gateway_availability)
    measure = {"state_class": "measurement"}
    pct = {"unit_of_measurement": "%", "state_class": "measurement",
           "suggested_display_precision": 1}
    secs = {"device_class": "duration", "unit_of_measurement": "s", "state_class": "measurement"}
    sensors = {
        "job_phase": _sensor(f"{dev}_job_phase", "Job phase", state, "phase", avail,
                             device_class="enum", options=PHASE_OPTIONS, icon="mdi:state-machine"),
        "job_name": _sensor(f"{dev}_job_name", "Job", state, "job_name", avail, icon="mdi:brain"),
        "progress": _sensor(f"{dev}_progress", "Progress", state, "progress_pct", avail,
                            icon="mdi:progress-clock", **pct),
        "loss": _sensor(f"{dev}_loss", "Loss", state, "loss", avail,
                        suggested_display_precision=4, icon="mdi:chart-bell-curve", **measure),
        "eval_metric": _sensor(
            f"{dev}_eval_metric", "Eval metric", state, "eval_metric", avail,
            suggested_display_precision=4, json_attributes_topic=state,
            json_attributes_template="{{ {'metric': value_json.eval_metric_name} | tojson }}",
            icon="mdi:target", **measure),
        "iteration_time": _sensor(f"{dev}_iteration_time", "Iteration time", state, "iteration_s",
                                  avail, suggested_display_precision=2, **secs),
        "eta": _sensor(f"{dev}_eta", "Time remaining", state, "eta_s", avail,
                       suggested_display_precision=0, **secs),
        "slowest_node": _sensor(f"{dev}_slowest_node", "Slowest node", state, "slowest_node",
                                avail, icon="mdi:tortoise"),
        "idle_ratio": _sensor(f"{dev}_idle_ratio", "Idle ratio", state, "idle_ratio_pct", avail,
                              icon="mdi:timer-sand", **pct),
        "nodes_online": _sensor(f"{dev}_nodes_online", "Nodes online", state, "nodes_online",
                                avail, icon="mdi:lan-connect", **measure),
        "last_command": _sensor(f"{dev}_last_command", "Last command", state, "last_command",
                                avail, entity_category="diagnostic", icon="mdi:console"),
        "steps": _sensor(f"{dev}_steps", "Step", state, "steps", avail, icon="mdi:counter",
                         json_attributes_topic=state,
                         json_attributes_template=(
                             "{{ {'step': value_json.step, 'total_steps': value_json.total_steps} | tojson }}")),
        "finish_time": _sensor(f"{dev}_finish_time", "Finish time", state, "finish_at", avail,
                               device_class="timestamp", icon="mdi:flag-checkered"),
        "error": _sensor(f"{dev}_error", "Last error", state, "error", avail, icon="mdi:alert-circle-outline"),
        # How the job trains (hastate.job_setup): what it learns, how its rows become text, and
        # whether it trains LoRA adapters on a frozen base.
        "task": _sensor(f"{dev}_task", "Task", state, "task", avail, icon="mdi:school-outline"),
        "data_format": _sensor(f"{dev}_data_format", "Data format", state, "data_format", avail,
                               icon="mdi:message-text-outline"),
        # Unknown (None) for full fine-tuning; the adapted modules as an attribute.
        "lora_rank": _sensor(f"{dev}_lora_rank", "LoRA rank", state, "lora_r", avail, icon="mdi:matrix",
                             json_attributes_topic=state,
                             json_attributes_template="{{ {'targets': value_json.lora_targets} | tojson }}"),
        # Live re-balancing: how often the plan followed the boxes, and the last decision's reason.
        "replans": _sensor(f"{dev}_replans", "Re-plans", state, "replans", avail, icon="mdi:scale-balance",
                           state_class="total_increasing"),
        "last_replan": _sensor(f"{dev}_last_replan", "Last re-plan", state, "last_replan", avail,
                               icon="mdi:swap-horizontal"),
    }
    icons = {"pause": "mdi:pause", "resume": "mdi:play", "cancel": "mdi:stop", "start": "mdi:rocket-launch"}
    actions = BUTTONS + (("start",) if specs else ())
    buttons = {
        action: {"p": "button", "unique_id": f"{dev}_{action}", "name": f"{action.title()} job",
                 "command_topic": ctx.topic(hastate.GATEWAY_SET),
                 "payload_press": json.dumps({"action": action}), "icon": icons[action], **avail}
        for action in actions
    }
    if specs:  # Home Assistant refuses a select without options
        buttons["job_spec"] = {
            "p": "select", "unique_id": f"{dev}_job_spec", "name": "Job spec", "options": list(specs),
            "command_topic": ctx.topic(hastate.GATEWAY_SET),
            "command_template": '{"action": "select", "spec": {{ value | tojson }}}',
            "state_topic": state, "value_template": "{{ value_json.selected_spec }}",
            "icon": "mdi:file-cog-outline", **avail}
    payload = {
        "dev": {"identifiers": [dev], "name": f"Xronos gateway {ctx.gateway_id}",
                "manufacturer": "Xronos", "model": "Gateway", "sw_version": SW_VERSION},
        "o": ORIGIN,
        "cmps": {**sensors, **buttons},
        "qos": 1,
    }
    return ctx.discovery_topic(dev), payload


def node_discovery(ctx: HAContext, node: Capabilities) -> tuple[str, dict[str, Any]]:
    """(topic, payload) of one node's device; CPU temperature only if the board reports one."""
    node_id = node.node_id
    dev = ctx.node_device_id(node_id)
    state = ctx.topic(hastate.NODE_STATE, node_id=node_id)
    avail = _avail(ctx.node_availability(node_id))
    pct = {"unit_of_measurement": "%", "state_class": "measurement",
           "suggested_display_precision": 1}
    cmps: dict[str, dict[str, Any]] = {
        # Reachable while the node is down, so HA can show it as disconnected.
        "online": {"p": "binary_sensor", "unique_id": f"{dev}_online", "name": "Online",
                   "device_class": "connectivity", "state_topic": ctx.node_availability(node_id),
                   "payload_on": "online", "payload_off": "offline",
                   **_avail(ctx.gateway_availability)},
        "attn_units": _sensor(f"{dev}_attn_units", "Attention units", state, "attn", avail,
                              state_class="measurement", icon="mdi:view-split-vertical",
                              json_attributes_topic=state,
                              json_attributes_template=(
                                  "{{ {'attn_total': value_json.attn_total,"
                                  " 'job_id': value_json.job_id} | tojson }}")),
        "attn_share": _sensor(f"{dev}_attn_share", "Attention share", state, "attn_pct", avail,
                              icon="mdi:chart-pie", **pct),
        "mlp_share": _sensor(f"{dev}_mlp_share", "MLP share", state, "mlp_pct", avail,
                             icon="mdi:chart-pie", **pct),
        "vocab_share": _sensor(f"{dev}_vocab_share", "Vocabulary share", state, "vocab_pct", avail,
                               icon="mdi:chart-pie", **pct),
        "compute_share": _sensor(f"{dev}_compute_share", "Compute share", state, "compute_pct",
                                 avail, icon="mdi:cpu-64-bit", **pct),
        "idle_share": _sensor(f"{dev}_idle_share", "Idle share", state, "idle_pct", avail,
                              icon="mdi:timer-sand", **pct),
        "participate": {"p": "switch", "unique_id": f"{dev}_participate", "name": "Participate",
                        "state_topic": state,
                        "value_template": "{{ 'ON' if value_json.participate else 'OFF' }}",
                        "state_on": "ON", "state_off": "OFF",
                        "command_topic": ctx.topic(hastate.NODE_SET, node_id=node_id),
                        "payload_on": json.dumps({"participate": True}),
                        "payload_off": json.dumps({"participate": False}),
                        "icon": "mdi:account-hard-hat", **avail},
        # Pressable while the node is offline (that is when it makes sense): the gateway's availability.
        "remove": {"p": "button", "unique_id": f"{dev}_remove", "name": "Remove node",
                   "command_topic": ctx.topic(hastate.GATEWAY_SET),
                   "payload_press": json.dumps({"action": "remove_node", "node_id": node_id}),
                   "entity_category": "config", "icon": "mdi:delete-outline",
                   **_avail(ctx.gateway_availability)},
    }
    if node.cpu_temp_c is not None:
        cmps["cpu_temperature"] = _sensor(
            f"{dev}_cpu_temperature", "CPU temperature", state, "cpu_temp_c", avail,
            device_class="temperature", unit_of_measurement="°C", state_class="measurement",
            suggested_display_precision=1, entity_category="diagnostic")
    payload = {
        "dev": {"identifiers": [dev], "name": f"Xronos node {node_id}", "manufacturer": "Xronos",
                "model": node.cpu_model or "CPU node", "hw_version": node.arch,
                "sw_version": SW_VERSION, "via_device": ctx.gateway_device_id},
        "o": ORIGIN,
        "cmps": cmps,
        "qos": 1,
    }
    return ctx.discovery_topic(dev), payload


def discovery_messages(ctx: HAContext, nodes: Iterable[Capabilities],
                       specs: Iterable[str] = ()) -> list[tuple[str, bytes]]:
    """Every discovery message to publish, retained: the gateway first, then each node."""
    built = [gateway_discovery(ctx, specs), *(node_discovery(ctx, n) for n in nodes)]
    return [(topic, json.dumps(payload).encode()) for topic, payload in built]


def node_removal(ctx: HAContext, node_id: str) -> tuple[str, bytes]:
    """An empty retained payload on the node's discovery topic removes its device from HA."""
    return ctx.discovery_topic(ctx.node_device_id(node_id)), b""


def is_ha_online(ctx: HAContext, topic: str, payload: bytes) -> bool:
    """True for Home Assistant's birth message: time to re-send all discovery."""
    return topic == ctx.status_topic and payload.strip() == b"online"


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _nonneg(x: float | None) -> float | None:
    x = _finite(x)
    return x if x is not None and x >= 0 else None


def _text(x: str | None) -> str | None:
    """Home Assistant refuses a state longer than 255 characters."""
    if x is None:
        return None
    return x if len(x) <= hastate.STATE_TEXT_MAX else x[:hastate.STATE_TEXT_MAX - 1] + "…"


def finish_time(now: float, eta_s: float | None) -> str | None:
    """ISO 8601 UTC time the job should end, to the minute (so that it changes only when the
    estimate moves), for the Finish time sensor."""
    if eta_s is None or not math.isfinite(eta_s) or not 0 <= eta_s < 10 * 365 * 86400:
        return None
    at = datetime.fromtimestamp(now + eta_s, tz=timezone.utc)
    return at.replace(second=0, microsecond=0).isoformat()


def gateway_state(job: JobState | None, *, nodes_online: int, now: float,
                  last_command: str | None = None, error: str | None = None,
                  selected_spec: str | None = None, spec: JobSpec | None = None) -> hastate.GatewayHAState:
    """The gateway's HA state for the current (or last) job; None = no job yet ("idle").
    `error`: a refusal newer than the job; else the job's own error is shown. `spec`: the job's
    spec (JobState does not carry it), for the sensors that say how the job trains."""
    if job is None:
        return hastate.GatewayHAState(nodes_online=nodes_online, last_command=_text(last_command),
                                      error=_text(error), selected_spec=selected_spec, updated_at=now)
    progress = None
    if job.total_steps:
        progress = min(100.0, 100.0 * job.step / job.total_steps)
    steps = f"{job.step} / {job.total_steps}" if job.total_steps else (f"{job.step}" if job.step else None)
    finish = finish_time(now, job.eta_s) if job.phase in ("running", "recovering") else None
    idle = [v for v in job.idle_ratio.values() if math.isfinite(v)]
    measured = {k: v for k, v in job.measured_s.items() if math.isfinite(v)}
    return hastate.GatewayHAState(
        job_id=job.job_id, job_name=job.name, phase=job.phase, step=job.step,
        total_steps=job.total_steps, progress_pct=progress, loss=_finite(job.loss),
        eval_metric=_finite(job.eval_metric), eval_metric_name=_text(job.eval_metric_name),
        iteration_s=_nonneg(job.iteration_s), eta_s=_nonneg(job.eta_s),
        slowest_node=_text(max(measured, key=measured.__getitem__)) if measured else None,
        idle_ratio_pct=min(100.0, max(0.0, 100.0 * sum(idle) / len(idle))) if idle else None,
        nodes_online=nodes_online, last_command=_text(last_command), updated_at=now,
        steps=steps, finish_at=finish, error=_text(error or job.error), selected_spec=selected_spec,
        replans=job.replans, last_replan=_text(job.last_replan_reason),
        **hastate.job_setup(spec),
    )


# --- the gateway's Home Assistant side, as one object the service drives ----------------------

SPEC_SUFFIXES = (".toml", ".yaml", ".yml")
_SPEC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_SPECS = 50  # a select with more options is no longer a menu
RESCAN_S = 30.0
MAX_STARTED = 16  # starts from Home Assistant awaiting their answer


def _spec_file(job_dir: Path, path: Path) -> bool:
    """A regular file that is in job_dir once links are resolved: a button in Home Assistant must
    not make the gateway read (and quote the parse errors of) a file elsewhere through a link."""
    try:
        return path.is_file() and path.resolve().is_relative_to(job_dir.resolve())
    except OSError:
        return False


def list_specs(job_dir: Path | None) -> tuple[str, ...]:
    """Job spec names in job_dir: file names without suffix, usable as select options."""
    if job_dir is None:
        return ()
    try:
        entries = sorted(os.scandir(job_dir), key=lambda e: e.name)
    except OSError:
        return ()
    names: list[str] = []
    for e in entries:
        stem, suffix = os.path.splitext(e.name)
        if suffix in SPEC_SUFFIXES and _spec_file(job_dir, Path(e.path)) and _SPEC_NAME.fullmatch(stem) \
                and stem not in names:
            names.append(stem)
    return tuple(names[:MAX_SPECS])



class Refused(ValueError):
    """A start the gateway refused at once (the job was never kept): the reason, for Last command."""


@dataclass
class Actions:
    """What the bridge asks of the gateway service (each raises ValueError with a reason)."""

    job_command: Callable[[str], str]  # pause|resume|cancel the current job -> result text
    start: Callable[[Any, str], str]  # (JobSpec, spec name) -> job id; Refused(reason) if refused at once
    remove_node: Callable[[str], None]
    nodes: Callable[[], list[Capabilities]]  # for discovery
    publish: Callable[[], None] = lambda: None  # publish gateway/state now (after a command)


class HABridge:
    """Home Assistant for the gateway: discovery, commands from `gateway/set` and HA's birth
    message (both through the dispatcher), and the `gateway/state` it publishes — only when
    something other than its timestamp changed."""

    def __init__(self, ctx: HAContext, bus: Any, job_dir: Path | None, actions: Actions) -> None:
        self.ctx, self.bus, self.job_dir, self.actions = ctx, bus, job_dir, actions
        self.specs: tuple[str, ...] = list_specs(job_dir)
        self.selected: str | None = self.specs[0] if self.specs else None
        self.last_command: str | None = None
        self.refusal: tuple[float, str] | None = None  # (when, why) of the newest refused submit
        # Jobs started from Home Assistant and not yet answered (job id -> what Last command names):
        # their acceptance or refusal replaces "submitted" there.
        self.started: dict[str, str] = {}
        self._published: hastate.GatewayHAState | None = None
        self._scanned_at = time.monotonic()

    # --- wiring ---------------------------------------------------------------------------
    def register(self, dispatcher: Any) -> None:
        dispatcher.on("gateway.set", self._on_command, on_error=self._on_bad)
        dispatcher.on("ha.status", self._on_status)

    def discovery(self) -> list[tuple[str, bytes]]:
        return discovery_messages(self.ctx, self.actions.nodes(), self.specs)

    def publish_discovery(self) -> None:
        for topic, payload in self.discovery():
            self.bus.publish(topic, payload, retain=True)

    def tick(self) -> None:
        """Every turn of the loop: re-read job_dir now and then; new specs = new discovery."""
        if time.monotonic() - self._scanned_at < RESCAN_S:
            return
        self.rescan()

    def rescan(self) -> None:
        self._scanned_at = time.monotonic()
        specs = list_specs(self.job_dir)
        if specs != self.specs:
            self.specs = specs
            if self.selected not in specs:
                self.selected = specs[0] if specs else None
            topic, payload = gateway_discovery(self.ctx, specs)
            self.bus.publish(topic, json.dumps(payload).encode(), retain=True)

    # --- state ----------------------------------------------------------------------------
    def refused(self, reason: str | None) -> None:
        self.refusal = (time.time(), reason or "refused")

    def answered(self, job_id: str | None, ok: bool, reason: str | None) -> None:
        """The answer to a submit: for a job started here, Last command turns from "submitted" to
        "accepted" or "refused" with the reason (the owner's inspection, the plan that cannot fit)."""
        name = self.started.pop(job_id, None) if job_id else None
        if name is None:
            return
        if ok:
            self.last_command = f"start: accepted {name} as {job_id}"
        else:
            self.last_command = _text(f"start: refused {name} ({job_id}): {reason or 'refused'}")
            log.warning("Home Assistant start refused", job=job_id, spec=name, reason=reason)
        self.actions.publish()

    def forget_published(self) -> None:
        """The next `publish_state` publishes even an unchanged state (the broker lost it)."""
        self._published = None

    def publish_state(self, job: JobState | None, job_created_at: float | None, nodes_online: int,
                      force: bool = False, spec: JobSpec | None = None) -> bool:
        """Publish gateway/state if it changed (or force); True if published. `spec`: the job's."""
        error = None
        if self.refusal and (job_created_at is None or self.refusal[0] >= job_created_at):
            error = self.refusal[1]
        st = gateway_state(job, nodes_online=nodes_online, now=time.time(), last_command=self.last_command,
                           error=error, selected_spec=self.selected, spec=spec)
        if not force and hastate.same_state(st, self._published):
            return False
        self.bus.publish_message(st)
        self._published = st
        return True

    # --- commands -------------------------------------------------------------------------
    def _on_bad(self, text: str) -> None:
        self.last_command = f"error: {text}"
        self.actions.publish()

    def _on_status(self, msg: hastate.HAStatus, _params: dict[str, str]) -> None:
        if msg == hastate.HAStatus.ONLINE:  # Home Assistant (re)started: it forgot the devices
            self.rescan()
            self.publish_discovery()
            self.forget_published()  # and show it the current state again
            self.actions.publish()

    def _on_command(self, cmd: hastate.GatewayCommand, _params: dict[str, str]) -> None:
        try:
            self.last_command = f"{cmd.action}: {self._do(cmd)}"
        except Refused as exc:
            self.last_command = _text(f"{cmd.action}: refused {exc}")
            log.warning("Home Assistant start refused", reason=str(exc))
        except ValueError as exc:
            self.last_command = f"{cmd.action}: error: {exc}"
            log.warning("Home Assistant command refused", action=cmd.action, reason=str(exc))
        self.actions.publish()

    def _do(self, cmd: hastate.GatewayCommand) -> str:
        if cmd.action in BUTTONS:
            return self.actions.job_command(cmd.action)
        if cmd.action == "select":
            self.rescan()
            if cmd.spec not in self.specs:
                raise ValueError(f"no job spec {cmd.spec!r} in {self.job_dir}")
            self.selected = cmd.spec
            return f"selected {cmd.spec}"
        if cmd.action == "start":
            name = cmd.spec or self.selected
            if name is None:
                raise ValueError(f"no job spec to start: put one in {self.job_dir}")
            from xronos.protocol.specfile import load_spec

            self.rescan()
            path = next((self.job_dir / f"{name}{sfx}" for sfx in SPEC_SUFFIXES
                         if self.job_dir and _spec_file(self.job_dir, self.job_dir / f"{name}{sfx}")), None)
            if path is None:
                raise ValueError(f"no job spec {name!r} in {self.job_dir}")
            try:
                spec = load_spec(path)
            except FileNotFoundError as exc:
                raise ValueError(str(exc)) from None
            return self._submit(spec, name)
        assert cmd.action == "remove_node" and cmd.node_id is not None
        self.actions.remove_node(cmd.node_id)
        return f"removed node {cmd.node_id}"

    def _submit(self, spec: JobSpec, name: str) -> str:
        try:
            job_id = self.actions.start(spec, name)
        except Refused as exc:
            raise Refused(f"{name}: {exc}") from None
        self.started[job_id] = name
        while len(self.started) > MAX_STARTED:  # answers that never came (a gateway restart between)
            self.started.pop(next(iter(self.started)))
        return f"submitted {name} as {job_id}"
