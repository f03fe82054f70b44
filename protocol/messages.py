"""Every message on the Xronos control plane: one frozen, strict pydantic model per message.

Strict mode means no coercion ("3" is not 3, true is not 1); the codec validates decoded
JSON/msgpack with `strict=True`. The only wire form strict mode would refuse is a tuple arriving
as a list (neither JSON nor msgpack has tuples), so tuple fields accept a list of the right length.
Sizes are bytes, times are seconds (float), timestamps are Unix seconds.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, model_validator

from .layout import Kind, Layout, LayoutError, Sizes

# 2: the per-segment layout (Assignment.layout, Plan entries per kind, ProfileReport.sizes).
SCHEMA_VERSION = 2

Task = Literal["classify", "causal-lm"]
Strategy = Literal["segment", "paper", "uniform"]
Phase = Literal[
    "queued", "profiling", "planning", "assigning", "running",
    "paused", "recovering", "completed", "failed", "cancelled",
]
NonNegInt = Annotated[int, Field(ge=0)]
PosInt = Annotated[int, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
Name = Annotated[str, Field(min_length=1, max_length=256)]


def _list_to_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


Sample = Annotated[tuple[float, float], BeforeValidator(_list_to_tuple)]


class Message(BaseModel):
    # ser_json_inf_nan="constants": a diverged loss (NaN) must survive a JSON round trip.
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", ser_json_inf_nan="constants")
    schema_version: Literal[2] = 2


class Availability(StrEnum):
    """Plain-text payload of the availability topics (Zigbee2MQTT style), not a model."""

    ONLINE = "online"
    OFFLINE = "offline"


class ArchSpec(Message):
    family: Literal["gpt2", "bert", "roberta", "llama"]
    hidden_size: PosInt
    num_layers: PosInt
    num_heads: PosInt
    num_kv_heads: PosInt
    intermediate_size: PosInt
    vocab_size: PosInt
    max_positions: PosInt
    num_labels: PosInt | None = None
    tie_word_embeddings: bool

    def sizes(self) -> Sizes:
        """Totals per segment kind: attention units (KV heads: a GQA unit is one KV head with its
        query heads), MLP columns, vocabulary rows."""
        return Sizes(attn=self.num_kv_heads, mlp=self.intermediate_size, vocab=self.vocab_size)


class Capabilities(Message):
    node_id: Name
    hostname: str
    arch: str
    cpu_model: str
    cores: PosInt
    memory_total: NonNegInt
    memory_available: NonNegInt
    torch_version: str | None
    data_host: str
    participate: bool = True
    cpu_temp_c: float | None = None
    sent_at: float


class ProfileRequest(Message):
    request_id: Name
    job_id: Name
    arch: ArchSpec
    task: Task
    batch_size: PosInt
    seq_len: PosInt
    threads: PosInt | None = None
    # The job's optimizer settings: decoupled weight decay and the clipping pass each add a pass
    # over every parameter, which the profile must time as the trainer will run it.
    weight_decay: NonNegFloat = 0.0
    clip: bool = True


class LayerProfile(Message):
    name: str
    kind: Literal["emb", "blk", "out"]
    partitioned: bool
    # Which segment kind a partitioned layer's width follows (None for a replicated layer); its
    # time_samples are (share of that kind, seconds).
    segment: Kind | None = None
    time_s: NonNegFloat
    time_samples: list[Sample]
    weight_bytes: NonNegInt
    activation_bytes: NonNegInt
    temp_bytes: NonNegInt

    @model_validator(mode="after")
    def _enough_samples(self) -> LayerProfile:
        if self.partitioned != (self.segment is not None):
            raise ValueError(f"segment: layer {self.name!r} is {'' if self.partitioned else 'not '}"
                             f"partitioned, so its segment must {'' if self.partitioned else 'not '}be set")
        if self.partitioned and len(self.time_samples) < 2:
            raise ValueError(
                f"time_samples: partitioned layer {self.name!r} needs >= 2 (ratio, seconds) "
                f"samples for the affine fit, got {len(self.time_samples)}"
            )
        return self


class ProfileReport(Message):
    node_id: Name
    request_id: Name
    job_id: Name
    capabilities: Capabilities
    arch: ArchSpec
    task: Task
    batch_size: PosInt
    seq_len: PosInt
    threads: PosInt | None
    sizes: Sizes
    num_blocks: PosInt
    layers: list[LayerProfile]
    profile_seconds: NonNegFloat
    created_at: float


class JobSpec(Message):
    name: Name
    owner: Name
    model_dir: str
    data_path: str
    task: Task
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"
    batch_size: PosInt
    seq_len: PosInt
    lr: Annotated[float, Field(gt=0)]
    epochs: PosInt | None = None
    max_steps: PosInt | None = None
    eval_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.1
    strategy: Strategy = "segment"
    checkpoint_interval: PosInt = 100
    export_dir: str
    nodes: list[Name] | None = None
    reserve_mb: NonNegInt = 512
    seed: int = 0
    warmup_steps: NonNegInt = 0
    weight_decay: NonNegFloat = 0.0
    max_grad_norm: Annotated[float, Field(gt=0)] | None = 1.0
    dropout: Annotated[float, Field(ge=0, lt=1)] | None = None

    @model_validator(mode="after")
    def _has_length(self) -> JobSpec:
        if self.epochs is None and self.max_steps is None:
            raise ValueError("epochs/max_steps: at least one must be set")
        return self


class PlanEntry(Message):
    node_id: Name
    rank: NonNegInt
    # This node's count of each segment kind (attention units, MLP columns, vocabulary rows).
    attn: NonNegInt
    mlp: NonNegInt
    vocab: NonNegInt
    predicted_compute_s: NonNegFloat
    predicted_memory: NonNegFloat
    memory_cap: NonNegFloat


class Plan(Message):
    job_id: Name
    version: NonNegInt
    strategy: Strategy
    sizes: Sizes
    entries: list[PlanEntry]
    predicted_iteration_s: NonNegFloat
    ideal_iteration_s: NonNegFloat
    comm_s: NonNegFloat

    @model_validator(mode="after")
    def _covers_model(self) -> Plan:
        if [e.rank for e in self.entries] != list(range(len(self.entries))):
            raise ValueError(f"entries: ranks must be 0..N-1 in order, got {[e.rank for e in self.entries]}")
        if self.entries:
            try:
                self.layout().check(self.sizes, quanta=None)
            except LayoutError as exc:
                raise ValueError(f"entries: {exc}") from None
        return self

    def layout(self) -> Layout:
        """The entries' counts as a Layout (rank order)."""
        return Layout(attn=tuple(e.attn for e in self.entries), mlp=tuple(e.mlp for e in self.entries),
                      vocab=tuple(e.vocab for e in self.entries))


