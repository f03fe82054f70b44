"""Home Assistant MQTT discovery for the gateway and every node (pure builders, no I/O).

Like Zigbee2MQTT's bridge, the gateway publishes discovery for all devices: one retained
device-based discovery message per device on `{prefix}/device/{object_id}/config`, and again
whenever Home Assistant announces itself with `online` on `{prefix}/status`. Entities read the
JSON state topics of INTERFACES.md §7 (`xronos.protocol.hastate`) and send JSON commands.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from typing import Any, get_args

from xronos.gateway.homeassistant import form as haform
from xronos.protocol import hastate
from xronos.protocol.messages import Capabilities, JobSpec, JobState, NodeCatalog, Phase
from xronos.protocol.topics import TopicTable

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


def _avail(topic: str) -> dict[str, Any]:
    """Availability, declared once per device at the root of its discovery payload (a shared option
    of device-based discovery); a component that follows another topic overrides it."""
    return {"availability": [{"topic": topic, "payload_available": "online", "payload_not_available": "offline"}]}


DIAG = {"entity_category": "diagnostic"}


def _slug(text: str) -> str:
    """An entity id's object part: lower-case letters, digits and single underscores."""
    return re.sub(r"_+", "_", re.sub(r"[^a-z0-9]", "_", text.lower())).strip("_")


def _ids(platform: str, uid: str) -> dict[str, str]:
    """unique_id and the entity id Home Assistant gives it (`default_entity_id`, which replaced
    `object_id` in Home Assistant 2025.10): `sensor.xronos_gateway_job_phase`, not one derived from
    the device and entity names."""
    return {"unique_id": uid, "default_entity_id": f"{platform}.{_slug(uid)}"}


def _sensor(uid: str, name: str, state_topic: str, field: str, **extra: Any) -> dict[str, Any]:
    return {"p": "sensor", **_ids("sensor", uid), "name": name, "state_topic": state_topic,
            "value_template": f"{{{{ value_json.{field} }}}}", **extra}


