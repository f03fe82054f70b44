"""Live re-sharding: move a running model (and its AdamW state) from one layout to another at an
iteration boundary, over the job's TPGroup, without a restart or a checkpoint round trip.

Every partitioned tensor's local part is the concatenation, along its `dim`, of the segments its
module's `Split` names (`TensorSpec.segments`). Under the old layout rank r holds segments S_r, under
the new one rank s needs T_s; the elements that go from r to s are the intersections of S_r and T_s
(`transfer_plan`, pure: every rank computes the same plan from the two layouts, nothing about the
plan travels). Each rank then sends every peer, in one message per dtype, exactly those slices of
the weight and of every per-element optimizer state (AdamW's exp_avg and exp_avg_sq; the step
count is a replicated scalar and stays), keeps what stays on itself, and receives the rest
(`TPGroup.exchange`). Replicated tensors do not move: the new model takes them as they are.

The model is rebuilt at the new layout on the meta device (`Family.build`) and the moved tensors
are installed as its parameters; the optimizer object is kept (the LR scheduler holds it, and its
hyper-parameters and step count stay) and re-pointed at the new parameters with the moved state.

The tensors move in batches (`move_batches`: consecutive tensors up to `MOVE_BATCH_BYTES` of full
tensor, weights and moments; the same batches on every rank, from the plan alone), one exchange
each, and a batch's old local parts are freed as soon as its new parts are whole. So a rank holds
at most its old shard, the new parts of the batches done, and one batch's pieces in flight, not a
second whole shard beside the first: a Set-B TinyLlama rank on a LattePanda's cap needed 2,088 MiB
more for the move in one exchange, with 1,643 MiB of room. `move_peak_bytes` is that peak, and a
move a rank has no room for is refused before anything moves (`xronos.node.rank.relayout.move`);
every check that can refuse a move runs before the first exchange, since after it the old shard is
going.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from xronos.node.models.specs import TensorSpec
from xronos.node.tp.group import TPGroup
from xronos.node.tp.layout import ShardLayout
from xronos.protocol.layout import Layout, LayoutError

Specs = Mapping[str, TensorSpec]
MOVE_BATCH_BYTES = 64 << 20  # full tensors (weights and moments) per exchange: the peak's step


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + length) of tensor `name`'s full dimension `dim`, found at offset
    `src_off` of the sender's local tensor and going to offset `dst_off` of the receiver's."""

    name: str
    dim: int
    start: int
    length: int
    src_off: int
    dst_off: int


@dataclass(frozen=True)
class TransferPlan:
    """Every partitioned tensor's pieces, per (sender, receiver) pair; (r, r) is what rank r keeps."""

    world_size: int
    moves: dict[tuple[int, int], tuple[Piece, ...]]
    shapes: dict[str, tuple[int, ...]]  # full shapes of the partitioned tensors (for piece sizes)

    def pieces(self, src: int, dst: int) -> tuple[Piece, ...]:
        return self.moves.get((src, dst), ())

    def piece_elements(self, p: Piece) -> int:
        """Elements of one tensor's piece (the full shape with `dim` cut to the piece)."""
        n = p.length
        for d, size in enumerate(self.shapes[p.name]):
            if d != p.dim:
                n *= size
        return n

    def elements(self, src: int, dst: int) -> int:
        return sum(self.piece_elements(p) for p in self.pieces(src, dst))

    def moved_elements(self) -> int:
        """Elements per tensor kind (weight, each moment) that cross the network, all ranks together."""
        return sum(self.elements(s, d) for (s, d) in self.moves if s != d)

    def kept_elements(self) -> int:
        return sum(self.elements(r, r) for r in range(self.world_size))


