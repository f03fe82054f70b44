"""What hiding the wire saves a tensor-parallel plan (issue #37): the predicted iteration of a
layout with its all-reduces overlapped with compute, per overlap mode. Pure Python, no I/O.

The modes are the node runtime's (`node/tp/overlap.py`):

- `off`     every all-reduce blocks its rank (the plan's prediction as `planner` makes it);
- `bwd`     backward: each column-parallel region's input-gradient all-reduce travels while the
            region's weight-gradient GEMMs run (Megatron's async input-gradient all-reduce), its
            row layer's among them (left late by that layer: `overlap.late_weight_linear`);
- `cN`      chunking: the batch rows in N chunks, chunk k's all-reduces travelling while chunk
            k+1 computes, in the forward (the row-parallel layers') and the backward (the column
            regions' input gradients) alike (Domino).

**Model.** The plan's per-segment bottleneck compute (`PlanResult.segment_s`: the slowest node in
each segment, which every rank waits for at the segment's barrier) is cut per block into the
forward pass, the input-gradient work, and the weight gradients, which are the only work that can
hide a backward all-reduce:

    full fine-tuning   forward 1/3, weight gradients 1/3 (the region's column layers' and its row
                       layer's, which the runtime leaves late for the region's window), the rest of
                       backward 1/3
    LoRA               forward 1/2, backward 1/2; the frozen base has no weight gradient: nothing
                       hides a backward all-reduce (the adapters' gradients are tiny)

(a GEMM's backward is two GEMMs of its forward's size: its input's gradient and its weight's).
Until the row layers' weight gradients were left late (2026-12-06) only the column layers' half
(1/6) hid the all-reduce; the first `overlap-a` runs in `docs/planning.md` were made so. The link and the CPU are two
resources each used in order, and each all-reduce takes the longer of the link's time and the
slowest node's CPU for it (`commmodel.comm_time`). The forward pass is simulated as the runtime
schedules it: stage by stage (each block's attention, then its MLP), chunk by chunk; a chunk's
stage starts once its previous stage's all-reduce has landed, and an all-reduce starts once its
chunk's compute is done and the link is free. Backward without chunks runs region by region: the
input gradient, the all-reduce, and beside it (`bwd`) or before it (`off`) the weight gradients.
With chunks it is scheduled as the forward, stages in reverse (`overlap._Tape`, Domino's
backward): a chunk's whole stage backward (input and weight gradients, 2/3 of a full fine-tune's
stage, 1/2 of a LoRA job's) hides the previous chunk's all-reduce. The vocabulary segment and the
replicated one run as today, except that with `bwd` a trained causal-LM head's weight gradient
hides its input gradient's all-reduce.

**What chunks cost.** A chunk of r of the batch's B rows costs `T (a + (1 - a) r / B)`, so N
chunks cost `T (1 + (N - 1) a)` of the blocks' compute T instead of T: every chunk pays each
operation's dispatch again. Under LoRA `a` is the profile's own fixed share (`rows_fixed`, the
rows probe that data parallelism's rows use: dispatch and small GEMMs' lower speed, the tiny
adapters' step). A full fine-tune's rows probe is mostly its AdamW step, paid once per iteration
and not per chunk (0.32-0.36 on `bench/choice`'s `overlap-a` profiles, where a chunk measured
0.06-0.07): there, and without a probe, `a` is `FULL_CHUNK_FIXED`, what that cell measured per
extra chunk (chunking 8 x 64 tokens of GPT-2-medium's blocks into two added 6.9 % to the slowest
box's compute, into four 3 x 5.8 %). Smaller GEMMs pay more (`bench/overlap.py`'s MiniLM at 8 x 16
tokens: 21 %), which this under-predicts.
An asynchronous call's own CPU (Gloo's threads) is paid on the CPU beside the compute, at what the
profile measured for a call launched beside compute (`NodeComm.in_flight`; a blocking call's
cost when the profile predates that probe): as the virtual clock charges it, the median of the
call's CPU, which beside a busy thread is well above a blocking call's minimum.

**Prediction.** A mode's iteration is the plan's (`PlanResult.predicted_iteration_s`, unchanged)
less what the simulation says the mode saves over `off`; `off` is the plan as it is. The ideal
bound stays the planner's (no overlap), so a plan below it shows the gain past it.

Not modelled: the optimizer step (timed inside each layer's cost, so split like the rest), the
attention scores' share of a block (no weights, counted as weight GEMMs), the per-node spread
inside a segment (the slowest node's time is used throughout), and the extra memory of chunking
(none: a chunk's activations are the batch's, cut in rows).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from xronos.gateway.plan.commmodel import CommVolume, NodeComm, comm_time

__all__ = ["FULL_CHUNK_FIXED", "MODES", "OverlapMode", "OverlapPrediction", "TPShape", "mode_of",
           "predict_modes", "best_mode", "chunk_share", "fixed_share"]

FULL_CHUNK_FIXED = 0.07


@dataclass(frozen=True)
class OverlapMode:
    backward: bool  # the input-gradient all-reduces beside the weight gradients
    chunks: int  # the batch rows in this many chunks (1: none)

    @property
    def label(self) -> str:
        if self.chunks > 1:
            return f"c{self.chunks}"
        return "bwd" if self.backward else "off"

    @property
    def on(self) -> bool:
        return self.backward or self.chunks > 1


OFF = OverlapMode(False, 1)
MODES: tuple[OverlapMode, ...] = (OFF, OverlapMode(True, 1), OverlapMode(True, 2), OverlapMode(True, 4))


def mode_of(label: str) -> OverlapMode:
    """`off`, `bwd` or `cN` (N >= 2) as a mode; ValueError naming the label otherwise."""
    if label == "off":
        return OFF
    if label == "bwd":
        return OverlapMode(True, 1)
    if label.startswith("c") and label[1:].isdigit() and int(label[1:]) >= 2:
        return OverlapMode(True, int(label[1:]))
    raise ValueError(f"overlap mode {label!r}: off, bwd or cN (N >= 2 chunks)")


@dataclass(frozen=True)
class TPShape:
    """What the overlap model needs of a job besides the plan: one activation all-reduce's bytes
    (batch x seq x hidden x 4), the blocks, the task, the batch's rows (no chunk without one) and
    whether the base weights train (False: LoRA)."""

    act_bytes: float
    blocks: int
    task: str
    rows: int
    trains_weights: bool


@dataclass(frozen=True)
class OverlapPrediction:
    mode: OverlapMode
    iteration_s: float  # predicted, with the mode
    saved_s: float  # what the mode saves over `off` (negative: it costs)
    chunk_overhead_s: float  # the compute chunking adds


def _link(nbytes: float, n: int, bandwidth_Bps: float, latency_s: float, cpu: Sequence[NodeComm]) -> float:
    return comm_time(CommVolume(1, nbytes), n, bandwidth_Bps, latency_s, cpu)


@dataclass(frozen=True)
class _Lane:
    """Who the simulation waits for: a node's per-segment compute and the CPU one launched call of
    the mode's size costs it. Without per-node times there is one lane, the plan's bottleneck
    segments with the costliest node's call: the slowest node and the costliest call taken as one
    (which overstates a mode when they are different nodes)."""

    seg: Mapping[str, float]
    own_s: float


def _lanes(seg: Mapping[str, float], node_seg: Sequence[Mapping[str, float]] | None, nbytes: float, n: int,
           node_cpu: Sequence[NodeComm | None]) -> list[_Lane]:
    """The simulation's lanes for calls of `nbytes` (`_Lane`). With `node_seg` (the plan's rows,
    rank order, as `node_cpu`), one lane per node, each paying its own launched call (a node
    without a probe: the costliest measured one)."""
    fly = [c.in_flight() if c is not None else None for c in node_cpu]
    known = [x.allreduce_s(nbytes, n) for x in fly if x is not None]
    worst = max(known, default=0.0)
    if node_seg is None:
        return [_Lane(seg, worst)]
    own = [fly[d].allreduce_s(nbytes, n) if d < len(fly) and fly[d] is not None else worst  # type: ignore[union-attr]
           for d in range(len(node_seg))]
    return [_Lane(s, o) for s, o in zip(node_seg, own)]


def _simulate(seg: Mapping[str, float], shape: TPShape, mode: OverlapMode, n: int, bandwidth_Bps: float,
              latency_s: float, node_cpu: Sequence[NodeComm | None], fixed: float,
              node_seg: Sequence[Mapping[str, float]] | None = None) -> tuple[float, float]:
    """(iteration seconds, chunking's added compute) of the mode, in the module's model. Each
    piece of compute between two all-reduces ends when the last lane's ends (`_lanes`)."""
    cpu = [c for c in node_cpu if c is not None]
    B, c = shape.blocks, mode.chunks
    grow = 1 + (c - 1) * fixed  # N chunks' compute over one pass's
    f, w = (1 / 3, 1 / 3) if shape.trains_weights else (1 / 2, 0.0)
    g = 1 - f - w
    lanes = _lanes(seg, node_seg, shape.act_bytes / c, n, node_cpu)
    # one chunk's compute per block and lane: attention's stage, then the MLP's
    stages = [[ln.seg.get(kind, 0.0) / max(B, 1) * grow / c for kind in ("attn", "mlp")] for ln in lanes]

    def slowest(i: int, share: float, own: bool) -> float:
        """Stage i's `share` of compute (plus, `own`, a launched call's CPU) on the lane that takes longest."""
        return max(share * st[i] + (ln.own_s if own else 0.0) for st, ln in zip(stages, lanes))

    # a launched call costs a node's CPU more than a blocking one (`NodeComm.in_flight`): its
    # share of the link's max and what it takes from the compute beside it
    fly = [x.in_flight() for x in cpu]
    l_block = _link(shape.act_bytes / c, n, bandwidth_Bps, latency_s, cpu)
    l_chunk = _link(shape.act_bytes / c, n, bandwidth_Bps, latency_s, fly) if mode.on else l_block
    # forward: stage-major, chunk-minor (`overlap.run_chunked`); c = 1 blocks at every all-reduce
    t_cpu, t_link, ready = 0.0, 0.0, [0.0] * c
    for _ in range(B):
        for i in range(2):
            for k in range(c):
                start = max(t_cpu, ready[k])
                t_cpu = start + slowest(i, f, c > 1 and mode.on)
                t_link = ready[k] = max(t_cpu, t_link) + (l_chunk if c > 1 else l_block)
                if c == 1:
                    t_cpu = t_link
    forward = max(t_cpu, *ready)
    if c > 1:
        # backward chunked as the forward (`overlap._Tape`): stage by stage from the last, chunk by
        # chunk, a chunk's stage backward (input and weight gradients) once its previous all-reduce
        # (the stage after, in forward order) has landed; its all-reduce then travels while the
        # next chunk computes
        t_cpu, t_link, ready = 0.0, 0.0, [0.0] * c
        for _ in range(B):
            for i in (1, 0):
                for k in range(c):
                    t_cpu = max(t_cpu, ready[k]) + slowest(i, g + w, True)
                    t_link = ready[k] = max(t_cpu, t_link) + l_chunk
        backward = max(t_cpu, *ready)
    else:
        # backward: region by region; the input gradient, then the weight gradients beside (bwd)
        # or before (off) the all-reduce
        per_region = 0.0
        for i in range(2):
            if mode.backward:
                per_region += slowest(i, g, False) + max(slowest(i, w, True), l_chunk)
            else:
                per_region += slowest(i, g + w, False) + l_block
        backward = B * per_region
    # the vocabulary segment: the embedding's all-reduce, and a causal LM head's input-gradient one,
    # which a trained head's weight gradient hides under bwd (cross-entropy's three small
    # all-reduces block in every mode alike: they do not change what a mode saves)
    v_seg = max(ln.seg.get("vocab", 0.0) for ln in lanes)
    l_act = _link(shape.act_bytes, n, bandwidth_Bps, latency_s, cpu)
    vocab = v_seg + l_act
    if shape.task == "causal-lm":
        head_w = v_seg / 3 if shape.trains_weights else 0.0
        l_fly = _link(shape.act_bytes, n, bandwidth_Bps, latency_s, fly)
        vocab += max(l_fly - head_w, 0.0) if mode.backward else l_act
    out = max(ln.seg.get("out", 0.0) for ln in lanes)
    blocks = sum(max(ln.seg.get(kind, 0.0) for ln in lanes) for kind in ("attn", "mlp"))  # the plan's bottleneck's
    return forward + backward + vocab + out, (grow - 1) * blocks


def predict_modes(seg: Mapping[str, float], predicted_s: float, shape: TPShape, n_nodes: int, *,
                  bandwidth_Bps: float, latency_s: float, node_cpu: Sequence[NodeComm | None] = (),
                  rows_fixed: float | None = None, modes: Sequence[OverlapMode] = MODES,
                  chunk_fixed: float | None = None,
                  node_seg: Sequence[Mapping[str, float]] | None = None) -> tuple[OverlapPrediction, ...]:
    """Each mode's prediction for a plan with per-segment bottleneck compute `seg` and predicted
    iteration `predicted_s` (without overlap) on `n_nodes` nodes; `rows_fixed`: the profiles'
    fixed share (`fixed_share`), what a chunk costs under LoRA (module docstring); `chunk_fixed`,
    when given, is that share whatever the job. `node_seg`: each node's own segment times (the
    plan's rows, in `node_cpu`'s order), so that each node pays its own launched calls beside its
    own compute (without them the slowest node pays the costliest call). Modes with more chunks
    than the batch has rows are left out; so is everything but `off` for one node (nothing to hide)."""
    fixed = chunk_fixed if chunk_fixed is not None else chunk_share(shape, rows_fixed)
    if node_seg is not None and len(node_seg) != n_nodes:
        raise ValueError(f"node_seg: {len(node_seg)} nodes' segment times for {n_nodes} nodes")
    link = (n_nodes, bandwidth_Bps, latency_s, tuple(node_cpu), fixed, node_seg)
    base, _ = _simulate(seg, shape, OFF, *link)
    out = []
    for m in modes:
        if m.chunks > shape.rows or (n_nodes < 2 and m.on):
            continue
        t, extra = _simulate(seg, shape, m, *link)
        out.append(OverlapPrediction(m, predicted_s - (base - t), base - t, extra))
    return tuple(out)


def best_mode(preds: Sequence[OverlapPrediction]) -> OverlapPrediction:
    """The fastest prediction; `off` (the first) on a tie within a millisecond's thousandth."""
    best = preds[0]
    for p in preds[1:]:
        if p.iteration_s < best.iteration_s * (1 - 1e-6):
            best = p
    return best


def chunk_share(shape: TPShape, rows_fixed: float | None) -> float:
    """What each chunk past the first adds, as a share of the blocks' compute (module docstring):
    a LoRA job's measured fixed share (`fixed_share`), else `FULL_CHUNK_FIXED`."""
    lora_probe = not shape.trains_weights and rows_fixed is not None and rows_fixed > 0
    return rows_fixed if lora_probe and rows_fixed is not None else FULL_CHUNK_FIXED


def fixed_share(values: Sequence[float]) -> float | None:
    """The chunk model's fixed share from the nodes' `rows_fixed` (the largest measured; None: none)."""
    measured = [v for v in values if v > 0 and math.isfinite(v)]
    return max(measured) if measured else None
