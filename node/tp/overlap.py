"""Hide the wire: in backward, the input-gradient all-reduce of a column-parallel region travels while
the region's weight-gradient GEMMs run (Megatron-LM's `LinearWithGradAccumulationAndAsyncCommunication`);
with the batch rows in chunks, each chunk's all-reduces travel while the next chunk computes, in
forward and backward (Domino, at the end of this module).

Today the region's entry (`mappings.copy_to_tp`) all-reduces the input gradient in its backward,
after autograd has run every column layer's backward node — each computes the layer's input and
weight gradients together — so the all-reduce has nothing left to overlap with and blocks the rank.
Here one autograd Function (`_ColumnRegion`) enters the region *and* computes the base products of
every column layer reading x: its backward first sums the input gradient (x's uses inside the
region, a LoRA adapter's, and each layer's g W), launches its all-reduce asynchronously
(`TPGroup.all_reduce_async`), computes the weight and bias gradients (g^T x: as much work again
as the input gradient), then waits. The sums are the same ones, in the same places; only when they
happen moves. A LoRA job's frozen base has no weight gradient to compute: nothing is hidden then,
and nothing changes.

The region's passengers (`lora.enter_region`: Qwen3's q/k norm weights, the adapters' A's) ride
in the same all-reduce as before. Each layer gets its product as an `Entered` instead of its A
(`ColumnParallelLinear.forward` takes either), so the models' code does not change.

The region's own weight gradients are a small window (a sixth of a block's work: QKV's and the
MLP's up projection's), often shorter than the all-reduce on a 1 Gbit/s link. So the row-parallel
layer that closes each region (the attention's output projection, the MLP's down projection,
`late_weight_linear`) leaves its weight gradient for later, as zero-bubble pipeline schedules split
backward into B and W: its backward computes only the input gradient and queues g^T x on the group
(`TPGroup.late`). Every region runs that queue inside its all-reduce's window, before its own
weight gradients, which doubles the MLP's window (both its projections' weight gradients) and adds
the output projection's to attention's. In backward a row layer always comes before the column
region that entered its stage, so the queue is empty again once that region ran; a callback queued
on autograd's engine runs whatever is left when the backward pass ends (any caller of
`loss.backward()`, nothing to remember). Each weight gets the same g^T x, added to its `.grad` as
autograd's accumulation does; only when it happens moves. What it costs: the row layer's input and
output gradient stay alive until the region runs (one region's activations at most).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .group import TPGroup
from .mappings import reduce_from_tp_async


class Entered(NamedTuple):
    """What a column layer gets from a region that computed its base product: y = x W^T + b
    [..., local_out], and its LoRA A inside the region (None: not adapted)."""

    y: torch.Tensor
    a: torch.Tensor | None


def _weight(w: torch.Tensor, transposed: bool) -> torch.Tensor:
    return w.t() if transposed else w  # [out, in], as F.linear takes it


class _ColumnRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, passenger: torch.Tensor, group: TPGroup, kind: str | None,  # type: ignore[override]
                layers: tuple[tuple[bool, bool], ...], *params: torch.Tensor):
        # layers: (has bias, transposed) per layer; params: each layer's weight, then its bias if any
        ctx.group, ctx.kind, ctx.layers, ctx.pshape = group, kind, layers, passenger.shape
        ctx.save_for_backward(x, *params)
        ys, it = [], iter(params)
        for has_bias, transposed in layers:
            w = next(it)
            ys.append(F.linear(x, _weight(w, transposed), next(it) if has_bias else None))
        return (x.view_as(x), passenger.view_as(passenger), *ys)

    @staticmethod
    def backward(ctx, gx: torch.Tensor | None, gp: torch.Tensor | None,  # type: ignore[override]
                 *gys: torch.Tensor | None):
        x, *params = ctx.saved_tensors
        needs = ctx.needs_input_grad[5:]
        layers, it = [], iter(zip(params, needs))
        for has_bias, transposed in ctx.layers:
            w, w_needs = next(it)
            b, b_needs = next(it) if has_bias else (None, False)
            layers.append((w, b, transposed, w_needs, b_needs))
        # The input gradient: x's uses inside the region, then each layer's g W ([..., in]).
        fmt = torch.contiguous_format
        dx = torch.zeros_like(x, memory_format=fmt) if gx is None else gx.clone(memory_format=fmt)
        for (w, _, transposed, _, _), g in zip(layers, gys):
            if g is not None:
                dx += g.matmul(_weight(w, transposed))
        gp = x.new_zeros(ctx.pshape) if gp is None else gp
        n = dx.numel()
        flat = torch.cat((dx.reshape(-1), gp.reshape(-1))) if gp.numel() else dx
        with ctx.group.segment(ctx.kind):
            pending = ctx.group.all_reduce_async(flat)
        # While it travels: the weight gradients the region's row layers left (`late_weight_linear`),
        # then the region's own weight and bias gradients; none needs communication.
        run_late(ctx.group)
        grads: list[torch.Tensor | None] = []
        x2 = x.reshape(-1, x.shape[-1])  # [tokens, in]
        for (w, b, transposed, w_needs, b_needs), g in zip(layers, gys):
            g2 = None if g is None else g.reshape(x2.shape[0], g.shape[-1])  # [tokens, local_out] (may be 0 wide)
            if w_needs:
                gw = torch.zeros_like(w) if g2 is None else (x2.t() @ g2 if transposed else g2.t() @ x2)
                grads.append(gw)
            else:
                grads.append(None)
            if b is not None:
                grads.append((torch.zeros_like(b) if g2 is None else g2.sum(0)) if b_needs else None)
        pending.wait()
        # The passenger's gradient is copied out: a view would keep the whole buffer alive (as
        # `mappings._CopyToTPWith`).
        if flat is not dx:
            dx, gp = flat[:n].view(x.shape), flat[n:].view(ctx.pshape).clone()
        return (dx, gp, None, None, None, *grads)


class _LateWeight(torch.autograd.Function):
    """y = x W^T (W [out, in], or [in, out] transposed) whose backward gives the input gradient at
    once and queues the weight's, g^T x, on the group (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, group: TPGroup, transposed: bool):  # type: ignore[override]
        ctx.group, ctx.transposed = group, transposed
        ctx.save_for_backward(x, w)
        return F.linear(x, _weight(w, transposed))  # [..., out]

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        x, w = ctx.saved_tensors
        dx = g.matmul(_weight(w, ctx.transposed)) if ctx.needs_input_grad[0] else None  # [..., in]
        if ctx.needs_input_grad[1]:
            transposed = ctx.transposed

            def weight_grad() -> None:
                tokens = math.prod(x.shape[:-1])  # (a 0-unit rank's x is [..., 0]: no -1 to infer)
                x2 = x.reshape(tokens, x.shape[-1])  # [tokens, in]
                g2 = g.reshape(tokens, g.shape[-1])  # [tokens, out]
                _accumulate(w, x2.t() @ g2 if transposed else g2.t() @ x2)

            _queue_late(ctx.group, weight_grad)
        return dx, None, None, None


