"""Megatron's conjugate pair at the borders of a tensor-parallel region.

`copy_to_tp` enters the region: the replicated activation feeds every rank's column shard, so the
gradient that flows back is the sum of all ranks' partial gradients (one all-reduce in backward).
`reduce_from_tp` leaves it: the row shards' partial outputs are summed (one all-reduce in forward);
the summed output is replicated, so its gradient already is each rank's gradient.
"""

from __future__ import annotations

import torch

from .group import TPGroup


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: TPGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        # A fresh contiguous buffer: autograd may still hold `grad` elsewhere.
        g = grad.clone(memory_format=torch.contiguous_format)
        return ctx.group.all_reduce(g), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: TPGroup) -> torch.Tensor:  # type: ignore[override]
        return group.all_reduce(x.clone(memory_format=torch.contiguous_format))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def copy_to_tp(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Forward identity, backward all-reduce."""
    return x if group.world_size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Forward all-reduce, backward identity."""
    return x if group.world_size == 1 else _ReduceFromTP.apply(x, group)