class Assignment(Message):
    job_id: Name
    plan_version: NonNegInt
    node_id: Name
    rank: NonNegInt
    world_size: PosInt
    rendezvous_host: str
    rendezvous_port: Annotated[int, Field(gt=0, lt=65536)]
    layout: Layout  # every rank's counts per segment kind; this node's ranges follow from `rank`
    spec: JobSpec
    resume_step: NonNegInt = 0

    @model_validator(mode="after")
    def _consistent(self) -> Assignment:
        if self.rank >= self.world_size:
            raise ValueError(f"rank: {self.rank} is not below world_size {self.world_size}")
        if self.layout.world_size != self.world_size:
            raise ValueError(f"layout: {self.layout.world_size} ranks for world_size {self.world_size}")
        return self


class AssignmentAck(Message):
    job_id: Name
    plan_version: NonNegInt
    node_id: Name
    accepted: bool
    reason: str | None = None


class _Control(Message):
    job_id: Name
    plan_version: NonNegInt


class JobStart(_Control):
    action: Literal["start"] = "start"


class JobPause(_Control):
    action: Literal["pause"] = "pause"


class JobResume(_Control):
    action: Literal["resume"] = "resume"


class JobCancel(_Control):
    action: Literal["cancel"] = "cancel"


JobControl = Annotated[Union[JobStart, JobPause, JobResume, JobCancel], Field(discriminator="action")]


