"""The settings of a training rank, typed once: what every rank is told before it starts.

Three layers, each a frozen pydantic model (JSON on disk, one file per rank):

- `DataConfig`: what rank 0 reads and how it cuts it into batches (the data owner's part; every
  rank knows the shapes from it);
- `RankConfig(DataConfig)`: every training rank's settings — the data, the optimizer's rate and
  decay, the run's length (`max_steps`, `epochs` or both: whichever ends first), the threads,
  where to meet and where the numbers go. The baselines' rank configs (`xronos.bench`) extend it;
- `RunConfig(RankConfig)`: our TP engine's rank — the world's per-segment `layout` (world size =
  `layout.world_size`), dropout, clipping, warm-up, export. `xronos run` writes one per rank;
  `RunConfig.for_job(spec, ...)` is the one a job's rank takes from its JobSpec.
- `JobRankConfig`: a job's rank process (`xronos.node.rank.jobrank`): its `RunConfig` plus what a job
  adds (ids, checkpoints, resume, the node's allowed directories, the events pipe).

Everything is identical across ranks except `rank`. What only the owner can know (the data's
size, the tokenizer's pad id, the classes it decided from the data, config.json for ranks without
model files) is not a setting: the runtime shares it at start (`xronos.node.rank.lifecycle.Facts`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from xronos.protocol.layout import Layout
from xronos.protocol.messages import DataFormat, GGUFType, JobSpec

Task = Literal["classify", "causal-lm"]


def total_steps(max_steps: int | None, epochs: int | None, n_train: int, batch_size: int) -> int:
    """Steps of a run: max_steps, or epochs of full batches, whichever ends first."""
    limits = [s for s in (max_steps, epochs * (n_train // batch_size) if epochs else None) if s is not None]
    if not limits:
        raise ValueError("a run needs max_steps or epochs")
    return min(limits)


class DataConfig(BaseModel):
    """What the owner (rank 0) reads — checkpoint directory (tokenizer, config.json), data file, its
    format and columns — and how it batches the rows."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_dir: str
    data_path: str
    task: Task
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"
    # How rows become training text (xronos.node.data.batches): the text column (and pair); a messages
    # column rendered with the tokenizer's chat template ("chat"); or prompt/completion columns
    # ("prompt-completion"). The last two are causal-LM formats whose loss covers the answers only.
    data_format: DataFormat = "text"
    messages_column: str = "messages"
    prompt_column: str = "prompt"
    completion_column: str = "completion"
    batch_size: int = Field(gt=0)
    seq_len: int = Field(gt=0)
    seed: int = 0
    shuffle: bool = True
    eval_fraction: float = Field(default=0.0, ge=0, lt=1)

    @model_validator(mode="after")
    def _format_fits_task(self) -> DataConfig:
        if self.data_format != "text" and self.task != "causal-lm":
            raise ValueError(f"data_format {self.data_format!r} is a causal-lm format (the loss covers the "
                             f"answer tokens), not one for task {self.task!r}")
        return self


class RankConfig(DataConfig):
    """Every training rank's settings (ours and the baselines'). Each subclass has `world_size`
    (a field, or a property of its own fields)."""

    lr: float = Field(gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    max_steps: int | None = Field(default=None, gt=0)
    epochs: int | None = Field(default=None, gt=0)
    threads: int = Field(default=1, gt=0)
    gloo_timeout_s: float = Field(default=300.0, gt=0)
    metrics_path: str | None = None
    # Per-rank part: who am I and where is the rendezvous.
    rank: int = Field(default=0, ge=0)
    rendezvous_host: str = "127.0.0.1"
    rendezvous_port: int = Field(default=29500, gt=0, lt=65536)
    # The world's key, proved by every rank right after joining (node/tp/groupkey.py): a job's from
    # its Assignment, a local run's from spawn_ranks. None: no proof (tests joining by hand).
    group_key: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$", repr=False)

    @model_validator(mode="after")
    def _check(self) -> RankConfig:
        if self.max_steps is None and self.epochs is None:
            raise ValueError("max_steps/epochs: at least one must be set")
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size} ranks")
        return self

    def total_steps(self, n_train: int) -> int:
        return total_steps(self.max_steps, self.epochs, n_train, self.batch_size)

    def for_rank(self, rank: int, port: int | None = None):
        update: dict[str, object] = {"rank": rank}
        if port is not None:
            update["rendezvous_port"] = port
        return type(self).model_validate({**self.model_dump(), **update})

    def write(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=1))

    @classmethod
    def read(cls, path: Path):
        return cls.model_validate_json(Path(path).read_text())