def gateway_discovery(ctx: HAContext, specs: Iterable[str] = (), form: hastate.JobForm | None = None,
                      catalogs: Mapping[str, NodeCatalog] | None = None) -> tuple[str, dict[str, Any]]:
    """(topic, payload) of the gateway device: the current job's sensors and control buttons; the
    job form (`haform.components`: the owners' model directories and data files, the numbers,
    Start training); with job specs in the gateway's job_dir, a "Job spec" select and "Start job"."""
    specs = tuple(specs)
    dev = ctx.gateway_device_id
    state = ctx.topic(hastate.GATEWAY_STATE)
    measure = {"state_class": "measurement"}
    pct = {"unit_of_measurement": "%", "state_class": "measurement",
           "suggested_display_precision": 1}
    secs = {"device_class": "duration", "unit_of_measurement": "s", "state_class": "measurement"}
    sensors = {
        "job_phase": _sensor(f"{dev}_job_phase", "Job phase", state, "phase",
                             device_class="enum", options=PHASE_OPTIONS, icon="mdi:state-machine"),
        "job_name": _sensor(f"{dev}_job_name", "Job", state, "job_name", icon="mdi:brain"),
        "progress": _sensor(f"{dev}_progress", "Progress", state, "progress_pct",
                            icon="mdi:progress-clock", **pct),
        "loss": _sensor(f"{dev}_loss", "Loss", state, "loss",
                        suggested_display_precision=4, icon="mdi:chart-bell-curve", **measure),
        "eval_metric": _sensor(
            f"{dev}_eval_metric", "Eval metric", state, "eval_metric",
            suggested_display_precision=4, json_attributes_topic=state,
            json_attributes_template="{{ {'metric': value_json.eval_metric_name} | tojson }}",
            icon="mdi:target", **measure),
        "iteration_time": _sensor(f"{dev}_iteration_time", "Iteration time", state, "iteration_s",
                                  suggested_display_precision=2, **secs, **DIAG),
        "eta": _sensor(f"{dev}_eta", "Time remaining", state, "eta_s",
                       suggested_display_precision=0, **secs),
        "slowest_node": _sensor(f"{dev}_slowest_node", "Slowest node", state, "slowest_node",
                                icon="mdi:tortoise", **DIAG),
        "idle_ratio": _sensor(f"{dev}_idle_ratio", "Idle ratio", state, "idle_ratio_pct",
                              icon="mdi:timer-sand", **pct, **DIAG),
        "nodes_online": _sensor(f"{dev}_nodes_online", "Nodes online", state, "nodes_online",
                                icon="mdi:lan-connect", **measure, **DIAG),
        "last_command": _sensor(f"{dev}_last_command", "Last command", state, "last_command",
                                icon="mdi:console", **DIAG),
        "steps": _sensor(f"{dev}_steps", "Step", state, "steps", icon="mdi:counter",
                         json_attributes_topic=state,
                         json_attributes_template=(
                             "{{ {'step': value_json.step, 'total_steps': value_json.total_steps} | tojson }}")),
        "finish_time": _sensor(f"{dev}_finish_time", "Finish time", state, "finish_at",
                               device_class="timestamp", icon="mdi:flag-checkered"),
        "error": _sensor(f"{dev}_error", "Last error", state, "error", icon="mdi:alert-circle-outline"),
        # How the job trains (hastate.job_setup): what it learns, how its rows become text, and
        # whether it trains LoRA adapters on a frozen base.
        "task": _sensor(f"{dev}_task", "Task", state, "task", icon="mdi:school-outline"),
        "data_format": _sensor(f"{dev}_data_format", "Data format", state, "data_format",
                               icon="mdi:message-text-outline"),
        # Unknown (None) for full fine-tuning; the adapted modules as an attribute.
        "lora_rank": _sensor(f"{dev}_lora_rank", "LoRA rank", state, "lora_r", icon="mdi:matrix",
                             json_attributes_topic=state,
                             json_attributes_template="{{ {'targets': value_json.lora_targets} | tojson }}"),
        # Live re-balancing: how often the plan followed the boxes, and the last decision's reason.
        "replans": _sensor(f"{dev}_replans", "Re-plans", state, "replans", icon="mdi:scale-balance",
                           state_class="total_increasing", **DIAG),
        "last_replan": _sensor(f"{dev}_last_replan", "Last re-plan", state, "last_replan",
                               icon="mdi:swap-horizontal", **DIAG),
        # Which parallelism the planner chose for the job (auto: the fastest that fits) and what was asked.
        "strategy": _sensor(f"{dev}_strategy", "Parallelism", state, "strategy", icon="mdi:family-tree",
                            json_attributes_topic=state,
                            json_attributes_template="{{ {'asked': value_json.strategy_asked} | tojson }}", **DIAG),
        # What the job made: the metric before training (after: Eval metric) and where the export
        # is (the GGUF type asked for, as an attribute: the .gguf file is beside it).
        "metric_before": _sensor(f"{dev}_metric_before", "Metric before", state, "eval_initial",
                                 suggested_display_precision=4, icon="mdi:target-variant", **measure),
        "export": _sensor(f"{dev}_export", "Export", state, "export_dir", icon="mdi:folder-download",
                          json_attributes_topic=state,
                          json_attributes_template="{{ {'gguf': value_json.export_gguf} | tojson }}"),
    }
    icons = {"pause": "mdi:pause", "resume": "mdi:play", "cancel": "mdi:stop", "start": "mdi:rocket-launch"}
    actions = BUTTONS + (("start",) if specs else ())
    buttons = {
        action: {"p": "button", **_ids("button", f"{dev}_{action}"), "name": f"{action.title()} job",
                 "command_topic": ctx.topic(hastate.GATEWAY_SET),
                 "payload_press": json.dumps({"action": action}), "icon": icons[action]}
        for action in actions
    }
    if specs:  # Home Assistant refuses a select without options
        buttons["job_spec"] = {
            "p": "select", **_ids("select", f"{dev}_job_spec"), "name": "Job spec", "options": list(specs),
            "command_topic": ctx.topic(hastate.GATEWAY_SET),
            "command_template": '{"action": "select", "spec": {{ value | tojson }}}',
            "state_topic": state, "value_template": "{{ value_json.selected_spec }}",
            "icon": "mdi:file-cog-outline"}
    form_cmps = haform.components(dev, form or hastate.JobForm(), catalogs or {}, state,
                                  ctx.topic(hastate.GATEWAY_SET))
    payload = {
        # "Xronos gateway", as the docs name it; a gateway of another id says which
        "dev": {"identifiers": [dev], "name": "Xronos gateway" if ctx.gateway_id == "gateway"
                else f"Xronos gateway {ctx.gateway_id}",
                "manufacturer": "Xronos", "model": "Gateway", "sw_version": SW_VERSION},
        "o": ORIGIN,
        **_avail(ctx.gateway_availability),
        "cmps": {**sensors, **buttons, **form_cmps},
        "qos": 1,
    }
    return ctx.discovery_topic(dev), payload


