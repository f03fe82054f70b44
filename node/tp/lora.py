"""LoRA adapters on the parallel layers, sharded like their base layer; the base frozen.

An adapted layer computes y = W x (+ b) + scale * B A dropout(x), scale = alpha / r, with A [r, in]
and B [out, r] as peft's `lora_A` / `lora_B` (peft's orientation also for GPT-2's Conv1D). Sharding
follows the base layer's own per-kind `Split`:

- Column-parallel base (q/k/v, GPT-2's fused c_attn, MLP up/gate/c_fc): A replicated, B split on
  its output rows exactly like W (the same Split, so GPT-2's q|k|v segments too). u = dropout(x) A^T
  [.., r] is the same on every rank; each rank's gradient of A is a partial sum over its own
  outputs, like the input's gradient. A therefore enters the tensor-parallel region together with
  x (`enter_region`, Megatron's "copy" with a passenger): its backward sums dx and dA of all
  column layers reading x in the one all-reduce the region has anyway — every rank then holds
  the full dA, bit-identical, as a replicated parameter must. No extra collective.
- Row-parallel base (attention output, MLP down): A split on its input columns like W, B
  replicated. The r-wide partial product x_local A_local^T is concatenated to the layer's partial
  output and summed in the layer's own all-reduce ([.., out + r] instead of [.., out]); B is
  applied after it, to the full u. This is exact (the single-device sum, in another order), costs
  r more elements per token in the one all-reduce and no extra collective; and since u is complete
  on every rank, dB = g^T u is complete too (no collective), and backward through the reduce is the
  identity, as for the base. (Applying B before the reduce would save the r elements but leave dB
  partial, costing an all-reduce of [out, r] per layer in backward.)

Dropout on the adapter input draws from the replicated stream for a column layer (its input is
replicated: every rank drops the same elements) and from the rank's local stream for a row layer
(its input is this rank's slice).

The frozen base: every parameter but the adapters (and a classification head, trained as peft's
SEQ_CLS `modules_to_save` trains it) has requires_grad=False, so it gets no gradient and the
optimizer (built over `trainable` parameters) holds no state for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from .group import TPGroup
from .layers import ColumnParallelLinear, RowParallelLinear
from .mappings import copy_to_tp, copy_to_tp_with
from .overlap import Entered, column_region, enter_cut

LORA_PARAMS = ("lora_A", "lora_B")
# Task heads peft trains with task_type SEQ_CLS (its modules_to_save), by their HF module name.
TRAINED_HEADS = ("classifier", "score")


@dataclass(frozen=True)
class LoraSettings:
    """r, alpha, dropout on the adapter input and the target module names (peft's names)."""

    r: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"LoRA rank r must be a positive integer, got {self.r!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoRA alpha must be a positive finite number, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if not self.targets:
            raise ValueError("LoRA needs at least one target module")

    @property
    def scale(self) -> float:
        return self.alpha / self.r


def lora_settings(family_name: str, family_targets: tuple[str, ...], default_targets: tuple[str, ...],
                  r: int, alpha: float, dropout: float, targets: list[str] | tuple[str, ...] | None
                  ) -> LoraSettings:
    """A recipe's LoRA adapters (its LoraSpec's fields) on a family; the targets default to the
    family's (peft's defaults). ValueError naming what is wrong."""
    if not family_targets:
        raise ValueError(f"LoRA is not supported for model family {family_name!r}")
    settings = LoraSettings(r, float(alpha), float(dropout), tuple(targets) if targets else default_targets)
    check_targets(family_name, family_targets, settings)
    return settings


def module_name(model: nn.Module, local_prefix: str) -> str:
    """The HF (and peft) module name of a local module: the model's name of its weight, minus `.weight`."""
    return model.hf_name(f"{local_prefix}.weight").removesuffix(".weight")


def adaptable(model: nn.Module) -> dict[str, ColumnParallelLinear | RowParallelLinear]:
    """HF module name -> parallel layer, for the transformer blocks' projections (the LM head, a
    vocabulary-parallel column layer, is never a target)."""
    targets = set(getattr(model, "lora_targets", ()))
    found = {}
    for prefix, m in model.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            name = module_name(model, prefix)
            if name.rsplit(".", 1)[-1] in targets:
                found[name] = m
    return found


def layer_dims(layer: ColumnParallelLinear | RowParallelLinear) -> tuple[int, int]:
    """(in_features, out_features) of the whole (unsharded) layer."""
    dim, split = layer.shards["weight"]
    if isinstance(layer, ColumnParallelLinear):
        return layer.in_features, split.full
    return split.full, layer.out_features


def check_targets(family_name: str, family_targets: tuple[str, ...], settings: LoraSettings) -> None:
    """Refuse target names the family lacks (naming the ones it has)."""
    if not family_targets:
        raise ValueError(f"LoRA is not supported for model family {family_name!r}")
    bad = [t for t in settings.targets if t not in family_targets]
    if bad:
        raise ValueError(f"LoRA target module(s) {bad} not in model family {family_name!r} "
                         f"(it has: {', '.join(family_targets)})")


class AdapterDropout(nn.Module):
    """Dropout on an adapter's input, from the model's streams (`models.common.DropoutStreams`):
    the shared one for a replicated input, the rank's own for a partitioned one."""

    def __init__(self, p: float, streams, *, partitioned: bool) -> None:
        super().__init__()
        self.p, self.streams, self.partitioned = p, streams, partitioned

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        gen = self.streams.local if self.partitioned else self.streams.replicated
        return x * torch.empty_like(x).bernoulli_(1.0 - self.p, generator=gen).div_(1.0 - self.p)


def add_lora(model: nn.Module, settings: LoraSettings) -> list[str]:
    """Attach adapters to the target layers of a (meta-device) TPModel and freeze everything else
    except a classification head. Returns the adapted modules' HF names (peft's target list)."""
    family_targets = tuple(getattr(model, "lora_targets", ()))
    check_targets(type(model).__name__, family_targets, settings)
    chosen = {n: m for n, m in adaptable(model).items() if n.rsplit(".", 1)[-1] in settings.targets}
    for name, layer in chosen.items():
        fan_in, fan_out = layer_dims(layer)
        if settings.r > min(fan_in, fan_out):
            raise ValueError(f"LoRA rank r={settings.r} exceeds layer {name} ({fan_in} -> {fan_out} features; "
                             f"r must be <= {min(fan_in, fan_out)})")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, layer in chosen.items():
        _, split = layer.shards["weight"]
        device = layer.weight.device
        r = settings.r
        column = isinstance(layer, ColumnParallelLinear)
        if column:  # A [r, in] replicated, B [out_local, r] split like W's output
            layer.lora_A = nn.Parameter(torch.empty(r, layer.in_features, device=device))
            layer.lora_B = nn.Parameter(torch.empty(split.width, r, device=device))
            layer.shards = {**layer.shards, "lora_B": (0, split)}
        else:  # A [r, in_local] split like W's input, B [out, r] replicated
            layer.lora_A = nn.Parameter(torch.empty(r, split.width, device=device))
            layer.lora_B = nn.Parameter(torch.empty(layer.out_features, r, device=device))
            layer.shards = {**layer.shards, "lora_A": (1, split)}
        layer.lora_scale = settings.scale
        layer.lora_shared = column and model.group.world_size > 1
        layer.lora_dropout = AdapterDropout(settings.dropout, model.streams, partitioned=not column)
    if getattr(model, "task", None) == "classify":
        for name, p in model.named_parameters():
            if model.hf_name(name).split(".", 1)[0] in TRAINED_HEADS:
                p.requires_grad_(True)
    model.lora = settings
    model.lora_modules = sorted(chosen)
    return model.lora_modules


def enter_region(x: torch.Tensor, group: TPGroup, kind: str,
                 layers: tuple[ColumnParallelLinear, ...], extra: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor | None]]:
    """`copy_to_tp(x)` for the column layers that read x, carrying the replicated in-region
    tensors along: `extra` (Qwen3's q/k norm weights) and each adapted layer's A. Returns x inside
    the region, extra, and per layer the A to pass to it (None: not adapted, or a world of one).
    With `group.overlap` the region computes the layers' base products too, so that backward
    overlaps its all-reduce with their weight gradients (`overlap.column_region`): each layer
    gets an `overlap.Entered` (its product and its A) instead. Inside a chunked pass
    (`group.entries`) each of them enters as a leaf of the chunk's cell, whose backward the pass
    all-reduces itself (`overlap.enter_cut`)."""
    adapted = [layer.lora_scale is not None for layer in layers]
    if group.entries is not None:
        x = enter_cut(x, group)
        extra = None if extra is None else enter_cut(extra, group, passenger=True)
        return x, extra, [enter_cut(layer.lora_A, group, passenger=True) if a else None
                          for layer, a in zip(layers, adapted)]
    fused = group.overlap and group.world_size > 1  # the layers' products computed here (overlap.py)
    if group.world_size == 1 or (not any(adapted) and extra is None and not fused):
        return copy_to_tp(x, group, kind), extra, [None] * len(layers)
    ws = ([extra] if extra is not None else []) + [layer.lora_A for layer, a in zip(layers, adapted) if a]
    # Qwen3's norm weights need no gradient in a LoRA job; A does: one buffer, one all-reduce.
    flat = torch.cat([w.reshape(-1) for w in ws]) if ws else None
    if fused:
        x, flat, ys = column_region(x, group, kind, layers, flat)
    else:
        x, flat = copy_to_tp_with(x, flat, group, kind)
    out, offset = [], 0
    for w in ws:
        out.append(flat[offset:offset + w.numel()].view(w.shape))
        offset += w.numel()
    extra_out = out.pop(0) if extra is not None else None
    it = iter(out)
    a_s = [next(it) if a else None for a in adapted]
    return x, extra_out, ([Entered(y, a) for y, a in zip(ys, a_s)] if fused else a_s)


def trainable_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]