def _accumulate(w: torch.Tensor, gw: torch.Tensor) -> None:
    """Add a weight gradient computed outside autograd to `w.grad`, as its accumulation would."""
    with torch.no_grad():
        if w.grad is None:
            w.grad = gw
        else:
            w.grad.add_(gw)


def _queue_late(group: TPGroup, work) -> None:
    task = torch._C._current_graph_task_id()  # this backward pass
    if group.late_task != task:
        # The first late gradient of this pass. Work left by a pass that raised (its callback never
        # ran) belongs to that pass's gradients, which nobody applies: dropped, never added to
        # this one's. Whatever no region runs by this pass's end runs then (DDP finalizes its
        # buckets the same way): a caller of loss.backward() has nothing to flush.
        group.late.clear()
        group.late_task = task
        torch.autograd.Variable._execution_engine.queue_callback(lambda: run_late(group))  # type: ignore[attr-defined]
    group.late.append(work)


def run_late(group: TPGroup) -> None:
    """Run the weight gradients the row layers left on `group`, oldest first."""
    while group.late:
        group.late.pop(0)()


def late_weight_linear(x: torch.Tensor, weight: torch.Tensor, group: TPGroup, transposed: bool) -> torch.Tensor:
    """x [..., in] times a row-parallel layer's local weight, its weight gradient left to the next
    column region's all-reduce window (module docstring). A frozen weight has nothing to leave."""
    if not weight.requires_grad or not torch.is_grad_enabled():
        return F.linear(x, _weight(weight, transposed))
    return _LateWeight.apply(x, weight, group, transposed)