def node_discovery(ctx: HAContext, node: Capabilities) -> tuple[str, dict[str, Any]]:
    """(topic, payload) of one node's device; CPU temperature only if the board reports one."""
    node_id = node.node_id
    dev = ctx.node_device_id(node_id)
    state = ctx.topic(hastate.NODE_STATE, node_id=node_id)
    pct = {"unit_of_measurement": "%", "state_class": "measurement",
           "suggested_display_precision": 1}
    cmps: dict[str, dict[str, Any]] = {
        # Reachable while the node is down, so HA can show it as disconnected.
        "online": {"p": "binary_sensor", **_ids("binary_sensor", f"{dev}_online"), "name": "Online",
                   "device_class": "connectivity", "state_topic": ctx.node_availability(node_id),
                   "payload_on": "online", "payload_off": "offline",
                   **_avail(ctx.gateway_availability)},
        "attn_units": _sensor(f"{dev}_attn_units", "Attention units", state, "attn",
                              state_class="measurement", icon="mdi:view-split-vertical", **DIAG,
                              json_attributes_topic=state,
                              json_attributes_template=(
                                  "{{ {'attn_total': value_json.attn_total,"
                                  " 'job_id': value_json.job_id} | tojson }}")),
        "attn_share": _sensor(f"{dev}_attn_share", "Attention share", state, "attn_pct",
                              icon="mdi:chart-pie", **pct, **DIAG),
        "mlp_share": _sensor(f"{dev}_mlp_share", "MLP share", state, "mlp_pct",
                             icon="mdi:chart-pie", **pct, **DIAG),
        "vocab_share": _sensor(f"{dev}_vocab_share", "Vocabulary share", state, "vocab_pct",
                               icon="mdi:chart-pie", **pct, **DIAG),
        "compute_share": _sensor(f"{dev}_compute_share", "Compute share", state, "compute_pct",
                                 icon="mdi:cpu-64-bit", **pct, **DIAG),
        "idle_share": _sensor(f"{dev}_idle_share", "Idle share", state, "idle_pct",
                              icon="mdi:timer-sand", **pct, **DIAG),
        "participate": {"p": "switch", **_ids("switch", f"{dev}_participate"), "name": "Participate",
                        "state_topic": state,
                        "value_template": "{{ 'ON' if value_json.participate else 'OFF' }}",
                        "state_on": "ON", "state_off": "OFF",
                        "command_topic": ctx.topic(hastate.NODE_SET, node_id=node_id),
                        "payload_on": json.dumps({"participate": True}),
                        "payload_off": json.dumps({"participate": False}),
                        "icon": "mdi:account-hard-hat"},
        # Pressable while the node is offline (that is when it makes sense): the gateway's availability.
        "remove": {"p": "button", **_ids("button", f"{dev}_remove"), "name": "Remove node",
                   "command_topic": ctx.topic(hastate.GATEWAY_SET),
                   "payload_press": json.dumps({"action": "remove_node", "node_id": node_id}),
                   "entity_category": "config", "icon": "mdi:delete-outline",
                   **_avail(ctx.gateway_availability)},
    }
    if node.cpu_temp_c is not None:
        cmps["cpu_temperature"] = _sensor(
            f"{dev}_cpu_temperature", "CPU temperature", state, "cpu_temp_c",
            device_class="temperature", unit_of_measurement="°C", state_class="measurement",
            suggested_display_precision=1, **DIAG)
    payload = {
        "dev": {"identifiers": [dev], "name": f"Xronos node {node_id}", "manufacturer": "Xronos",
                "model": node.cpu_model or "CPU node", "hw_version": node.arch,
                "sw_version": SW_VERSION, "via_device": ctx.gateway_device_id},
        "o": ORIGIN,
        **_avail(ctx.node_availability(node_id)),  # Online and Remove node: the gateway's (above)
        "cmps": cmps,
        "qos": 1,
    }
    return ctx.discovery_topic(dev), payload