class ReshardAt(BaseModel):
    """A forced live re-shard: at the boundary before step `step` every rank moves to `layout`
    (`xronos run --reshard-at STEP:LAYOUT`, for testing the move; `xronos.node.rank.relayout`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step: int = Field(ge=0)
    layout: Layout


class RunConfig(RankConfig):
    """A rank of our TP engine: `xronos run`'s, or a job's (`for_job`)."""

    layout: Layout
    dropout: float | None = Field(default=None, ge=0, lt=1)
    max_grad_norm: float | None = Field(default=None, gt=0)
    warmup_steps: int = Field(default=0, ge=0)
    export_dir: str | None = None
    progress: bool = True
    reshard_at: tuple[ReshardAt, ...] = ()  # in increasing step order, each of this world's size
    rebalance: bool = False  # rank 0 re-plans live from measured speeds (`relayout.LiveRebalance`)

    # LoRA (lora_r None: full fine-tuning): adapters of rank lora_r on lora_targets (peft's module
    # names; None: the family's default), scale lora_alpha / lora_r, the base frozen. The export is
    # then a PEFT adapter directory, and with export_merged also the merged model in <export>/merged.
    lora_r: int | None = Field(default=None, gt=0)
    lora_alpha: float = Field(default=16.0, gt=0)
    lora_dropout: float = Field(default=0.0, ge=0, lt=1)
    lora_targets: list[str] | None = None
    export_merged: bool = False
    # Also a GGUF file (llama.cpp, Ollama) and its Modelfile in export_dir (xronos.node.models.gguf).
    export_gguf: GGUFType | None = None

    @model_validator(mode="after")
    def _reshards(self) -> RunConfig:
        if self.rebalance and self.reshard_at:
            raise ValueError("give reshard_at (forced moves) or rebalance (planned moves), not both")
        steps = [r.step for r in self.reshard_at]
        if steps != sorted(set(steps)):
            raise ValueError(f"reshard_at: steps {steps} must be distinct and increasing")
        for r in self.reshard_at:
            if r.layout.world_size != self.layout.world_size:
                raise ValueError(f"reshard_at step {r.step}: layout has {r.layout.world_size} ranks, the run "
                                 f"{self.layout.world_size}")
            if self.max_steps is not None and r.step >= self.max_steps:
                raise ValueError(f"reshard_at step {r.step}: the run has only {self.max_steps} steps (0.."
                                 f"{self.max_steps - 1})")
        return self

    @model_validator(mode="after")
    def _lora_options(self) -> RunConfig:
        if self.lora_r is None and (self.lora_targets or self.export_merged):
            raise ValueError("lora_targets / export_merged need lora_r (LoRA)")
        return self

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @classmethod
    def for_job(cls, spec: JobSpec, *, layout: Layout, rank: int, host: str, port: int, threads: int,
                gloo_timeout_s: float, group_key: str | None = None) -> RunConfig:
        """The rank settings a JobSpec means (a job always shuffles with its seed, like `xronos run`);
        its length is the spec's own (max_steps and/or epochs), counted once the owner has the data."""
        same = spec.model_dump(include=set(cls.model_fields))  # the fields both name alike
        return cls(**same, layout=layout, shuffle=True, threads=threads, gloo_timeout_s=gloo_timeout_s,
                   progress=False, rank=rank, rendezvous_host=host, rendezvous_port=port, group_key=group_key)


class JobRankConfig(BaseModel):
    """One rank process of an MQTT job, as the node service writes it (`xronos.node.rank.process`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str
    plan_version: int = Field(ge=0)
    node_id: str
    run: RunConfig  # rank, layout, rendezvous, and the training settings from the JobSpec
    checkpoint_interval: int = Field(gt=0)
    resume_step: int = Field(default=0, ge=0)
    checkpoint_dir: str | None = None  # owner only
    allowed_dirs: list[str] | None = None  # the node's; the base checkpoint's files must lie inside them
    events_fd: int | None = None  # the pipe to the node service (set by `RankProcess`)
