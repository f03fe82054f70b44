"""Megatron's conjugate pair at the borders of a tensor-parallel region.

`copy_to_tp` enters the region: the replicated activation feeds every rank's column shard, so the
gradient that flows back is the sum of all ranks' partial gradients (one all-reduce in backward).
`reduce_from_tp` leaves it: the row shards' partial outputs are summed (one all-reduce in forward);
the summed output is replicated, so its gradient already is each rank's gradient.
`copy_to_tp_with` enters it with a replicated parameter that only this rank's part of the region
uses (so its gradient is partial too): both gradients share the one all-reduce.

Each takes the segment kind of its region ("attn", "mlp", "vocab"): its all-reduce is tagged with
it, so the time before it is booked as that kind's compute (`TPGroup`). `boundary` marks where a
segment ends without a collective, in forward and/or backward.
"""

from __future__ import annotations

import torch

from .group import TPGroup


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: TPGroup, kind: str | None) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.kind = group, kind
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        # A fresh contiguous buffer: autograd may still hold `grad` elsewhere.
        g = grad.clone(memory_format=torch.contiguous_format)
        with ctx.group.segment(ctx.kind):
            ctx.group.all_reduce(g)
        return g, None, None


class _CopyToTPWith(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, group: TPGroup, kind: str | None):  # type: ignore[override]
        ctx.group, ctx.kind = group, kind
        ctx.shapes = (x.shape, w.shape)
        return x.view_as(x), w.view_as(w)

    @staticmethod
    def backward(ctx, gx: torch.Tensor | None, gw: torch.Tensor | None):  # type: ignore[override]
        (xs, ws), ref = ctx.shapes, gx if gx is not None else gw
        gx = ref.new_zeros(xs) if gx is None else gx
        gw = ref.new_zeros(ws) if gw is None else gw
        # One fresh buffer [x.numel() + w.numel()], one all-reduce for both gradients.
        flat = torch.cat((gx.reshape(-1), gw.reshape(-1)))
        with ctx.group.segment(ctx.kind):
            ctx.group.all_reduce(flat)
        n = gx.numel()
        # w's gradient is copied out: a view would keep the whole buffer (x's gradient, [B, S, hidden])
        # alive as long as w.grad, i.e. until the optimizer step, for every region of every layer.
        return flat[:n].view(xs), flat[n:].view(ws).clone(), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: TPGroup, kind: str | None) -> torch.Tensor:  # type: ignore[override]
        with group.segment(kind):
            return group.all_reduce(x.clone(memory_format=torch.contiguous_format))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None, None


class _LaunchReduce(torch.autograd.Function):
    """`reduce_from_tp`'s forward all-reduce, launched and not waited for: returns its buffer (in
    flight: nothing may read it before `_WaitReduce`). Backward: the identity, as the reduce's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: TPGroup, kind: str | None, box: list) -> torch.Tensor:  # type: ignore[override]
        buf = x.clone(memory_format=torch.contiguous_format)
        with group.segment(kind):
            box.append(group.all_reduce_async(buf))
        return buf

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None, None, None


class _WaitReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buf: torch.Tensor, box: list) -> torch.Tensor:  # type: ignore[override]
        box.pop().wait()
        return buf.view_as(buf)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


class InFlight:
    """A forward reduce launched by `reduce_from_tp_async`: `wait()` gives the summed tensor."""

    def __init__(self, buf: torch.Tensor, box: list | None) -> None:
        self.buf, self.box = buf, box

    def wait(self) -> torch.Tensor:
        if self.box is None:
            return self.buf
        out, self.box = _WaitReduce.apply(self.buf, self.box), None
        self.buf = out
        return out


class _Boundary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: TPGroup, fwd: str | None, bwd: str | None) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.bwd = group, bwd
        if fwd is not None:
            group.mark(fwd)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if ctx.bwd is not None:
            ctx.group.mark(ctx.bwd)
        return grad, None, None, None


def copy_to_tp(x: torch.Tensor, group: TPGroup, kind: str | None = None) -> torch.Tensor:
    """Forward identity, backward all-reduce (tagged `kind`). A traced world of one marks the
    backward boundary instead."""
    if group.world_size == 1:
        return boundary(x, group, bwd=kind) if kind is not None and group.trace else x
    return _CopyToTP.apply(x, group, kind)


def copy_to_tp_with(x: torch.Tensor, w: torch.Tensor, group: TPGroup,
                    kind: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`copy_to_tp(x)` that also carries `w`, a replicated tensor used inside the region on this
    rank's part only (Qwen3's q/k norm weights, applied to the rank's own heads): its gradient is
    each rank's partial sum, all-reduced in the same all-reduce as x's — no extra collective."""
    if group.world_size == 1:
        return copy_to_tp(x, group, kind), w
    if x.dtype != w.dtype:
        raise ValueError(f"copy_to_tp_with: x is {x.dtype} but w is {w.dtype} (one buffer holds both gradients)")
    return _CopyToTPWith.apply(x, w, group, kind)


def reduce_from_tp(x: torch.Tensor, group: TPGroup, kind: str | None = None) -> torch.Tensor:
    """Forward all-reduce (tagged `kind`), backward identity."""
    if group.world_size == 1:
        if kind is not None:
            with group.segment(kind):
                group.all_reduce(x)  # no communication: a traced world of one marks the boundary
        return x
    return _ReduceFromTP.apply(x, group, kind)


def reduce_from_tp_async(x: torch.Tensor, group: TPGroup, kind: str | None = None) -> InFlight:
    """`reduce_from_tp` that returns at once: the all-reduce travels while the rank computes
    (forward chunking, `overlap.run_chunked`); `wait()` the result, in launch order."""
    if group.world_size == 1:
        return InFlight(reduce_from_tp(x, group, kind), None)
    box: list = []
    return InFlight(_LaunchReduce.apply(x, group, kind, box), box)


def boundary(x: torch.Tensor, group: TPGroup, fwd: str | None = None, bwd: str | None = None) -> torch.Tensor:
    """Identity that marks the end of segment `fwd` when the forward pass reaches it and the end of
    segment `bwd` when the backward pass does (no-op unless the group traces)."""
    if not group.trace:
        return x
    if not (torch.is_grad_enabled() and x.requires_grad):  # no backward will come through here
        if fwd is not None:
            group.mark(fwd)
        return x
    return _Boundary.apply(x, group, fwd, bwd)
