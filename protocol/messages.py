"""Every message on the Xronos control plane: one frozen, strict pydantic model per message.

Strict mode means no coercion ("3" is not 3, true is not 1); the codec validates decoded
JSON/msgpack with `strict=True`. The only wire form strict mode would refuse is a tuple arriving
as a list (neither JSON nor msgpack has tuples), so tuple fields accept a list of the right length.
Sizes are bytes, times are seconds (float), timestamps are Unix seconds.

Nothing from the network is trusted, so every field is bounded here, where it arrives: integers
have ranges (none beyond 2**53, so every value survives msgpack, JSON and float arithmetic),
floats are finite unless a non-finite value means something (a diverged loss), every string has a
maximum length and must be valid Unicode (a lone UTF-16 surrogate, which JSON can carry but no
encoder can send on, is refused with the field named), lists and dicts have maximum sizes, and
identifiers (node, job and request ids) are plain `[A-Za-z0-9_][A-Za-z0-9_.-]*`, safe as a topic
level and as a file name.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, model_validator

from .layout import Kind, Layout, LayoutError, Sizes

# 2: the per-segment layout (Assignment.layout, Plan entries per kind, ProfileReport.sizes).
SCHEMA_VERSION = 2

Task = Literal["classify", "causal-lm"]
Strategy = Literal["segment", "paper", "uniform"]
DataFormat = Literal["text", "chat", "prompt-completion"]
Phase = Literal[
    "queued", "profiling", "planning", "assigning", "running",
    "paused", "recovering", "completed", "failed", "cancelled",
]
# --- bounds --------------------------------------------------------------------------------------
MAX_INT = 2**53  # every integer on the wire: exact in JSON/float, encodable in msgpack
MAX_NODES = 256  # nodes of one plan, ranks of one job
MAX_ID = 128
MAX_TEXT = 4096  # free text: errors, reasons, details
MAX_PATH = 4096
MAX_SECONDS = 1e7  # ~115 days: any duration a message reports
MAX_PERCENT = 1e6  # a prediction error in percent (10,000x off is still a number, not noise)
MAX_TIMESTAMP = 1e11  # Unix seconds (year ~5138)
MAX_BYTES = float(2**60)  # memory sizes as floats
MAX_EVENTS = 50

_SURROGATE = re.compile("[\ud800-\udfff]")
_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def valid_text(value: Any) -> Any:
    """Refuse text no encoder can send on: a lone UTF-16 surrogate (JSON's "\\ud800" decodes to
    one; msgpack and UTF-8 cannot carry it). Runs before the str validation, so the error says why."""
    if isinstance(value, str):
        bad = _SURROGATE.search(value)
        if bad:
            raise ValueError(f"not valid Unicode: lone surrogate U+{ord(bad.group()):04X} at index {bad.start()}")
    return value


def _valid_id(value: str) -> str:
    if not _ID.fullmatch(value):
        shown = value[:40].encode("ascii", "backslashreplace").decode()
        raise ValueError(f"must be [A-Za-z0-9_][A-Za-z0-9_.-]* (a topic level and a file name), got {shown!r}")
    return value


def _path_text(value: str) -> str:
    if "\0" in value:
        raise ValueError("a path may not contain NUL")
    return value


def Text(max_length: int = MAX_TEXT, min_length: int = 0) -> Any:  # noqa: N802 (a type factory)
    """A bounded, valid-Unicode string type."""
    return Annotated[str, Field(min_length=min_length, max_length=max_length), BeforeValidator(valid_text)]


def Int(ge: int | None = 0, le: int = MAX_INT, *, gt: int | None = None) -> Any:  # noqa: N802
    """A bounded int (`gt=0` for a positive one: its error says "greater than 0", as before)."""
    return Annotated[int, Field(ge=None if gt is not None else ge, gt=gt, le=le)]


def Float(ge: float | None = None, le: float | None = None, *, gt: float | None = None,
          lt: float | None = None) -> Any:  # noqa: N802
    """A finite float with bounds (strict mode still accepts an int within them)."""
    return Annotated[float, Field(ge=ge, le=le, gt=gt, lt=lt, allow_inf_nan=False)]


NonNegInt = Int()
PosInt = Int(gt=0)
Count = Int(le=2**31 - 1)  # steps, epochs, versions, context switches
NonNegFloat = Float(ge=0, le=MAX_BYTES)
Seconds = Float(ge=0, le=MAX_SECONDS)
Timestamp = Float(ge=0, le=MAX_TIMESTAMP)
Bytes = Int(le=2**50)  # memory and sizes in bytes (1 PiB)
ByteFloat = Float(ge=0, le=MAX_BYTES)
Rank = Int(le=MAX_NODES - 1)
WorldSize = Int(gt=0, le=MAX_NODES)
Ratio = Float(ge=0, le=1)
# A metric that may legitimately be NaN or infinite (a diverged loss, its perplexity).
Metric = float
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID), BeforeValidator(valid_text), AfterValidator(_valid_id)]
Name = Text(256, min_length=1)
Label = Text(256)  # column names, metric names, short labels
Host = Text(255)
PathText = Annotated[str, Field(min_length=1, max_length=MAX_PATH), BeforeValidator(valid_text),
                     AfterValidator(_path_text)]
Dim = Int(gt=0, le=2**20)  # a model dimension (hidden, intermediate, heads, layers, positions)
Text256 = Text(256)
Text4k = Text(MAX_TEXT)
Event = Text(1024)
Temperature = Float(ge=-273.15, le=1000)
Layers = Int(gt=0, le=1024)
Threads = Int(gt=0, le=4096)
Heads = Int(gt=0, le=4096)
Vocab = Int(gt=0, le=2**23)
Positions = Int(gt=0, le=2**22)
Labels = Int(gt=0, le=2**16)
Cores = Int(gt=0, le=65536)
BatchSize = Int(gt=0, le=65536)
SeqLen = Int(gt=0, le=2**20)
UnitCount = Int(le=2**20)
Decay = Float(ge=0, le=100)
LayerName = Text(128, min_length=1)
Column = Text(256, min_length=1)
LearningRate = Float(gt=0, le=100)
Epochs = Int(gt=0, le=10**6)
Steps = Int(gt=0, le=10**9)
StepCount = Int(le=10**9)
Fraction = Float(ge=0, lt=1)
Megabytes = Int(le=2**30)
Seed = Int(le=2**32 - 1)
GradNorm = Float(gt=0, le=1e9)
HostName = Text(255, min_length=1)
Eta = Float(ge=0, le=MAX_INT)
Percent = Float(ge=0, le=MAX_PERCENT)
Code = Text(64, min_length=1)
TopicText = Text(1024)
LoraRank = Int(gt=0, le=65536)
LoraAlpha = Float(gt=0, le=1e6)
LoraTarget = Text(64, min_length=1)


def _list_to_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


Sample = Annotated[tuple[Ratio, Seconds], BeforeValidator(_list_to_tuple)]


class Message(BaseModel):
    # ser_json_inf_nan="constants": a diverged loss (NaN) must survive a JSON round trip.
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", ser_json_inf_nan="constants")
    schema_version: Literal[2] = 2


class Availability(StrEnum):
    """Plain-text payload of the availability topics (Zigbee2MQTT style), not a model."""

    ONLINE = "online"
    OFFLINE = "offline"


class ArchSpec(Message):
    family: Literal["gpt2", "bert", "roberta", "llama", "qwen2", "qwen3"]
    hidden_size: Dim
    num_layers: Layers
    num_heads: Heads
    num_kv_heads: Heads
    intermediate_size: Dim
    vocab_size: Vocab
    max_positions: Positions
    num_labels: Labels | None = None
    tie_word_embeddings: bool

    def sizes(self) -> Sizes:
        """Totals per segment kind: attention units (KV heads: a GQA unit is one KV head with its
        query heads), MLP columns, vocabulary rows."""
        return Sizes(attn=self.num_kv_heads, mlp=self.intermediate_size, vocab=self.vocab_size)


class Capabilities(Message):
    node_id: Id
    hostname: Host
    arch: Label
    cpu_model: Label
    cores: Cores
    memory_total: Bytes
    memory_available: Bytes
    torch_version: Label | None
    data_host: Host
    participate: bool = True
    cpu_temp_c: Temperature | None = None
    sent_at: Timestamp


class ProfileRequest(Message):
    request_id: Id
    job_id: Id
    arch: ArchSpec
    task: Task
    batch_size: BatchSize
    seq_len: SeqLen
    threads: Threads | None = None
    # The job's optimizer settings: decoupled weight decay and the clipping pass each add a pass
    # over every parameter, which the profile must time as the trainer will run it.
    weight_decay: Decay = 0.0
    clip: bool = True
    # A LoRA job (JobSpec.lora_*): the profile trains adapters on a frozen base, as the job will.
    lora_r: LoraRank | None = None
    lora_targets: Annotated[list[LoraTarget], Field(min_length=1, max_length=16)] | None = None
    lora_dropout: Fraction = 0.0


class LayerProfile(Message):
    name: LayerName
    kind: Literal["emb", "blk", "out"]
    partitioned: bool
    # Which segment kind a partitioned layer's width follows (None for a replicated layer); its
    # time_samples are (share of that kind, seconds).
    segment: Kind | None = None
    time_s: Seconds
    time_samples: Annotated[list[Sample], Field(max_length=64)]
    weight_bytes: Bytes
    activation_bytes: Bytes
    temp_bytes: Bytes
    # The layer's largest single parameter at the profiled width (share 1), bytes: loading reads a
    # parameter's slice, then copies it in, and the freed buffer stays in the rank's heap.
    load_bytes: Bytes = 0
    # The layer's parameters at the profiled width, weights only (frozen ones too): with M_w it
    # tells the trained bytes apart (a LoRA job's frozen base has no gradient or moments).
    param_bytes: Bytes = 0

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


class CollectiveProfile(Message):
    """What one all-reduce costs this node's CPU (`xronos.node.commprobe`): two Gloo ranks in the
    profiling process over loopback, under the node's own CPU quota and threads, each all-reducing
    `nbytes` (the job's [batch, seq, hidden] activation) and `small_bytes`; means of `repeats`."""

    nbytes: Bytes
    seconds: Seconds
    small_bytes: Bytes
    small_seconds: Seconds
    repeats: Int(gt=0, le=10_000)

    @model_validator(mode="after")
    def _sizes(self) -> CollectiveProfile:
        if not self.small_bytes < self.nbytes:
            raise ValueError(f"small_bytes: must be below nbytes ({self.nbytes}), got {self.small_bytes}")
        return self


class ProfileReport(Message):
    node_id: Id
    request_id: Id
    job_id: Id
    capabilities: Capabilities
    arch: ArchSpec
    task: Task
    batch_size: BatchSize
    seq_len: SeqLen
    threads: Threads | None
    sizes: Sizes
    num_blocks: Layers
    layers: Annotated[list[LayerProfile], Field(max_length=64)]
    # The profiling process's resident set once warm (every library initialised by real training
    # iterations) and emptied of every model (freed pages handed back): what a training rank's
    # process holds besides its model; 0 = not measured (a report from before profiler version 6).
    runtime_bytes: Bytes = 0
    # What rank 0 (the owner: it reads the data) loads besides: the resident set the data stack's
    # import adds; 0 = not measured.
    owner_bytes: Bytes = 0
    profile_seconds: Seconds
    created_at: Timestamp
    # The node's CPU cost of the job's all-reduces (None: a profile from before it was measured;
    # the planner then counts the link alone).
    collectives: CollectiveProfile | None = None


class JobSpec(Message):
    name: Name
    owner: Id
    model_dir: PathText
    data_path: PathText
    task: Task
    text_column: Column = "text"
    text_pair_column: Column | None = None
    label_column: Column = "label"
    # How rows become training text: a text column (and pair), or for causal-lm a messages column
    # rendered with the tokenizer's chat template ("chat") or prompt/completion columns, the loss
    # on the answer tokens only (xronos.node.data).
    data_format: DataFormat = "text"
    messages_column: Column = "messages"
    prompt_column: Column = "prompt"
    completion_column: Column = "completion"
    batch_size: BatchSize
    seq_len: SeqLen
    lr: LearningRate
    epochs: Epochs | None = None
    max_steps: Steps | None = None
    eval_fraction: Fraction = 0.1
    strategy: Strategy = "segment"
    checkpoint_interval: Steps = 100
    export_dir: PathText
    nodes: Annotated[list[Id], Field(min_length=1, max_length=MAX_NODES)] | None = None
    reserve_mb: Megabytes = 512
    seed: Seed = 0
    warmup_steps: StepCount = 0
    weight_decay: Decay = 0.0
    max_grad_norm: GradNorm | None = 1.0
    dropout: Fraction | None = None
    # LoRA (lora_r None: full fine-tuning): adapters of rank lora_r on lora_targets (peft's module
    # names, e.g. q_proj; None: the family's default), scale lora_alpha / lora_r, dropout on their
    # input; the base frozen. The export is a PEFT adapter directory (adapter_config.json,
    # adapter_model.safetensors), and with export_merged also the merged model in <export_dir>/merged.
    lora_r: LoraRank | None = None
    lora_alpha: LoraAlpha = 16.0
    lora_dropout: Fraction = 0.0
    lora_targets: Annotated[list[LoraTarget], Field(min_length=1, max_length=16)] | None = None
    export_merged: bool = False
    # Live re-balancing (issue 14): the gateway re-plans from the ranks' measured per-kind compute
    # and re-shards the running job at an iteration boundary when the predicted gain repays the move.
    # On by default: a job runs on boxes whose other work changes their speed, the case it is for.
    rebalance: bool = True

    @model_validator(mode="after")
    def _has_length(self) -> JobSpec:
        if self.epochs is None and self.max_steps is None:
            raise ValueError("epochs/max_steps: at least one must be set")
        if self.lora_r is None and (self.lora_targets or self.export_merged):
            raise ValueError("lora_targets/export_merged: need lora_r (LoRA)")
        if self.data_format != "text" and self.task != "causal-lm":
            raise ValueError(f"data_format: {self.data_format!r} is a causal-lm format, not one for task {self.task!r}")
        return self


class PlanEntry(Message):
    node_id: Id
    rank: Rank
    # This node's count of each segment kind (attention units, MLP columns, vocabulary rows).
    attn: UnitCount
    mlp: UnitCount
    vocab: UnitCount
    predicted_compute_s: Seconds
    predicted_memory: ByteFloat
    memory_cap: ByteFloat


class Plan(Message):
    job_id: Id
    version: Count
    strategy: Strategy
    sizes: Sizes
    entries: Annotated[list[PlanEntry], Field(min_length=1, max_length=MAX_NODES)]
    predicted_iteration_s: Seconds
    # inf when nothing fits: the planner's honest "no bound" for an over-cap uniform plan.
    ideal_iteration_s: Annotated[float, Field(ge=0)]
    comm_s: Seconds

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
    job_id: Id
    plan_version: Count
    node_id: Id
    rank: Rank
    world_size: WorldSize
    rendezvous_host: HostName
    rendezvous_port: Annotated[int, Field(gt=0, lt=65536)]
    layout: Layout  # every rank's counts per segment kind; this node's ranges follow from `rank`
    spec: JobSpec
    resume_step: Count = 0

    @model_validator(mode="after")
    def _consistent(self) -> Assignment:
        if self.rank >= self.world_size:
            raise ValueError(f"rank: {self.rank} is not below world_size {self.world_size}")
        if self.layout.world_size != self.world_size:
            raise ValueError(f"layout: {self.layout.world_size} ranks for world_size {self.world_size}")
        return self


class AssignmentAck(Message):
    job_id: Id
    plan_version: Count
    node_id: Id
    accepted: bool
    reason: Text4k | None = None


class _Control(Message):
    job_id: Id
    plan_version: Count


class JobStart(_Control):
    action: Literal["start"] = "start"


class JobPause(_Control):
    action: Literal["pause"] = "pause"


class JobResume(_Control):
    action: Literal["resume"] = "resume"


class JobCancel(_Control):
    action: Literal["cancel"] = "cancel"


class JobReshard(_Control):
    """Gateway -> the owner (rank 0): move the running job to `layout` (same ranks) at the iteration
    boundary before step `at_step` (0-based; or the first boundary after it, when the order comes
    late); the owner broadcasts it to every rank through the job's group (`xronos.node.jobproc`)."""

    action: Literal["reshard"] = "reshard"
    at_step: Count
    layout: Layout
    reason: Text256


JobControl = Annotated[Union[JobStart, JobPause, JobResume, JobCancel, JobReshard], Field(discriminator="action")]


class IterationMetrics(Message):
    job_id: Id
    plan_version: Count
    node_id: Id
    rank: Rank
    step: Count
    epoch: Count
    loss: Metric  # NaN/inf: the run diverged, which is worth seeing
    compute_s: Seconds
    comm_s: Seconds
    idle_s: Seconds
    iteration_s: Seconds
    voluntary_ctx_switches: NonNegInt
    involuntary_ctx_switches: NonNegInt
    peak_rss: Bytes
    # compute_s split by segment kind (attention, MLP, vocabulary, the rest); they sum to compute_s
    compute_attn_s: Seconds | None = None
    compute_mlp_s: Seconds | None = None
    compute_vocab_s: Seconds | None = None
    compute_rest_s: Seconds | None = None


NodeFloats = Annotated[dict[Id, Seconds], Field(max_length=MAX_NODES)]  # per node: seconds or a ratio
NodeBytes = Annotated[dict[Id, Bytes], Field(max_length=MAX_NODES)]  # per node: bytes


class JobState(Message):
    job_id: Id
    name: Text256
    phase: Phase
    step: Count = 0
    total_steps: Count | None = None
    epoch: Count = 0
    loss: Metric | None = None
    eval_metric: Metric | None = None
    eval_metric_name: Text256 | None = None
    iteration_s: Seconds | None = None
    idle_ratio: NodeFloats = Field(default_factory=dict)
    predicted_s: NodeFloats = Field(default_factory=dict)  # compute seconds per iteration, per node
    measured_s: NodeFloats = Field(default_factory=dict)
    # Peak memory per node: the plan's prediction (the rank's peak resident set) and the highest
    # peak_rss its IterationMetrics reported under the current plan version.
    predicted_peak_bytes: NodeBytes = Field(default_factory=dict)
    peak_rss_bytes: NodeBytes = Field(default_factory=dict)
    # Communication per node: the plan's all-reduce time vs the node's measured comm_s.
    predicted_comm_s: NodeFloats = Field(default_factory=dict)
    measured_comm_s: NodeFloats = Field(default_factory=dict)
    compute_mape_pct: Percent | None = None  # over the nodes with both numbers
    comm_mape_pct: Percent | None = None
    eta_s: Eta | None = None
    plan: Plan | None = None
    # Live re-balancing: re-shards ordered so far (the plan's counts follow them) and the last
    # decision's reason (a re-plan's, or why the policy kept the plan).
    replans: Count = 0
    last_replan_reason: Text256 | None = None
    events: Annotated[list[Event], Field(max_length=MAX_EVENTS)] = Field(default_factory=list)
    updated_at: Timestamp
    error: Text4k | None = None


class InspectRequest(Message):
    """Gateway → owner at submit time: can you run this job (paths, model, dataset)?"""

    request_id: Id
    job_id: Id
    spec: JobSpec


class InspectReport(Message):
    node_id: Id
    request_id: Id
    job_id: Id
    ok: bool
    arch: ArchSpec | None = None
    train_rows: NonNegInt | None = None
    eval_rows: NonNegInt | None = None
    total_steps: Count | None = None
    error: Text4k | None = None


class NodeJobStatus(Message):
    """A node's view of its current job (retained): what a restarted gateway reconciles from."""

    node_id: Id
    job_id: Id
    plan_version: Count
    rank: Rank
    status: Literal["accepted", "running", "paused", "completed", "failed", "cancelled"]
    step: Count = 0
    epoch: Count = 0
    checkpoint_step: Count | None = None
    eval_metric: Metric | None = None
    eval_metric_name: Text256 | None = None
    eval_initial: Metric | None = None
    export_dir: PathText | None = None
    detail: Text4k | None = None
    # The owner's latest live re-shard (a JobReshard it applied): the boundary (before this 0-based
    # step), the layout every rank moved to, and the owner's wall time at that boundary.
    reshard_step: Count | None = None
    reshard_layout: Layout | None = None
    reshard_s: Seconds | None = None
    # The owner's latest refused JobReshard (wrong world, counts that do not fit the model): why.
    # The gateway then drops the order it had pending; the job goes on under its plan.
    reshard_refused: Text256 | None = None
    sent_at: Timestamp


class ErrorResponse(Message):
    code: Code
    message: Text4k
    topic: TopicText | None = None


# --- Gateway requests/responses (Zigbee2MQTT style, JSON) -------------------------------------

Transaction = Text256 | None


class GatewayRequest(Message):
    transaction: Transaction = None


class JobSubmitRequest(GatewayRequest):
    spec: JobSpec


class JobStatusRequest(GatewayRequest):
    job_id: Id | None = None  # None = every job


class JobPauseRequest(GatewayRequest):
    job_id: Id


class JobResumeRequest(GatewayRequest):
    job_id: Id


class JobCancelRequest(GatewayRequest):
    job_id: Id


class NodesListRequest(GatewayRequest):
    pass


class PlanPreviewRequest(GatewayRequest):
    spec: JobSpec


class GatewayResponse(Message):
    status: Literal["ok", "error"]
    data: dict[str, Any] | list[Any] | None = None
    error: Text4k | None = None
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
