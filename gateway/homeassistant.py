"""Home Assistant MQTT discovery for the gateway and every node (pure builders, no I/O).

Like Zigbee2MQTT's bridge, the gateway publishes discovery for all devices: one retained
device-based discovery message per device on `{prefix}/device/{object_id}/config`, and again
whenever Home Assistant announces itself with `online` on `{prefix}/status`. Entities read the
JSON state topics of INTERFACES.md §7 (`xronos.protocol.hastate`) and send JSON commands.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, get_args

from xronos.protocol import hastate
from xronos.protocol.messages import Capabilities, JobState, Phase
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


def _avail(*topics: str) -> dict[str, Any]:
    return {"availability": [{"topic": t, "payload_available": "online",
                              "payload_not_available": "offline"} for t in topics],
            "availability_mode": "all"}


def _sensor(uid: str, name: str, state_topic: str, field: str, avail: dict[str, Any],
            **extra: Any) -> dict[str, Any]:
    return {"p": "sensor", "unique_id": uid, "name": name, "state_topic": state_topic,
            "value_template": f"{{{{ value_json.{field} }}}}", **avail, **extra}


def gateway_discovery(ctx: HAContext) -> tuple[str, dict[str, Any]]:
    """(topic, payload) of the gateway device: the current job's sensors and control buttons."""
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
    }
    icons = {"pause": "mdi:pause", "resume": "mdi:play", "cancel": "mdi:stop"}
    buttons = {
        action: {"p": "button", "unique_id": f"{dev}_{action}", "name": f"{action.title()} job",
                 "command_topic": ctx.topic(hastate.GATEWAY_SET),
                 "payload_press": json.dumps({"action": action}), "icon": icons[action], **avail}
        for action in BUTTONS
    }
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
        "units": _sensor(f"{dev}_units", "Assigned units", state, "units", avail,
                         state_class="measurement", icon="mdi:view-split-vertical",
                         json_attributes_topic=state,
                         json_attributes_template=(
                             "{{ {'units_total': value_json.units_total,"
                             " 'job_id': value_json.job_id} | tojson }}")),
        "ratio": _sensor(f"{dev}_ratio", "Assigned ratio", state, "ratio_pct", avail,
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


def discovery_messages(ctx: HAContext, nodes: Iterable[Capabilities]) -> list[tuple[str, bytes]]:
    """Every discovery message to publish, retained: the gateway first, then each node."""
    built = [gateway_discovery(ctx), *(node_discovery(ctx, n) for n in nodes)]
    return [(topic, json.dumps(payload).encode()) for topic, payload in built]


def node_removal(ctx: HAContext, node_id: str) -> tuple[str, bytes]:
    """An empty retained payload on the node's discovery topic removes its device from HA."""
    return ctx.discovery_topic(ctx.node_device_id(node_id)), b""


def is_ha_online(ctx: HAContext, topic: str, payload: bytes) -> bool:
    """True for Home Assistant's birth message: time to re-send all discovery."""
    return topic == ctx.status_topic and payload.strip() == b"online"


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def gateway_state(job: JobState | None, *, nodes_online: int, now: float,
                  last_command: str | None = None) -> hastate.GatewayHAState:
    """The gateway's HA state for the current (or last) job; None = no job yet ("idle")."""
    if job is None:
        return hastate.GatewayHAState(nodes_online=nodes_online, last_command=last_command,
                                      updated_at=now)
    progress = None
    if job.total_steps:
        progress = min(100.0, 100.0 * job.step / job.total_steps)
    idle = [v for v in job.idle_ratio.values() if math.isfinite(v)]
    measured = {k: v for k, v in job.measured_s.items() if math.isfinite(v)}
    return hastate.GatewayHAState(
        job_id=job.job_id, job_name=job.name, phase=job.phase, step=job.step,
        total_steps=job.total_steps, progress_pct=progress, loss=_finite(job.loss),
        eval_metric=_finite(job.eval_metric), eval_metric_name=job.eval_metric_name,
        iteration_s=_finite(job.iteration_s), eta_s=_finite(job.eta_s),
        slowest_node=max(measured, key=measured.__getitem__) if measured else None,
        idle_ratio_pct=min(100.0, max(0.0, 100.0 * sum(idle) / len(idle))) if idle else None,
        nodes_online=nodes_online, last_command=last_command, updated_at=now,
    )