def column_region(x: torch.Tensor, group: TPGroup, kind: str | None,
                  layers: tuple, passenger: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """Enter a tensor-parallel region with x [..., in] for the column layers `layers` (each a
    `ColumnParallelLinear`, or a (weight, bias, transposed) triple) and compute their base
    products, so that backward overlaps the input-gradient all-reduce with their weight
    gradients. `passenger`: a replicated tensor used inside the region on this rank's part only
    (as `copy_to_tp_with`), all-reduced with x's gradient. Returns x inside the region, the
    passenger inside it, and each layer's product [..., local_out]."""
    if group.world_size == 1:
        raise ValueError("column_region is for a world of more than one rank (nothing to overlap)")
    triples = [(m.weight, m.bias, m.transposed) if hasattr(m, "weight") else m for m in layers]
    params: list[torch.Tensor] = []
    for w, b, _ in triples:
        params.append(w)
        if b is not None:
            params.append(b)
    if passenger is not None and passenger.dtype != x.dtype:
        raise ValueError(f"column_region: x is {x.dtype} but the passenger is {passenger.dtype} "
                         "(one buffer holds both gradients)")
    p = x.new_zeros(0) if passenger is None else passenger
    spec = tuple((b is not None, tr) for _, b, tr in triples)
    x_in, p_in, *ys = _ColumnRegion.apply(x, p, group, kind, spec, *params)
    return x_in, (None if passenger is None else p_in), ys


# -- chunking (Domino) -----------------------------------------------------------------------------
# A stage of a block: `pre(x, c)` computes chunk c's partial sum (the row-parallel layer's
# `partial`), `post(x, reduced)` completes it (`finish`, dropout, the residual), `kind` tags the
# all-reduce between them.
Stage = tuple  # (pre, post, kind)


def check_chunks(chunks: object, batch: int) -> int:
    """The number of chunks a rank's batch rows are cut into, or ValueError naming it and the batch."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r} (batch size {batch})")
    if chunks > batch:
        raise ValueError(f"chunks {chunks} leaves a chunk without a row: the batch has {batch} rows "
                         f"(at most {batch} chunks)")
    return chunks


class _Cell:
    """One chunk's pass through one stage: its input `x` (as the stage's region entry reads it,
    through a norm maybe: the previous cell's output, in that cell's graph), `res` (the same values
    as a leaf, for the residual the stage adds after its all-reduce), the tensors that entered its
    region as `(outside, inside, passenger)` (the inside a leaf: the graph is cut where the region's
    backward all-reduce would be) and its output."""

    __slots__ = ("x", "res", "entries", "out", "kind")

    def __init__(self, x: torch.Tensor, res: torch.Tensor, kind: str | None) -> None:
        self.x, self.res, self.kind, self.entries, self.out = x, res, kind, [], None


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(t.requires_grad)


def enter_cut(t: torch.Tensor, group: TPGroup, passenger: bool = False) -> torch.Tensor:
    """Inside a chunked pass that records its cells (`group.entries`), a tensor entering a
    column-parallel region: a leaf whose gradient the pass's backward driver all-reduces itself
    (`_Tape`), in place of the region entry's own all-reduce (`mappings.copy_to_tp`). `passenger`:
    a replicated tensor used inside on this rank's part only (`copy_to_tp_with`)."""
    inside = _leaf(t)
    group.entries.append((t, inside, passenger))
    return inside