def discovery_messages(ctx: HAContext, nodes: Iterable[Capabilities], specs: Iterable[str] = (),
                       form: hastate.JobForm | None = None,
                       catalogs: Mapping[str, NodeCatalog] | None = None) -> list[tuple[str, bytes]]:
    """Every discovery message to publish, retained: the gateway first, then each node."""
    built = [gateway_discovery(ctx, specs, form, catalogs), *(node_discovery(ctx, n) for n in nodes)]
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


def state_text(x: str | None) -> str | None:
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


def plan_strategy(plan: Any, kept: str | None = None) -> str | None:
    """A plan's parallelism in a few words: its strategy, for data parallelism its groups, for
    tensor parallelism its overlap of the all-reduces with compute (`kept`: the mode its overlap
    trial kept, `JobState.overlap_kept`, which runs instead of the plan's first)."""
    if plan is None:
        return None
    if not plan.shares:
        if kept is not None:
            mode = "no overlap" if kept == "off" else "overlap backward" if kept == "bwd" else \
                f"overlap {kept.removeprefix('c')} chunks"
            return f"{plan.strategy}, {mode} (measured fastest)"
        o = getattr(plan, "overlap", None)
        if o is None:
            return plan.strategy
        return f"{plan.strategy}, overlap " + (f"{o.chunks} chunks" if o.chunks > 1 else "backward")
    tp = plan.tp_size
    return f"dp ({len(plan.shares)} replicas)" if tp == 1 else f"dp ({len(plan.shares)} groups of TP {tp})"


def gateway_state(job: JobState | None, *, nodes_online: int, now: float,
                  last_command: str | None = None, error: str | None = None,
                  selected_spec: str | None = None, spec: JobSpec | None = None,
                  form: hastate.JobForm | None = None) -> hastate.GatewayHAState:
    """The gateway's HA state for the current (or last) job; None = no job yet ("idle").
    `error`: a refusal newer than the job; else the job's own error is shown. `spec`: the job's
    spec (JobState does not carry it), for the sensors that say how the job trains. `form`: the
    job form's values, for its selects and numbers."""
    form = form or hastate.JobForm()
    if job is None:
        return hastate.GatewayHAState(nodes_online=nodes_online, last_command=state_text(last_command),
                                      error=state_text(error), selected_spec=selected_spec, form=form, updated_at=now)
    gguf = spec.recipe.export_gguf if spec is not None else None
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
        eval_metric=_finite(job.eval_metric), eval_metric_name=state_text(job.eval_metric_name),
        iteration_s=_nonneg(job.iteration_s), eta_s=_nonneg(job.eta_s),
        slowest_node=state_text(max(measured, key=measured.__getitem__)) if measured else None,
        idle_ratio_pct=min(100.0, max(0.0, 100.0 * sum(idle) / len(idle))) if idle else None,
        nodes_online=nodes_online, last_command=state_text(last_command), updated_at=now,
        steps=steps, finish_at=finish, error=state_text(error or job.error), selected_spec=selected_spec,
        replans=job.replans, last_replan=state_text(job.last_replan_reason),
        strategy=plan_strategy(job.plan, job.overlap_kept), strategy_asked=spec.strategy if spec is not None else None,
        eval_initial=_finite(job.eval_initial), export_dir=state_text(job.export_dir),
        export_gguf=gguf if gguf in get_args(hastate.GGUFChoice) else None, form=form,
        **hastate.job_setup(spec),
    )
