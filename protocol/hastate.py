"""The JSON states and commands Home Assistant reads and writes (INTERFACES.md §7).

The gateway publishes discovery for every device (gateway/homeassistant/discovery.py); the states behind
those entities are published by whoever owns the data: the gateway for the job, each node for
itself (a node may only publish under its own topics). Commands from Home Assistant are small
JSON objects; the effect of a command shows up on the matching state topic.

These topics are entries of the one topic table (`xronos.protocol.topics`: "gateway.ha_state",
"gateway.set", "node.ha_state", "node.set", "ha.status") and arrive through the same dispatcher
as every other topic. They are not `Message`s: Home Assistant's buttons and switches cannot
send a `schema_version`, and a payload carrying one is refused like any unknown field. Every
command is bounded (at most `COMMAND_MAX_BYTES`, short identifiers only) and validated
strictly; a retained command is ignored (and cleared) by the dispatcher, so a retained
`{"action": "pause"}` cannot pause a job again on every restart.

All topics are relative to the base topic ("xronos"). Every state field is always present (null
when unknown) because the discovery templates read `value_json.<field>` and Home Assistant
shows a template that renders "None" as `unknown`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from xronos.common.errtext import reason

from .messages import DataFormat, Phase, Task

GATEWAY_STATE = "gateway/state"  # GatewayHAState, retained, gateway → HA
GATEWAY_SET = "gateway/set"  # GatewayCommand, HA → gateway
NODE_STATE = "node/{node_id}/state"  # NodeHAState, retained, node → HA
NODE_SET = "node/{node_id}/set"  # NodeCommand, HA → node
COMMAND_MAX_BYTES = 1024  # a command is a few dozen bytes; anything larger is refused unread
STATE_TEXT_MAX = 255  # Home Assistant refuses a state longer than 255 characters

HAPhase = Literal["idle"] | Phase  # "idle": no job yet
Percent = Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Text = Annotated[str, Field(max_length=STATE_TEXT_MAX)]
Id = Annotated[str, Field(min_length=1, max_length=256)]
# A job spec in the gateway's job_dir, by file name without .toml/.yaml/.yml.
SpecName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
NodeId = Annotated[str, Field(pattern=r"^[a-z0-9_-]{1,64}$")]


class HAStatus(StrEnum):
    """Home Assistant's birth and last-will on `{discovery_prefix}/status` (plain text)."""

    ONLINE = "online"
    OFFLINE = "offline"


class _HAModel(BaseModel):
    # Decoded with strict=True by the codec: "true" is not true, 1 is not "1".
    model_config = ConfigDict(frozen=True, extra="forbid")


# --- the job form (gateway/homeassistant/form.py): what Home Assistant's selects and numbers hold ---------
GGUFChoice = Literal["none", "f32", "f16", "q8_0"]  # the GGUF file to write beside the export
FormField = Literal["owner", "model", "data", "task", "data_format", "steps", "epochs", "lora_r", "batch_size",
                    "seq_len", "lr", "gguf"]
FormPath = Annotated[str, Field(min_length=1, max_length=STATE_TEXT_MAX)]  # a select option (HA: <= 255)
FormValue = Annotated[str, Field(max_length=STATE_TEXT_MAX)] | int | float  # strict: no "3" for 3
# The numbers' ranges: the form's bounds and Home Assistant's number entities' min/max/step.
FORM_NUMBERS: dict[str, tuple[float, float, float]] = {
    "steps": (0, 1_000_000, 1),  # 0: by epochs only
    "epochs": (0, 1000, 1),  # 0: by steps only
    "lora_r": (0, 1024, 1),  # 0: full fine-tune
    "batch_size": (1, 512, 1),
    "seq_len": (16, 8192, 16),
    "lr": (1e-7, 1.0, 1e-6),
}


def _rng(name: str, kind: type) -> Any:
    lo, hi, _ = FORM_NUMBERS[name]
    return Annotated[kind, Field(ge=kind(lo), le=kind(hi), allow_inf_nan=False) if kind is float
                     else Field(ge=int(lo), le=int(hi))]