def run_chunked(stages: list[Stage], xs: list[torch.Tensor], group: TPGroup,
                cells: list[list[_Cell]] | None = None) -> list[torch.Tensor]:
    """Run the stages over the chunks `xs` so that chunk c's all-reduce of a stage travels while
    chunk c+1 computes that stage and chunk c-1 the next (Domino, arXiv 2409.15241): stage by stage,
    chunk by chunk, each chunk first completes its previous stage (waiting for its all-reduce,
    launched one chunk's compute earlier), then launches this one's. Every rank launches and waits
    in the same order. The sums are the unchunked ones, row by row. `cells`: record each chunk's
    pass through each stage (`_Cell`), for `chunked_pass`'s backward."""
    xs, flights, post, prev = list(xs), [None] * len(xs), None, None
    res = list(xs)  # what each chunk's stage adds its result to (its input: a leaf when recording)
    for pre, nxt, kind in stages:
        row = [] if cells is not None else None
        for c, x in enumerate(xs):
            if flights[c] is not None:
                x = xs[c] = post(res[c], flights[c].wait())
                if prev is not None:
                    prev[c].out = x
            res[c] = x
            if row is not None:
                res[c] = _leaf(x)
                row.append(_Cell(x, res[c], kind))
                group.entries = row[-1].entries
            try:
                flights[c] = reduce_from_tp_async(pre(x, c), group, kind)
            finally:
                group.entries = None
        if row is not None:
            cells.append(row)
        post, prev = nxt, row
    if post is None:
        return xs
    outs = [post(r, f.wait()) for r, f in zip(res, flights)]
    if prev is not None:
        for cell, out in zip(prev, outs):
            cell.out = out
    return outs


_ENGINE = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]


