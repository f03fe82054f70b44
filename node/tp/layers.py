"""Parallel layers with any local width, 0 included.

A rank with 0 units holds [0, in] / [out, 0] weights: its matmuls produce empty or all-zero
outputs but it still joins every all-reduce, so the collectives line up on all ranks.
Weights are [out, in] like nn.Linear, or [in, out] with `transposed=True` (GPT-2's Conv1D), so a
local weight is always a plain slice of the checkpoint tensor.

Each layer is told *where* its part lies (a `Split`: segments of the full dimension), not how wide
it is: the local width follows from the split, and the layer records it as partition metadata on
itself (`Sharded.shards`: parameter name -> (dim, Split)), as Megatron-LM marks its parameters with
`partition_dim`. The model families derive their tensor specs from that metadata
(`TPModel.tensor_specs`), so a shard's width is stated once, where the tensor is made. (The
metadata lives on the module, not the parameter: `to_empty` replaces meta parameters.)
Every collective is tagged with its segment kind (`kind=` of RowParallelLinear; "vocab" for the
vocabulary-parallel embedding and cross-entropy), which books the compute before it (`TPGroup`).

A column or row layer may carry a LoRA adapter (`xronos.node.tp.lora.add_lora` sets `lora_A`
[r, in], `lora_B` [out, r], `lora_scale` and `lora_dropout` on it); its forward then adds
scale * B A dropout(x), sharded like the layer (see lora.py for the layout and the collectives).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .group import TPGroup
from .layout import ShardLayout
from .mappings import boundary, reduce_from_tp
from .overlap import Entered, late_weight_linear


@dataclass(frozen=True)
class Split:
    """A rank's part of one partitioned dimension: the segments [start, stop) it holds of a
    dimension of `full` elements (several for a fused tensor, e.g. GPT-2's q|k|v). Its local size,
    `width`, is their total; empty segments count (every rank has as many)."""

    segments: tuple[tuple[int, int], ...]
    full: int

    def __post_init__(self) -> None:
        assert all(0 <= a <= b <= self.full for a, b in self.segments), (self.segments, self.full)

    @property
    def width(self) -> int:
        return sum(b - a for a, b in self.segments)

    @classmethod
    def of(cls, units: tuple[int, int], total: int, *, unit: int = 1, parts: int = 1) -> Split:
        """Units [a, b) of `total`, each `unit` elements wide, in each of `parts` consecutive
        blocks of total x unit elements (parts=3: a fused q|k|v projection)."""
        a, b = units
        block = total * unit
        return cls(tuple((p * block + a * unit, p * block + b * unit) for p in range(parts)), parts * block)


class Sharded(nn.Module):
    """A module some of whose parameters are partitioned: `shards[name] = (dim, Split)`; the
    others are replicated."""

    shards: dict[str, tuple[int, Split]]


class InRegion(nn.Module):
    """A module whose parameters are replicated but used inside a partitioned region, on this
    rank's part of it only (Qwen3's per-head q/k norms): each rank's gradient of them is a partial
    sum, which its user all-reduces in backward (`copy_to_tp_with`). The profiler counts
    such a module with its region (`profset.find_regions`), as its compute scales with the share."""


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool):
    return F.linear(x, weight.t() if transposed else weight, bias)


class ColumnParallelLinear(Sharded):
    """y_local = x W_local^T + b_local, split on output features (`out`: this rank's part of them).

    The input must already be inside the TP region (`copy_to_tp`), entered once for all column
    layers reading the same activation so backward needs a single all-reduce. With a LoRA adapter
    (A replicated, B split like W), A enters the region with x (`lora.enter_region`) and is passed
    in as `lora_a`, so its partial gradient is summed in x's all-reduce. With overlap on, the
    region computed the product already and passes it in as an `overlap.Entered`.
    """

    lora_scale: float | None = None  # set by lora.add_lora

    def __init__(self, in_features: int, out: Split, *, bias: bool = True,
                 transposed: bool = False) -> None:
        super().__init__()
        self.in_features, self.local_out, self.transposed = in_features, out.width, transposed
        shape = (in_features, out.width) if transposed else (out.width, in_features)
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.empty(out.width)) if bias else None
        self.shards = {"weight": (1 if transposed else 0, out), **({"bias": (0, out)} if bias else {})}

    def forward(self, x: torch.Tensor,  # [..., in] -> [..., local_out]
                lora_a: torch.Tensor | Entered | None = None) -> torch.Tensor:
        if isinstance(lora_a, Entered):  # the region computed the product (overlap.column_region)
            y, lora_a = lora_a
        else:
            y = _linear(x, self.weight, self.bias, self.transposed)
        if self.lora_scale is None:
            return y
        # Outside a world of one, A must come through the region entry (else its gradient is partial).
        assert lora_a is not None or not self.lora_shared, "LoRA A must enter the region with x (enter_region)"
        a = self.lora_A if lora_a is None else lora_a
        u = F.linear(self.lora_dropout(x), a)  # [..., r], the same on every rank
        return y + F.linear(u, self.lora_B) * self.lora_scale  # [..., local_out]


class RowParallelLinear(Sharded):
    """y = all_reduce(x_local W_local^T) + b, split on input features (`inp`: this rank's part of
    them); the bias is replicated and added once. With a LoRA adapter (A split like W on the input,
    B replicated), the r-wide partial product x_local A_local^T rides in the same all-reduce
    (concatenated to the layer's output), and B is applied after it."""

    lora_scale: float | None = None  # set by lora.add_lora

    def __init__(self, inp: Split, out_features: int, group: TPGroup, *, bias: bool = True,
                 transposed: bool = False, kind: str | None = None) -> None:
        super().__init__()
        self.local_in, self.out_features, self.transposed = inp.width, out_features, transposed
        self.group, self.kind = group, kind
        shape = (inp.width, out_features) if transposed else (out_features, inp.width)
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.shards = {"weight": (0 if transposed else 1, inp)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., local_in] -> [..., out]
        return self.finish(reduce_from_tp(self.partial(x), self.group, self.kind))

    def partial(self, x: torch.Tensor) -> torch.Tensor:  # [..., local_in] -> [..., out (+ r)]
        """This rank's part of the sum the all-reduce completes (forward chunking launches that
        all-reduce itself: `mappings.reduce_from_tp_async`, then `finish`)."""
        # An empty inner dimension gives exact zeros, so a 0-unit rank adds nothing.
        if self.group.overlap and self.group.world_size > 1:  # its weight gradient hides a region's all-reduce
            part = late_weight_linear(x, self.weight, self.group, self.transposed)  # [..., out]
        else:
            part = _linear(x, self.weight, None, self.transposed)  # [..., out], this rank's partial sum
        if self.lora_scale is None:
            return part
        u = F.linear(self.lora_dropout(x), self.lora_A)  # [..., r], partial
        # One all-reduce of [..., out + r]; B after it, so dB needs no collective (u is full there).
        return torch.cat((part, u), dim=-1)

    def finish(self, reduced: torch.Tensor) -> torch.Tensor:  # [..., out (+ r)], summed -> [..., out]
        if self.lora_scale is None:
            return reduced if self.bias is None else reduced + self.bias
        y, u = reduced.split([self.out_features, reduced.shape[-1] - self.out_features], -1)
        if self.bias is not None:
            y = y + self.bias
        return y + F.linear(u, self.lora_B) * self.lora_scale  # [..., out]


class VocabParallelEmbedding(Sharded):
    """Rows [start, stop) = layout.range("vocab") of the embedding; lookups summed over ranks."""

    def __init__(self, vocab_size: int, dim: int, layout: ShardLayout, group: TPGroup, *,
                 padding_idx: int | None = None) -> None:
        super().__init__()
        self.vocab_size, self.dim, self.group = vocab_size, dim, group
        self.vocab_start, self.vocab_stop = layout.range("vocab")
        if layout.total("vocab") != vocab_size:
            raise ValueError(f"layout holds {layout.total('vocab')} vocabulary rows, the embedding {vocab_size}")
        # The padding row gets no gradient from lookups, as in nn.Embedding(padding_idx=...).
        owns_pad = padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_stop
        self.local_padding_idx = padding_idx - self.vocab_start if owns_pad else None
        rows = Split.of((self.vocab_start, self.vocab_stop), vocab_size)
        self.weight = nn.Parameter(torch.empty(rows.width, dim))
        self.shards = {"weight": (0, rows)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [B, S] -> [B, S, dim]
        inside = (ids >= self.vocab_start) & (ids < self.vocab_stop)
        # The weight's gradient is the last vocabulary work of the backward pass: mark it.
        weight = boundary(self.weight, self.group, bwd="vocab")
        if self.vocab_start == 0 and self.vocab_stop == self.vocab_size:  # the whole vocabulary
            out = F.embedding(ids, weight, padding_idx=self.local_padding_idx)
        elif self.weight.shape[0] == 0:
            # Adding the empty weight's sum (0) keeps it in the graph: it gets an (empty) gradient
            # like every other parameter, so optimizers and gather_full see no special case.
            out = weight.new_zeros(*ids.shape, self.dim) + weight.sum()
        else:
            local_ids = torch.where(inside, ids - self.vocab_start, 0)
            out = F.embedding(local_ids, weight, padding_idx=self.local_padding_idx)
            out = out.masked_fill(~inside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group, "vocab")


class _VocabParallelCE(torch.autograd.Function):
    """Per-token -log softmax(target) over a vocabulary split across ranks (3 all-reduces)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,  # type: ignore[override]
                group: TPGroup, ignore_index: int) -> torch.Tensor:
        n, v_local = logits.shape  # [N, V_local], targets [N]
        if v_local > 0:
            gmax = logits.detach().max(dim=-1).values
        else:
            gmax = logits.new_full((n,), float("-inf"))
        group.all_reduce(gmax, op="max")
        shifted = logits.detach() - gmax.unsqueeze(-1)  # [N, V_local]

        inside = (targets >= vocab_start) & (targets < vocab_start + v_local)
        local_t = torch.where(inside, targets - vocab_start, 0)
        target_logit = logits.new_zeros(n)
        if v_local > 0:
            picked = shifted.gather(1, local_t.unsqueeze(1)).squeeze(1)
            target_logit = torch.where(inside, picked, target_logit)
        group.all_reduce(target_logit)

        exp = shifted.exp_()  # reuse the buffer: only softmax is needed for backward
        sum_exp = exp.sum(dim=-1)
        group.all_reduce(sum_exp)

        valid = targets != ignore_index
        loss = torch.where(valid, sum_exp.log() - target_logit, 0.0)  # [N]
        exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(exp, inside, local_t, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        softmax, inside, local_t, valid = ctx.saved_tensors
        grad = softmax.clone()  # d loss_i / d logit_ij = softmax_ij - [j == t_i]
        if grad.shape[1] > 0:
            rows = torch.nonzero(inside, as_tuple=True)[0]
            grad[rows, local_t[rows]] -= 1.0
        grad.mul_(torch.where(valid, grad_loss, 0.0).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 group: TPGroup, ignore_index: int = -100,
                                 reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits whose last dim is this rank's vocab slice [vocab_start, +V_local).

    `mean` averages over non-ignored tokens (like F.cross_entropy and HF's causal-LM loss; 0/0 gives
    NaN exactly as they do); `sum` and `none` (per token, 0 where ignored) are also available.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be mean, sum or none, got {reduction!r}")
    if local_logits.shape[:-1] != targets.shape:
        raise ValueError(f"targets {tuple(targets.shape)} do not match logits {tuple(local_logits.shape)}")
    flat_t = targets.reshape(-1)
    flat_logits = local_logits.reshape(flat_t.shape[0], local_logits.shape[-1])  # V_local may be 0
    with group.segment("vocab"):
        per_token = _VocabParallelCE.apply(flat_logits.float(), flat_t, vocab_start, group, ignore_index)
    if reduction == "none":
        return per_token.view(targets.shape)
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / (flat_t != ignore_index).sum()
