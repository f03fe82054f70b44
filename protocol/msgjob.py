"""Messages of a job's life: its spec, the owner's inspection of it, the plan, each node's
assignment and ack, and the gateway's controls of the running ranks (`JobControl`, one union on the
control topic). Re-exported by `xronos.protocol.messages`."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, TypeAdapter, ValidationInfo, model_validator

from .layout import Layout, LayoutError, Sizes
from .msgnode import ArchSpec
from .msgtypes import (
    MAX_NODES, BatchSize, ByteFloat, Column, Count, DataFormat, Decay, Epochs, Fraction, GGUFType, GradNorm, HostName, Id,
    LearningRate, LoraAlpha, LoraRank, LoraTarget, Megabytes, Message, Name, NonNegInt, PathText, Rank, Seconds,
    Seed, SeqLen, StepCount, Steps, Strategy, Task, Text4k, Text256, UnitCount, WorldSize,
)


# Validation context key (`model_validate(..., context={STORED: True})`): the data comes from this
# gateway's own job table, written by an earlier version, not from a sender.
STORED = "stored"


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
    # on the answer tokens only (xronos.node.data.batches).
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
    # GGUF for llama.cpp / Ollama (causal LMs of the llama, qwen2, qwen3 and gpt2 families): the
    # owner also writes <export_dir>/model-<type>.gguf (under LoRA: of the merged model) and an
    # Ollama Modelfile beside it (xronos.node.models.gguf). The family is checked at inspection.
    export_gguf: GGUFType | None = None
    # Live re-balancing (issue 14): the gateway re-plans from the ranks' measured per-kind compute
    # and re-shards the running job at an iteration boundary when the predicted gain repays the move.
    # On by default: a job runs on boxes whose other work changes their speed, the case it is for.
    rebalance: bool = True

    @model_validator(mode="after")
    def _has_length(self, info: ValidationInfo) -> JobSpec:
        if self.epochs is None and self.max_steps is None:
            raise ValueError("epochs/max_steps: at least one must be set")
        if self.lora_r is None:
            # By value, not by model_fields_set: every spec that crossed the wire or the job store has
            # all its fields set, and the defaults are what a full fine-tune carries (as `xronos run`).
            # A job table written before alpha and dropout were checked still loads (STORED): its jobs
            # ran as full fine-tunes, and a gateway must not refuse to start over them.
            fields = type(self).model_fields
            checked = ("lora_targets", "export_merged") if (info.context or {}).get(STORED) else \
                ("lora_alpha", "lora_dropout", "lora_targets", "export_merged")
            given = [f for f in checked if getattr(self, f) != fields[f].default]
            if given:
                raise ValueError(f"{', '.join(given)}: set without lora_r (LoRA); without it the job "
                                 "fine-tunes every weight and trains no adapters")
        if self.data_format != "text" and self.task != "causal-lm":
            raise ValueError(f"data_format: {self.data_format!r} is a causal-lm format, not one for task {self.task!r}")
        if self.export_gguf is not None and self.task != "causal-lm":
            raise ValueError(f"export_gguf: {self.export_gguf!r} asked of task {self.task!r}; llama.cpp runs language "
                             "models, so GGUF export is for task 'causal-lm'")
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
    # The world's key (32 random bytes, hex; one per plan version): the ranks prove it to each
    # other right after joining, so a stranger at the rendezvous port gets no data
    # (node/tp/groupkey.py). Never logged, never retained; kept out of reprs.
    group_key: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", repr=False)]

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
    late); the owner broadcasts it to every rank through the job's group (`xronos.node.rank.jobrank`)."""

    action: Literal["reshard"] = "reshard"
    at_step: Count
    layout: Layout
    reason: Text256


JobControl = Annotated[Union[JobStart, JobPause, JobResume, JobCancel, JobReshard], Field(discriminator="action")]

JobControlAdapter: TypeAdapter[JobStart | JobPause | JobResume | JobCancel] = TypeAdapter(JobControl)


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

