"""The JSON states and commands Home Assistant reads and writes (INTERFACES.md §7).

The gateway publishes discovery for every device (gateway/homeassistant.py); the states behind
those entities are published by whoever owns the data: the gateway for the job, each node for
itself (a node may only publish under its own topics). Commands from Home Assistant are small
JSON objects; the effect of a command shows up on the matching state topic.

All topics are relative to the base topic ("xronos"). Every state field is always present (null
when unknown) because the discovery templates read `value_json.<field>` and Home Assistant
shows a template that renders "None" as `unknown`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .messages import Phase

GATEWAY_STATE = "gateway/state"  # GatewayHAState, retained, gateway → HA
GATEWAY_SET = "gateway/set"  # GatewayCommand, HA → gateway
NODE_STATE = "node/{node_id}/state"  # NodeHAState, retained, node → HA
NODE_SET = "node/{node_id}/set"  # NodeCommand, HA → node

HAPhase = Literal["idle"] | Phase  # "idle": no job yet
Percent = Annotated[float, Field(ge=0, le=100)]
Seconds = Annotated[float, Field(ge=0)]


class _HAModel(BaseModel):
    # Not strict: these come back from Home Assistant as plain JSON; forbid unknown keys all the same.
    model_config = ConfigDict(frozen=True, extra="forbid")


class GatewayHAState(_HAModel):
    """The current (or last) job as Home Assistant shows it on the gateway device."""

    job_id: str | None = None
    job_name: str | None = None
    phase: HAPhase = "idle"
    step: int | None = None
    total_steps: int | None = None
    progress_pct: Percent | None = None
    loss: float | None = None  # never NaN/inf: HA's JSON parser rejects them
    eval_metric: float | None = None
    eval_metric_name: str | None = None
    iteration_s: Seconds | None = None
    eta_s: Seconds | None = None
    slowest_node: str | None = None  # node with the longest measured iteration compute time
    idle_ratio_pct: Percent | None = None  # mean over the job's nodes of idle / iteration time
    nodes_online: int = 0
    last_command: str | None = None  # e.g. "pause: ok" or "resume: error: no paused job"
    updated_at: float


class NodeHAState(_HAModel):
    """One node as Home Assistant shows it. Published by the node itself."""

    participate: bool
    job_id: str | None = None  # the job this node is assigned to, if any
    units: int | None = None  # partition units assigned to this node (h_d)
    units_total: int | None = None  # H
    ratio_pct: Percent | None = None  # 100 * h_d / H
    compute_pct: Percent | None = None  # share of the last iteration spent computing
    idle_pct: Percent | None = None  # share of the last iteration spent waiting for peers
    cpu_temp_c: float | None = None
    updated_at: float


class GatewayCommand(_HAModel):
    """HA → gateway: act on the current job (the newest one not yet finished)."""

    action: Literal["pause", "resume", "cancel"]


class NodeCommand(_HAModel):
    """HA → node: switch participation; a node switched off leaves the next plan."""

    participate: bool


def parse_command(model: type[GatewayCommand] | type[NodeCommand], payload: bytes,
                  topic: str) -> GatewayCommand | NodeCommand:
    """Decode a command payload; ValueError naming the topic and the problem."""
    try:
        return model.model_validate_json(payload, strict=True)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'payload'}: {e['msg']}" for e in exc.errors()
        )
        raise ValueError(f"{topic}: bad {model.__name__} payload {payload[:200]!r}: {problems}") from None


def iteration_shares(compute_s: float, idle_s: float, iteration_s: float) -> tuple[float, float]:
    """(compute_pct, idle_pct) of one iteration, for NodeHAState; clamped into [0, 100]."""
    if iteration_s <= 0:
        return 0.0, 0.0
    return _pct(compute_s / iteration_s), _pct(idle_s / iteration_s)


def _pct(fraction: float) -> float:
    return min(100.0, max(0.0, 100.0 * fraction))