def _offsets(segments: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(start, stop, local offset) of each segment in the local tensor."""
    out, off = [], 0
    for a, b in segments:
        out.append((a, b, off))
        off += b - a
    return out


def transfer_plan(old: Sequence[Specs], new: Sequence[Specs]) -> TransferPlan:
    """The pieces of every partitioned tensor that go from each rank (under `old`, its specs per
    rank) to each rank (under `new`). Pure. Refuses specs of different models or worlds, and a new
    layout whose parts the old one does not cover exactly (LayoutError naming the tensor)."""
    if len(old) != len(new) or not old:
        raise LayoutError(f"re-shard: {len(old)} ranks before, {len(new)} after (the world stays the same)")
    world = len(old)
    names = list(old[0])
    for r in range(world):
        if list(old[r]) != names or list(new[r]) != names:
            raise LayoutError(f"re-shard: rank {r}'s tensors differ between the layouts (another model?)")
    moves: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    shapes: dict[str, tuple[int, ...]] = {}
    for name in names:
        ref = old[0][name]
        for specs in (*old, *new):
            s = specs[name]
            if (s.dim, s.full_shape) != (ref.dim, ref.full_shape):
                raise LayoutError(f"re-shard: {name} is {s.dim}/{list(s.full_shape)} on one rank and "
                                  f"{ref.dim}/{list(ref.full_shape)} on another")
        if ref.dim is None:
            continue
        shapes[name] = ref.full_shape
        for dst in range(world):
            need = new[dst][name]
            got = 0
            for src in range(world):
                for a, b, o in _offsets(old[src][name].segments):
                    for c, d, p in _offsets(need.segments):
                        lo, hi = max(a, c), min(b, d)
                        if hi > lo:
                            moves[(src, dst)].append(Piece(name, ref.dim, lo, hi - lo, o + lo - a, p + lo - c))
                            got += hi - lo
            if got != need.local_shape[ref.dim]:
                raise LayoutError(f"re-shard: {name} on rank {dst} needs {need.local_shape[ref.dim]} elements "
                                  f"along dim {ref.dim}, the old layout holds {got} of them")
    return TransferPlan(world, {k: tuple(v) for k, v in moves.items()}, shapes)


def specs_per_rank(family: Any, config: dict[str, Any], task: str, layout: Layout,
                   dropout: float | None = None, lora: Any = None) -> list[dict[str, TensorSpec]]:
    """Every rank's spec table under `layout`, from meta-device builds (no storage, no peers);
    with `lora` (LoraSettings) the adapters are added as the engine adds them."""
    from xronos.node.tp.lora import add_lora

    out = []
    for r in range(layout.world_size):
        model = family.build(config, task, ShardLayout.of(layout, r), TPGroup.alone(layout.world_size, r),
                             dropout=dropout)
        if lora is not None:
            add_lora(model, lora)
        out.append(model.tensor_specs())
    return out


def moved_bytes(plan: TransferPlan, model: nn.Module, opt: torch.optim.Optimizer | None) -> int:
    """Bytes the plan sends over the network, all ranks together: weights and per-element
    optimizer state of the pieces that change rank (the same figure on every rank)."""
    params = dict(model.named_parameters())
    moments = _moment_names(opt, params) if opt is not None else {}
    return sum(plan.piece_elements(p) * len(_kinds(p.name, moments)) * params[p.name].element_size()
               for (src, dst), pieces in plan.moves.items() if src != dst for p in pieces)


def move_batches(plan: TransferPlan, model: nn.Module, opt: torch.optim.Optimizer | None,
                 batch_bytes: int = MOVE_BATCH_BYTES) -> list[list[str]]:
    """The partitioned tensors in the order they move, cut into consecutive batches of at most
    `batch_bytes` of full tensor (weights and per-element moments; a bigger tensor is a batch of
    its own). From the plan, the dtypes and the moments only, so every rank cuts the same batches."""
    params = dict(model.named_parameters())
    moments = _moment_names(opt, params) if opt is not None else {}
    out: list[list[str]] = []
    size = 0
    for name, shape in plan.shapes.items():
        n = math.prod(shape) * len(_kinds(name, moments)) * params[name].element_size()
        if not out or size + n > batch_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += n
    return out


def move_peak_bytes(plan: TransferPlan, model: nn.Module, opt: torch.optim.Optimizer | None, rank: int,
                    batch_bytes: int = MOVE_BATCH_BYTES) -> int:
    """Bytes `rank` holds at the worst moment of the move on top of what it holds before: over the
    batches, the new parts of the batches done and of this one (weights and per-element optimizer
    state), less the old parts of the batches done (freed), plus this batch's outgoing and incoming
    pieces, packed per dtype, alive while its new parts fill."""
    params = dict(model.named_parameters())
    moments = _moment_names(opt, params) if opt is not None else {}

    def size(p: Piece) -> int:
        return plan.piece_elements(p) * len(_kinds(p.name, moments)) * params[p.name].element_size()

    new: dict[str, int] = defaultdict(int)
    old: dict[str, int] = defaultdict(int)
    flight: dict[str, int] = defaultdict(int)
    for (src, dst), pieces in plan.moves.items():
        for p in pieces:
            new[p.name] += size(p) if dst == rank else 0  # every piece it ends with, its own included
            old[p.name] += size(p) if src == rank else 0  # every piece it starts with goes somewhere
            flight[p.name] += size(p) if src != dst and rank in (src, dst) else 0  # packed, or received
    peak = held = 0
    for batch in move_batches(plan, model, opt, batch_bytes):
        held += sum(new[n] for n in batch)
        peak = max(peak, held + sum(flight[n] for n in batch))
        held -= sum(old[n] for n in batch)
    return peak


def _moment_names(opt: torch.optim.Optimizer, params: Mapping[str, nn.Parameter]) -> dict[str, list[str]]:
    """Per parameter, the optimizer state entries shaped like it (AdamW's moments), sorted."""
    out = {}
    for name, p in params.items():
        state = opt.state.get(p, {})
        out[name] = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == p.shape and v.dim() > 0)
    return out


def _kinds(name: str, moments: Mapping[str, list[str]]) -> list[str]:
    return ["weight", *moments.get(name, [])]


@torch.no_grad()
def reshard(model: nn.Module, opt: torch.optim.Optimizer | None, plan: TransferPlan, build_new: Any,
            group: TPGroup, batch_bytes: int = MOVE_BATCH_BYTES) -> nn.Module:
    """Collective: move `model` (and `opt`'s per-element state) to the layout `plan` leads to.
    `build_new()` makes the model at the new layout on the meta device. Returns the new model, its
    parameters holding the moved tensors; `opt` now steps them. Every rank calls it with the same
    plan, and with the same optimizer state present (same trainable parameters, same steps).
    A LayoutError comes before anything moves, the old model whole; once the tensors move, the old
    model's partitioned tensors are freed batch by batch (`move_batches`) and it is not to be used."""
    rank = group.rank
    params = dict(model.named_parameters())
    moments = _moment_names(opt, params) if opt is not None else {}
    new_model = build_new()
    new_specs = new_model.tensor_specs()
    for name, old_p in params.items():
        if name not in plan.shapes and tuple(old_p.shape) != new_specs[name].local_shape:
            raise LayoutError(f"re-shard: {name} is replicated as {list(old_p.shape)}, the new layout needs "
                              f"{list(new_specs[name].local_shape)}")

    def local(name: str, kind: str) -> torch.Tensor:
        p = params[name]
        return p.detach() if kind == "weight" else opt.state[p][kind]

    dtypes = sorted({str(local(n, k).dtype) for n in plan.shapes for k in _kinds(n, moments)})
    fresh: dict[tuple[str, str], torch.Tensor] = {}
    for batch in move_batches(plan, model, opt, batch_bytes):
        names = set(batch)

        def only(pieces: Sequence[Piece]) -> list[Piece]:
            return [p for p in pieces if p.name in names]

        # Outgoing: per peer and dtype, every piece of the batch's tensor kinds, flattened in plan order.
        sends: dict[int, list[torch.Tensor]] = {}
        recvs: dict[int, list[torch.Tensor]] = {}
        for peer in range(group.world_size):
            if peer == rank:
                continue
            out = _pack(only(plan.pieces(rank, peer)), local, moments, dtypes)
            if out:
                sends[peer] = out
            size = _sizes(plan, only(plan.pieces(peer, rank)), local, moments, dtypes)
            if size:
                recvs[peer] = [torch.empty(n, dtype=getattr(torch, dt.removeprefix("torch."))) for dt, n in size]
        group.exchange(sends, recvs)
        del sends
        for name in batch:
            for k in _kinds(name, moments):
                fresh[(name, k)] = torch.empty(new_specs[name].local_shape, dtype=local(name, k).dtype)
        for src in range(group.world_size):
            pieces = only(plan.pieces(src, rank))
            if src == rank:
                for p in pieces:
                    for k in _kinds(p.name, moments):
                        fresh[(p.name, k)].narrow(p.dim, p.dst_off, p.length).copy_(
                            local(p.name, k).narrow(p.dim, p.src_off, p.length))
            elif pieces:
                _unpack(plan, pieces, recvs[src], fresh, moments, dtypes)
        del recvs
        for name in batch:  # the old parts are whole elsewhere now: their memory goes to the next batch
            _free(params[name], opt, moments.get(name, []))

    new_params = {}
    for name, old_p in params.items():
        t = fresh.get((name, "weight"), old_p.detach())  # a replicated tensor stays as it is
        new_params[name] = nn.Parameter(t, requires_grad=old_p.requires_grad)
        module_name, _, leaf = name.rpartition(".")
        setattr(new_model.get_submodule(module_name), leaf, new_params[name])
    _carry_model_state(model, new_model)
    if opt is not None:
        _repoint(opt, params, new_params, {key: t for key, t in fresh.items() if key[1] != "weight"})
    return new_model


def _free(p: nn.Parameter, opt: torch.optim.Optimizer | None, moments: Sequence[str]) -> None:
    """Let go of a moved parameter's old local part: its storage, its gradient and its moments (the
    Parameter object stays, keyed in the optimizer until `_repoint`)."""
    p.data = torch.empty(0, dtype=p.dtype)
    p.grad = None
    if opt is not None and p in opt.state:
        for k in moments:
            opt.state[p][k] = torch.empty(0, dtype=opt.state[p][k].dtype)


def _pack(pieces: Sequence[Piece], local, moments, dtypes: list[str]) -> list[torch.Tensor]:
    by_dtype: dict[str, list[torch.Tensor]] = defaultdict(list)
    for p in pieces:
        for k in _kinds(p.name, moments):
            t = local(p.name, k)
            by_dtype[str(t.dtype)].append(t.narrow(p.dim, p.src_off, p.length).reshape(-1))
    return [torch.cat(by_dtype[dt]) for dt in dtypes if by_dtype.get(dt)]


def _sizes(plan: TransferPlan, pieces: Sequence[Piece], local, moments, dtypes: list[str]) -> list[tuple[str, int]]:
    """(dtype, elements) of each incoming buffer, in the sender's order (`_pack`)."""
    total: dict[str, int] = defaultdict(int)
    for p in pieces:
        for k in _kinds(p.name, moments):
            total[str(local(p.name, k).dtype)] += plan.piece_elements(p)
    return [(dt, total[dt]) for dt in dtypes if total.get(dt)]


def _unpack(plan: TransferPlan, pieces: Sequence[Piece], bufs: list[torch.Tensor],
            fresh: dict[tuple[str, str], torch.Tensor], moments, dtypes: list[str]) -> None:
    by_dtype = {str(b.dtype): b for b in bufs}
    at: dict[str, int] = defaultdict(int)
    for p in pieces:
        for k in _kinds(p.name, moments):
            dst = fresh[(p.name, k)].narrow(p.dim, p.dst_off, p.length)
            dt, n = str(dst.dtype), plan.piece_elements(p)
            dst.copy_(by_dtype[dt][at[dt]:at[dt] + n].view(dst.shape))
            at[dt] += n
    for dt, b in by_dtype.items():
        assert at[dt] == b.numel(), (dt, at[dt], b.numel())


def _carry_model_state(old: nn.Module, new: nn.Module) -> None:
    """What the model carries besides its parameters: train/eval mode and the dropout streams'
    positions (replicated and per-rank), so the run goes on drawing where it left off."""
    new.train(old.training)
    streams_old, streams_new = getattr(old, "streams", None), getattr(new, "streams", None)
    if streams_old is not None and streams_new is not None:
        streams_new.replicated.set_state(streams_old.replicated.get_state())
        streams_new.local.set_state(streams_old.local.get_state())


def _repoint(opt: torch.optim.Optimizer, old: Mapping[str, nn.Parameter], new: Mapping[str, nn.Parameter],
             moved: Mapping[tuple[str, str], torch.Tensor]) -> None:
    """The same optimizer (hyper-parameters, LR schedule, step counts) over the new parameters: a
    replicated parameter keeps its state tensors, a partitioned one gets its moved moments."""
    name_of = {id(p): n for n, p in old.items()}
    state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
    for group in opt.param_groups:
        group["params"] = [new[name_of[id(p)]] for p in group["params"]]
    for name, p_old in old.items():
        if p_old not in opt.state:
            continue
        st = dict(opt.state[p_old])
        for k in list(st):
            if (name, k) in moved:
                st[k] = moved[(name, k)]
        state[new[name]] = st
    opt.state = state