class _Tape:
    """The backward of a chunked pass, Domino's (arXiv 2409.15241): stage by stage from the last,
    chunk by chunk, each chunk's stage backward runs up to its region's entry, whose input gradient
    (with the passengers', as `copy_to_tp_with` sums them) is all-reduced asynchronously while the
    *next* chunk's stage backward computes; the chunk waits for it only when it comes back for its
    previous stage, whose backward it runs in one go with the rest of this one (the replicated part
    before the region: a norm; the residual's gradient). Autograd alone cannot run this order: on
    one graph its ready queue takes each chunk's region entry straight on to the replicated part,
    blocking on the all-reduce there; so the graph is cut at every region entry and at every
    stage's residual (`_Cell`), and this drives the pieces (as reentrant checkpointing runs its
    segments' backward inside a Function's). The sums are the unchunked ones."""

    def __init__(self, cells: list[list[_Cell]], group: TPGroup) -> None:
        self.cells, self.group = cells, group

    @staticmethod
    def _run(roots: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """One backward from `roots` (tensor, gradient): the same tensor's gradients summed."""
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for t, g in roots:
            if g is None or not t.requires_grad:
                continue
            for i, seen in enumerate(tensors):
                if seen is t:  # a region entered with the stage's input itself (BERT's post-norm)
                    grads[i] = grads[i] + g
                    break
            else:
                tensors.append(t)
                grads.append(g)
        if tensors:
            # The engine itself, as torch.autograd.backward calls it once it has checked its
            # arguments: these gradients are the tensors' own shapes and types by construction, and
            # the checks cost ~150 us a call, made once per chunk and stage of every block.
            _ENGINE.run_backward(tuple(tensors), tuple(grads), False, False, (), True, True)  # type: ignore[attr-defined]

    def _launch(self, cell: _Cell):
        """After a backward reached the cell's region entries: their all-reduce, launched."""
        grads = [inside.grad if inside.grad is not None else torch.zeros_like(inside)
                 for _, inside, _ in cell.entries if inside.requires_grad]
        if not grads:  # nothing there needs a gradient (alike on every rank: the model's, not a layout's)
            return cell, None, None
        buf = torch.cat([t.reshape(-1) for t in grads])
        with self.group.segment(cell.kind):
            return cell, buf, self.group.all_reduce_async(buf)

    @staticmethod
    def _rest(cell: _Cell, buf: torch.Tensor | None, pending) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Wait for the cell's all-reduce: the roots of the rest of its backward (the summed
        gradients at its region entries, the residual's at its input)."""
        roots = [(cell.x, cell.res.grad)]
        # Nothing of the cell is needed once these roots ran: dropped now, so that backward frees
        # each stage's activations as it goes, as autograd does on one graph.
        cell.x = cell.res = cell.out = None
        if pending is not None:
            pending.wait()
            offset = 0
            for outside, inside, passenger in cell.entries:
                if inside.requires_grad:
                    g = buf[offset:offset + inside.numel()].view(inside.shape)
                    offset += inside.numel()
                    # a passenger's gradient is copied out: a view would keep the whole buffer
                    # alive as long as the parameter's .grad (as `mappings._CopyToTPWith`)
                    roots.append((outside, g.clone() if passenger else g))
        cell.entries = []
        return roots

    def backward(self, gs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The chunks' output gradients -> their input gradients."""
        if not self.cells:
            return gs
        firsts = [cell.x for cell in self.cells[0]]  # the pass's input chunks: their gradients are the answer
        flying: list = [None] * len(gs)
        for s in reversed(range(len(self.cells))):
            for c, cell in enumerate(self.cells[s]):
                # the rest of the stage after this one (its all-reduce waited for) and this stage
                # up to its region entries, in one backward
                self._run(self._rest(*flying[c]) if flying[c] is not None else [(cell.out, gs[c])])
                flying[c] = self._launch(cell)
        for f in flying:
            self._run(self._rest(*f))
        self.cells = []
        return [x.grad for x in firsts]


class _ChunkedPass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor, stages: list, group: TPGroup,  # type: ignore[override]
                n: int) -> torch.Tensor:
        cells: list[list[_Cell]] = []
        xs = [_leaf(t).requires_grad_(ctx.needs_input_grad[0]) for t in torch.tensor_split(x.detach(), n)]
        with torch.enable_grad():
            outs = run_chunked(stages, xs, group, cells)
        ctx.tape, ctx.n = _Tape(cells, group), n
        return torch.cat([o.detach() for o in outs])

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        tape, ctx.tape = ctx.tape, None
        if tape is None:
            raise RuntimeError("a chunked pass's backward runs once (its cells' graphs are freed)")
        gx = tape.backward(list(torch.tensor_split(g, ctx.n)))
        dx = None if any(t is None for t in gx) or not ctx.needs_input_grad[0] else torch.cat(gx)
        return dx, None, None, None, None


def chunked_pass(stages: list[Stage], x: torch.Tensor, n: int, group: TPGroup) -> torch.Tensor:
    """x [B, ...] through the stages with its rows in n chunks, the forward's row-parallel
    all-reduces overlapped chunk by chunk (`run_chunked`) and, when a backward will come, the
    backward's region all-reduces too (`_Tape`). Row by row the unchunked sums."""
    if not torch.is_grad_enabled():
        return torch.cat(run_chunked(stages, list(torch.tensor_split(x, n)), group))
    # The anchor keeps the pass in the graph when x needs no gradient (a LoRA job's frozen
    # embeddings): its parameters' gradients come through the pass's own backward.
    anchor = x.new_zeros(0).requires_grad_()
    return _ChunkedPass.apply(x, anchor, stages, group, n)
