"""Messages of a node about itself: its availability, its capabilities, and the profiles it measures
for a job's model (`ProfileRequest` -> `ProfileReport`). Re-exported by `xronos.protocol.messages`."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, model_validator

from .layout import Kind, Sizes
from .recipe import LoraShape, ProfileKey
from .msgtypes import (
    MAX_SECONDS, BatchSize, Bytes, Cores, Decay, Dim, Float, Fraction, Heads, Host, Id, Int, Label, LayerName, Labels, Layers,
    LoraRank, LoraTarget, Message, Positions, Sample, SeqLen, Seconds, Task, Temperature, Threads, Timestamp,
    Vocab,
)


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
    # What the node keeps for its device's day job (node.toml's reserve_mb): no plan goes into it,
    # whatever a job's own reserve_mb (the planner takes the larger of the two).
    reserve_bytes: Bytes = 0
    sent_at: Timestamp


class ProfileRequest(Message):
    request_id: Id
    job_id: Id
    arch: ArchSpec
    key: ProfileKey  # the job recipe's: what the profile depends on besides the model's shape
    threads: Threads | None = None


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
    """What one all-reduce costs this node's CPU (`xronos.node.measure.commprobe`): two Gloo ranks in the
    profiling process over loopback, under the node's own CPU quota and threads, each all-reducing
    `nbytes` (the job's [batch, seq, hidden] activation) and `small_bytes`; `repeats` calls of each,
    pooled over the probe's fresh pairs (profiler version 14 on; before it one pair's).
    `launched_*`: the CPU one rank pays for the same calls launched asynchronously beside its
    compute (what an overlapped call takes from that compute), medians; None in a report from
    before they were probed (the planner then charges a launched call as a blocking one)."""

    nbytes: Bytes
    seconds: Seconds
    small_bytes: Bytes
    small_seconds: Seconds
    repeats: Int(gt=0, le=10_000)
    launched_seconds: Seconds | None = None
    launched_small_seconds: Seconds | None = None

    @model_validator(mode="after")
    def _sizes(self) -> CollectiveProfile:
        if not self.small_bytes < self.nbytes:
            raise ValueError(f"small_bytes: must be below nbytes ({self.nbytes}), got {self.small_bytes}")
        if (self.launched_seconds is None) != (self.launched_small_seconds is None):
            raise ValueError("launched_seconds and launched_small_seconds: give both or neither")
        return self


class ProfileSettings(Message):
    """The job settings a profile was taken under, as its ProfileRequest named them. They change
    what is measured: decoupled weight decay and the clipping pass each add a pass over every
    parameter, and LoRA trains adapters on a frozen base (no gradient or AdamW moments on the base:
    less memory, less time), so a profile is the job's only at the job's settings. Every field is
    required: a report that records its settings records all of them (`lora` None: full
    fine-tuning)."""

    weight_decay: Decay
    clip: bool
    lora: LoraShape | None

    @classmethod
    def of_key(cls, key: ProfileKey) -> ProfileSettings:
        """A profile key's settings in the one form every report records (`LoraShape.shape`)."""
        return cls(weight_decay=key.weight_decay, clip=key.clip, lora=key.lora.shape() if key.lora else None)


class RowsProbe(Message):
    """The one-block profiling set's whole iteration at full width with fewer rows than the
    profile's batch (`rows`) and with the batch itself, medians of plain (hook-free) iterations on
    the node's clock. A rank of data parallelism trains a few rows of each batch; what does not
    shrink with them (the optimizer step, the clipping pass, each layer's dispatch) is the
    difference between these and rows / batch (`gateway.plan.costmodel.rows_fixed_fraction`)."""

    rows: BatchSize
    seconds: Seconds
    full_seconds: Float(gt=0, le=MAX_SECONDS)


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
    # glibc's heap span minus its in-use peak over the trainer's settled iteration of the model with
    # one block at full width: the free holes that stay resident under the training ranks'
    # allocator setting (xronos.node.measure.allocator); 0 = not measured (before profiler version 7, or
    # not glibc). The cost model scales it to a rank's width.
    heap_slack_bytes: Bytes = 0
    # What each further block adds to those holes: their growth from one to four blocks at the
    # smallest width over three, each depth in a fresh process (xronos.node.measure.heapprobe); 0 = not
    # measured (before profiler version 8). The cost model counts (blocks - 1) x this on top.
    heap_slack_block_bytes: Bytes = 0
    # One block's holes at the profile's smallest width (the rank's counts per kind in
    # heap_slack_small_counts; None = not measured): holes do not shrink in proportion to the
    # width, so the cost model goes between the two widths.
    heap_slack_small_bytes: Bytes = 0
    heap_slack_small_counts: Sizes | None = None
    profile_seconds: Seconds
    created_at: Timestamp
    # The node's CPU cost of the job's all-reduces (None: a profile from before it was measured;
    # the planner then counts the link alone).
    collectives: CollectiveProfile | None = None
    # The job settings it was taken under (None: not recorded, a report written by an Xronos from
    # before they were echoed; its settings are unknown, not the defaults). The planner refuses a
    # set of reports taken under different settings, and a report taken under other settings than
    # the job's, as it does another batch size or sequence length.
    settings: ProfileSettings | None = None
    # The iteration at fewer rows (None: not measured, before profiler version 10, or a batch of 1).
    rows_probe: RowsProbe | None = None

    @model_validator(mode="after")
    def _fewer_rows(self) -> ProfileReport:
        if self.rows_probe is not None and not self.rows_probe.rows < self.batch_size:
            raise ValueError(f"rows_probe.rows: must be below batch_size ({self.batch_size}), got {self.rows_probe.rows}")
        return self