class JobForm(_HAModel):
    """The job Home Assistant's Start training button submits (gateway/homeassistant/form.py makes the JobSpec).
    `owner`, `model` and `data` must be among what the owner reports (NodeCatalog): checked there,
    at every change and again at Start."""

    owner: NodeId | None = None
    model: FormPath | None = None
    data: FormPath | None = None
    task: Task = "causal-lm"
    data_format: DataFormat = "text"
    steps: _rng("steps", int) = 100
    epochs: _rng("epochs", int) = 0
    lora_r: _rng("lora_r", int) = 8
    batch_size: _rng("batch_size", int) = 4
    seq_len: _rng("seq_len", int) = 128
    lr: _rng("lr", float) = 2e-4
    gguf: GGUFChoice = "none"


class GatewayHAState(_HAModel):
    """The current (or last) job as Home Assistant shows it on the gateway device."""

    job_id: Id | None = None
    job_name: Id | None = None
    phase: HAPhase = "idle"
    step: Annotated[int, Field(ge=0)] | None = None
    total_steps: Annotated[int, Field(ge=0)] | None = None
    steps: Text | None = None  # "30 / 120", the Step sensor
    progress_pct: Percent | None = None
    loss: Finite | None = None  # never NaN/inf: HA's JSON parser rejects them
    eval_metric: Finite | None = None
    eval_metric_name: Text | None = None
    iteration_s: Seconds | None = None
    eta_s: Seconds | None = None
    finish_at: Text | None = None  # ISO 8601 UTC, the Finish time sensor (device_class timestamp)
    slowest_node: Text | None = None  # node with the longest measured iteration compute time
    idle_ratio_pct: Percent | None = None  # mean over the job's nodes of idle / iteration time
    nodes_online: Annotated[int, Field(ge=0)] = 0
    error: Text | None = None  # why the current job failed, or why the last submit was refused
    selected_spec: SpecName | None = None  # the job spec the Start button starts
    # How the job trains, from its JobSpec (see job_setup): the Task, Data format and LoRA rank sensors.
    task: Task | None = None  # classify | causal-lm
    data_format: DataFormat | None = None  # text | chat | prompt-completion
    lora_r: Annotated[int, Field(ge=1)] | None = None  # None: full fine-tuning (or no job)
    lora_targets: Text | None = None  # "q_proj,v_proj", or "default" (the model family's, peft's)
    last_command: Text | None = None  # e.g. "pause: ok" or "resume: error: no paused job"
    # Live re-balancing (JobState.replans, .last_replan_reason): the Re-plans and Last re-plan sensors.
    replans: Annotated[int, Field(ge=0)] | None = None
    last_replan: Text | None = None
    # The running plan's parallelism ("segment", "dp (4 replicas)", "dp (2 groups of TP 2)") and the
    # strategy the job asked for ("auto" or a forced one): the Parallelism sensor and its attribute.
    strategy: Text | None = None
    strategy_asked: Text | None = None
    # The job's eval metric before training (after: eval_metric) and where the owner wrote its
    # export (the GGUF file, when asked for, beside it): the Metric before and Export sensors.
    eval_initial: Finite | None = None
    export_dir: Text | None = None
    export_gguf: GGUFChoice | None = None
    form: JobForm = JobForm()  # the job form's values (its selects and numbers read them)
    updated_at: Finite


class NodeHAState(_HAModel):
    """One node as Home Assistant shows it. Published by the node itself."""

    participate: bool
    job_id: Id | None = None  # the job this node is assigned to, if any
    # This node's share of each segment kind (see node_share): attention units held (and the
    # model's total), and the percentage of attention units, MLP columns and vocabulary rows.
    attn: Annotated[int, Field(ge=0)] | None = None
    attn_total: Annotated[int, Field(ge=0)] | None = None
    attn_pct: Percent | None = None
    mlp_pct: Percent | None = None
    vocab_pct: Percent | None = None
    compute_pct: Percent | None = None  # share of the last iteration spent computing
    idle_pct: Percent | None = None  # share of the last iteration spent waiting for peers
    cpu_temp_c: Finite | None = None
    updated_at: Finite


GatewayAction = Literal["pause", "resume", "cancel", "start", "select", "remove_node", "set", "start_form",
                        "refresh"]


