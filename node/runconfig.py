"""The configuration of one local/LAN training run, as handed to each rank's worker (JSON).

One `RunConfig` per rank: everything is identical across ranks except `rank`. The layout is the
whole world's (per-kind counts, one entry per rank), so the world size is `layout.world_size`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from xronos.protocol.layout import Layout

Task = Literal["classify", "causal-lm"]
# How rows become training text (xronos.node.data): a text column (and pair) as today; a
# `messages` column rendered with the tokenizer's chat template; or prompt/completion columns.
# The last two are causal-LM formats whose loss covers the answer tokens only.
DataFormat = Literal["text", "chat", "prompt-completion"]


class RunConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model_dir: str
    data_path: str
    task: Task
    layout: Layout
    batch_size: int = Field(gt=0)
    seq_len: int = Field(gt=0)
    lr: float = Field(gt=0)
    max_steps: int = Field(gt=0)
    seed: int = 0
    shuffle: bool = True
    dropout: float | None = Field(default=None, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0)
    max_grad_norm: float | None = Field(default=None, gt=0)
    warmup_steps: int = Field(default=0, ge=0)
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"
    data_format: DataFormat = "text"
    messages_column: str = "messages"
    prompt_column: str = "prompt"
    completion_column: str = "completion"
    threads: int = Field(default=1, gt=0)
    eval_fraction: float = Field(default=0.0, ge=0, lt=1)
    metrics_path: str | None = None
    export_dir: str | None = None
    gloo_timeout_s: float = Field(default=300.0, gt=0)
    progress: bool = True
    # Per-rank part: who am I and where is the rendezvous.
    rank: int = Field(default=0, ge=0)
    rendezvous_host: str = "127.0.0.1"
    rendezvous_port: int = Field(default=29500, gt=0, lt=65536)

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.rank >= self.layout.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.layout.world_size} ranks")
        if self.data_format != "text" and self.task != "causal-lm":
            raise ValueError(f"data_format {self.data_format!r} is a causal-lm format (the loss covers the "
                             f"answer tokens), not one for task {self.task!r}")
        return self

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def for_rank(self, rank: int, port: int | None = None) -> RunConfig:
        update: dict[str, object] = {"rank": rank}
        if port is not None:
            update["rendezvous_port"] = port
        return RunConfig.model_validate({**self.model_dump(), **update})

    def write(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=1))

    @classmethod
    def read(cls, path: Path) -> RunConfig:
        return cls.model_validate_json(Path(path).read_text())
