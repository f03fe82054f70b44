"""The training recipe, typed once: what is trained, on what data, how, for how long, with which
adapters and into what export. A job's spec is a recipe plus the job's own fields
(`JobSpec.recipe`), a rank's config is a recipe plus its placement (`xronos.node.runconfig`), a
profile request carries the recipe's profile key (`ProfileKey`), and `xronos run`'s training flags
are generated from these fields (`xronos.cli.flagtable`).

Invalid combinations are unrepresentable where a type can say so (LoRA options live in `LoraSpec`,
which cannot be written down without its rank), and every rule across fields is checked once, in
`Recipe._combinations`. Re-exported by `xronos.protocol.messages`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .msgtypes import (
    BatchSize, Column, DataFormat, Decay, Epochs, Fraction, GGUFType, GradNorm, LearningRate, LoraAlpha, LoraRank,
    LoraTarget, PathText, Seed, SeqLen, StepCount, Steps, Task,
)


class Part(BaseModel):
    """A part of a message (no schema version of its own): frozen, strict, no unknown field."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")


class LoraShape(Part):
    """What of LoRA adapters a profile depends on: rank `r` on `targets` (peft's module names, e.g.
    q_proj; None: the family's default), dropout on their input. Not alpha: it only scales the
    adapters' output."""

    r: LoraRank
    dropout: Fraction = 0.0
    targets: Annotated[list[LoraTarget], Field(min_length=1, max_length=16)] | None = None

    def shape(self) -> LoraShape:
        """The one form a profile records: the targets sorted and once each (their order trains
        nothing different), no alpha."""
        return LoraShape(r=self.r, dropout=self.dropout, targets=sorted(set(self.targets)) if self.targets else None)


class LoraSpec(LoraShape):
    """LoRA adapters of rank `r` on `targets`, scale alpha / r, dropout on their input; the base
    frozen. The export is then a PEFT adapter directory (adapter_config.json,
    adapter_model.safetensors)."""

    alpha: LoraAlpha = 16.0


class Recipe(Part):
    """Everything a job's training depends on. Paths are the owner's (rank 0 reads them)."""

    # What is trained, on what.
    model_dir: PathText
    data_path: PathText
    task: Task
    # How rows become training text: a text column (and pair), or for causal-lm a messages column
    # rendered with the tokenizer's chat template ("chat") or prompt/completion columns, the loss
    # on the answer tokens only (xronos.node.data.batches).
    data_format: DataFormat = "text"
    text_column: Column = "text"
    text_pair_column: Column | None = None
    label_column: Column = "label"
    messages_column: Column = "messages"
    prompt_column: Column = "prompt"
    completion_column: Column = "completion"
    eval_fraction: Fraction = 0.1  # the file's tail, evaluated before and after training
    shuffle: bool = True  # a seeded shuffle of the rows (False: consecutive rows)
    seed: Seed = 0
    # Optimisation (AdamW): the batch, the rate with its linear warm-up, decoupled weight decay,
    # clipping by the global gradient norm (None: no clipping), every dropout overridden (None: the
    # checkpoint's).
    batch_size: BatchSize
    seq_len: SeqLen
    lr: LearningRate
    warmup_steps: StepCount = 0
    weight_decay: Decay = 0.0
    max_grad_norm: GradNorm | None = 1.0
    dropout: Fraction | None = None
    # Length: max_steps, epochs of full batches, or both (whichever ends first).
    max_steps: Steps | None = None
    epochs: Epochs | None = None
    # LoRA (None: full fine-tuning, every weight trained).
    lora: LoraSpec | None = None
    # The export: a Hugging Face directory (under LoRA a PEFT adapter directory); with
    # export_merged (LoRA) also the merged model in <export_dir>/merged; with export_gguf (causal
    # LMs of the llama, qwen2, qwen3 and gpt2 families) also <export_dir>/model-<type>.gguf and an
    # Ollama Modelfile beside it (xronos.node.models.gguf), under LoRA of the merged model.
    export_dir: PathText | None = None
    export_merged: bool = False
    export_gguf: GGUFType | None = None

    @model_validator(mode="after")
    def _combinations(self) -> Recipe:
        """The recipe's rules across fields, each coded here and nowhere else."""
        if self.epochs is None and self.max_steps is None:
            raise ValueError("epochs/max_steps: at least one must be set")
        if self.data_format != "text" and self.task != "causal-lm":
            raise ValueError(f"data_format: {self.data_format!r} is a causal-lm format (the loss covers the "
                             f"answer tokens), not one for task {self.task!r}")
        if self.export_gguf is not None and self.task != "causal-lm":
            raise ValueError(f"export_gguf: {self.export_gguf!r} asked of task {self.task!r}; llama.cpp runs "
                             "language models, so GGUF export is for task 'causal-lm'")
        if self.export_merged and self.lora is None:
            raise ValueError("export_merged: set without lora (LoRA); without it the export is already the "
                             "whole fine-tuned model")
        return self

    def total_steps(self, n_train: int) -> int:
        """Steps of a run over `n_train` rows: max_steps, or epochs of full batches, whichever
        ends first."""
        by_epochs = self.epochs * (n_train // self.batch_size) if self.epochs is not None else None
        return min(s for s in (self.max_steps, by_epochs) if s is not None)

    @property
    def exports_whole_model(self) -> bool:
        """The export writes every weight (a full fine-tune, or LoRA's merged model for
        export_merged or GGUF), not the adapters alone: the owner's memory must hold it."""
        return self.export_merged or self.export_gguf is not None

    def profile_key(self) -> ProfileKey:
        return ProfileKey(task=self.task, batch_size=self.batch_size, seq_len=self.seq_len,
                          weight_decay=self.weight_decay, clip=self.max_grad_norm is not None, lora=self.lora)


class ProfileKey(Part):
    """What a profile of a job's model depends on besides the model's shape: the task (its head),
    the batch and sequence length, and the optimizer's passes over the parameters (decoupled
    weight decay, the clipping pass); under LoRA the job's adapters on a frozen base (no gradient
    or AdamW moments on the base: less memory, less time). `Recipe.profile_key()` makes it."""

    task: Task
    batch_size: BatchSize
    seq_len: SeqLen
    weight_decay: Decay = 0.0
    clip: bool = True
    lora: LoraSpec | None = None