class GatewayCommand(_HAModel):
    """HA → gateway.

    - `pause` / `resume` / `cancel`: the current job (the newest one not yet finished).
    - `start`: submit the job spec `spec` from the gateway's job_dir (default: the selected one).
    - `select`: choose the spec the Start button starts (`spec` required).
    - `remove_node`: forget the offline node `node_id` (its retained state and HA device).
    - `set`: one field of the job form (`field`, `value`), checked before it is kept.
    - `start_form`: submit the job form, with `form`'s values over it (an automation's one-message
      start); every value checked again, nothing submitted if any is refused.
    - `refresh`: ask every online node for its catalog (model directories and data files) now.
    """

    action: GatewayAction
    spec: SpecName | None = None
    node_id: NodeId | None = None
    field: FormField | None = None
    value: FormValue | None = None
    form: Annotated[dict[FormField, FormValue], Field(max_length=12)] | None = None

    @model_validator(mode="after")
    def _fields_fit_action(self) -> GatewayCommand:
        if self.action == "select" and self.spec is None:
            raise ValueError("select: needs 'spec'")
        if self.action == "remove_node" and self.node_id is None:
            raise ValueError("remove_node: needs 'node_id'")
        if self.spec is not None and self.action not in ("start", "select"):
            raise ValueError(f"{self.action}: takes no 'spec'")
        if self.node_id is not None and self.action != "remove_node":
            raise ValueError(f"{self.action}: takes no 'node_id'")
        if self.action == "set" and (self.field is None or self.value is None):
            raise ValueError("set: needs 'field' and 'value'")
        if (self.field is not None or self.value is not None) and self.action != "set":
            raise ValueError(f"{self.action}: takes no 'field' or 'value'")
        if self.form is not None and self.action != "start_form":
            raise ValueError(f"{self.action}: takes no 'form'")
        return self


class NodeCommand(_HAModel):
    """HA → node: switch participation; a node switched off leaves the next plan."""

    participate: bool


def parse_command(model: type[GatewayCommand] | type[NodeCommand], payload: bytes,
                  topic: str) -> GatewayCommand | NodeCommand:
    """Decode a command payload; ValueError naming the topic and the problem."""
    if len(payload) > COMMAND_MAX_BYTES:
        raise ValueError(f"{topic}: {len(payload)} bytes exceeds the {COMMAND_MAX_BYTES}-byte command cap")
    try:
        return model.model_validate_json(payload, strict=True)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'payload'}: {reason(e)}" for e in exc.errors()
        )
        raise ValueError(f"{topic}: bad {model.__name__} payload {payload[:200]!r}: {problems}") from None


def iteration_shares(compute_s: float, idle_s: float, iteration_s: float) -> tuple[float, float]:
    """(compute_pct, idle_pct) of one iteration, for NodeHAState; clamped into [0, 100]."""
    if not iteration_s > 0:
        return 0.0, 0.0
    return _pct(compute_s / iteration_s), _pct(idle_s / iteration_s)


def node_share(assignment: Any) -> dict[str, Any]:
    """NodeHAState's share fields for a node's assignment (all None without one): the one place
    that reads the assignment's per-segment layout for Home Assistant."""
    if assignment is None:
        return dict(attn=None, attn_total=None, attn_pct=None, mlp_pct=None, vocab_pct=None)
    lay, r = assignment.layout, assignment.rank
    r %= lay.world_size  # with shares the layout is each data-parallel group's: this node's TP rank in it
    return dict(attn=lay.attn[r], attn_total=sum(lay.attn), attn_pct=_pct(lay.share("attn", r)),
                mlp_pct=_pct(lay.share("mlp", r)), vocab_pct=_pct(lay.share("vocab", r)))


def job_setup(spec: Any) -> dict[str, Any]:
    """GatewayHAState's fields that say how the job trains, from its JobSpec (all None without
    one): the one place that reads the job spec for Home Assistant. A spec option shown in Home
    Assistant is a key here, a field of GatewayHAState and a sensor in
    `homeassistant.gateway_discovery` reading that field."""
    if spec is None:
        return dict(task=None, data_format=None, lora_r=None, lora_targets=None)
    r = spec.recipe
    targets = None if r.lora is None else ",".join(r.lora.targets) if r.lora.targets else "default"
    return dict(task=r.task, data_format=r.data_format, lora_r=r.lora and r.lora.r, lora_targets=targets)


def same_state(a: BaseModel | None, b: BaseModel | None) -> bool:
    """Two states that differ only in updated_at: nothing to publish."""
    if a is None or b is None:
        return a is b
    return a.model_dump(exclude={"updated_at"}) == b.model_dump(exclude={"updated_at"})


def _pct(fraction: float) -> float:
    return min(100.0, max(0.0, 100.0 * fraction))