class IterationMetrics(Message):
    job_id: Name
    plan_version: NonNegInt
    node_id: Name
    rank: NonNegInt
    step: NonNegInt
    epoch: NonNegInt
    loss: float
    compute_s: NonNegFloat
    comm_s: NonNegFloat
    idle_s: NonNegFloat
    iteration_s: NonNegFloat
    voluntary_ctx_switches: NonNegInt
    involuntary_ctx_switches: NonNegInt
    peak_rss: NonNegInt
    # compute_s split by segment kind (attention, MLP, vocabulary, the rest); they sum to compute_s
    compute_attn_s: NonNegFloat | None = None
    compute_mlp_s: NonNegFloat | None = None
    compute_vocab_s: NonNegFloat | None = None
    compute_rest_s: NonNegFloat | None = None


class JobState(Message):
    job_id: Name
    name: str
    phase: Phase
    step: NonNegInt = 0
    total_steps: NonNegInt | None = None
    epoch: NonNegInt = 0
    loss: float | None = None
    eval_metric: float | None = None
    eval_metric_name: str | None = None
    iteration_s: NonNegFloat | None = None
    idle_ratio: dict[str, float] = Field(default_factory=dict)
    predicted_s: dict[str, float] = Field(default_factory=dict)
    measured_s: dict[str, float] = Field(default_factory=dict)
    eta_s: NonNegFloat | None = None
    plan: Plan | None = None
    events: list[str] = Field(default_factory=list)
    updated_at: float
    error: str | None = None


class InspectRequest(Message):
    """Gateway → owner at submit time: can you run this job (paths, model, dataset)?"""

    request_id: Name
    job_id: Name
    spec: JobSpec


class InspectReport(Message):
    node_id: Name
    request_id: Name
    job_id: Name
    ok: bool
    arch: ArchSpec | None = None
    train_rows: NonNegInt | None = None
    eval_rows: NonNegInt | None = None
    total_steps: NonNegInt | None = None
    error: str | None = None


class NodeJobStatus(Message):
    """A node's view of its current job (retained): what a restarted gateway reconciles from."""

    node_id: Name
    job_id: Name
    plan_version: NonNegInt
    rank: NonNegInt
    status: Literal["accepted", "running", "paused", "completed", "failed", "cancelled"]
    step: NonNegInt = 0
    epoch: NonNegInt = 0
    checkpoint_step: NonNegInt | None = None
    eval_metric: float | None = None
    eval_metric_name: str | None = None
    eval_initial: float | None = None
    export_dir: str | None = None
    detail: str | None = None
    sent_at: float


class ErrorResponse(Message):
    code: str
    message: str
    topic: str | None = None


# --- Gateway requests/responses (Zigbee2MQTT style, JSON) -------------------------------------

Transaction = Annotated[str, Field(max_length=256)] | None


class GatewayRequest(Message):
    transaction: Transaction = None


class JobSubmitRequest(GatewayRequest):
    spec: JobSpec


class JobStatusRequest(GatewayRequest):
    job_id: Name | None = None  # None = every job


class JobPauseRequest(GatewayRequest):
    job_id: Name


class JobResumeRequest(GatewayRequest):
    job_id: Name


class JobCancelRequest(GatewayRequest):
    job_id: Name


class NodesListRequest(GatewayRequest):
    pass


class PlanPreviewRequest(GatewayRequest):
    spec: JobSpec


class GatewayResponse(Message):
    status: Literal["ok", "error"]
    data: dict[str, Any] | list[Any] | None = None
    error: str | None = None
    transaction: Transaction = None

    @model_validator(mode="after")
    def _error_has_text(self) -> GatewayResponse:
        if self.status == "error" and not self.error:
            raise ValueError("error: an error response needs an error text")
        return self


REQUEST_MODELS: dict[str, type[GatewayRequest]] = {
    "job/submit": JobSubmitRequest,
    "job/status": JobStatusRequest,
    "job/pause": JobPauseRequest,
    "job/resume": JobResumeRequest,
    "job/cancel": JobCancelRequest,
    "nodes/list": NodesListRequest,
    "plan/preview": PlanPreviewRequest,
}

JobControlAdapter: TypeAdapter[JobStart | JobPause | JobResume | JobCancel] = TypeAdapter(JobControl)
