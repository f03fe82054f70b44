"""Which parallelism a job runs: every candidate predicted from the same profiles, side by side,
and `auto`'s pick. Pure Python, no I/O: the planner (`planner.plan`), the data-parallel cost model
(`dpcost.predict_dp`) and the DP×TP meshes (`mesh.plan_mesh`) each predict their own candidate.

Candidates (`auto` predicts all of them):

- `segment`  uneven tensor parallelism over every node (`planner.plan`, the exact per-segment
             search): compute `sum_seg max_d T_d,seg`, plus the activation all-reduces' `comm_s`.
             Infeasible when no layout fits the caps (the planner's message says why).
- `dp`       speed-weighted data parallelism: every node a whole replica, rows of each global batch
             by `shares.balanced_shares` over the nodes' row speeds, the gradient all-reduce
             bucketed and partly hidden behind backward (`dpcost`). Infeasible when a replica does
             not fit a node's cap (each node's need and cap named).
- `mesh`     DP×TP: the nodes cut into equal TP groups, one common layout, batch rows per group by
             group speed (`mesh.py` says which meshes are searched, exactly and beyond).

A TP candidate may hide its all-reduces behind compute (issue #37; the job's `overlap`):
`overlapcost.predict_modes` predicts each overlap mode, each node paying its own launched calls
beside its own compute, and the fastest is kept (`with_overlap`); its label names the mode. The
layout and the mode are chosen together: for `segment`, each overlapping mode also gets a layout
planned for it (`for_mode`: chunking's added compute and each node's launched calls' CPU in the
blocks' segments, so a slow box, which pays a call at its own speed, takes fewer columns), and
the pair predicted fastest wins, the layout planned without overlap among them.

`auto` picks the feasible candidate with the least predicted iteration; a tie (within
`TIE_REL`) goes to the earlier candidate in the order above, so to TP `segment` first: the
strategy with the most field time. `paper` and `uniform` stay forced strategies (baselines): the
`segment` search is exact over the layouts they are special cases of (they never predict less).

Every candidate keeps its predicted iteration, compute and communication, its worst node's memory
against that node's cap, whether it is feasible and why not, and the winner says why it won.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from xronos.gateway.plan.commmodel import DEFAULT_BANDWIDTH_BPS, DEFAULT_LATENCY_S, CommVolume, NodeComm
from xronos.gateway.plan.costmodel import KindCost, NodeCost
from xronos.gateway.plan.dpcost import DPPrediction, predict_dp
from xronos.gateway.plan.mesh import MeshPrediction, plan_mesh
from xronos.gateway.plan.model import MiB
from xronos.gateway.plan.overlapcost import MODES, OFF, OverlapMode, OverlapPrediction, TPShape, best_mode, \
    chunk_share, fixed_share, predict_modes
from xronos.gateway.plan.planner import DEFAULT_BUDGET, InfeasiblePlan, PlanResult, plan, relayout
from xronos.protocol.layout import Layout, Sizes

__all__ = ["AUTO_CANDIDATES", "CHOICES", "Candidate", "Choice", "TIE_REL", "TRIAL_MODES", "choose", "for_mode",
           "trial_modes"]

AUTO_CANDIDATES: tuple[str, ...] = ("segment", "dp", "mesh")
CHOICES: tuple[str, ...] = ("auto", "segment", "dp", "paper", "uniform")  # what a job or `xronos plan` may ask
# Predictions closer than this (relative) are a tie: the cost model is not that exact.
TIE_REL = 1e-9
TRIAL_MODES = 3  # overlap modes a plan's trial measures (`trial_modes`)


@dataclass(frozen=True)
class Candidate:
    strategy: str  # "segment", "dp", "mesh", or a forced "paper" / "uniform"
    label: str  # e.g. "segment (TP over 4)", "dp (4 replicas)", "mesh 2x2"
    feasible: bool
    iteration_s: float  # predicted; inf when nothing could be planned
    compute_s: float
    comm_s: float  # the communication the iteration pays beyond compute (DP: what backward does not hide)
    worst_node: str | None  # the node nearest (or furthest over) its cap
    worst_memory: float  # its predicted peak, bytes (0 when nothing could be planned)
    worst_cap: float
    why_not: str | None = None  # infeasible: why
    tp: PlanResult | None = None
    dp: DPPrediction | None = None
    mesh: MeshPrediction | None = None
    overlap: OverlapPrediction | None = None  # a TP candidate's overlap mode (None: every all-reduce blocks)
    # Every mode the job allows, predicted on this candidate's layout, the candidate's own first
    # and the rest fastest first (`trial_modes`); and the modes whose fastest predicted layout is
    # another one, with their prediction and plan there (where a trial that keeps such a mode
    # moves the ranks)
    ranked: tuple[OverlapPrediction, ...] = ()
    own_plans: tuple[tuple[OverlapMode, OverlapPrediction, PlanResult], ...] = ()

    @property
    def own_layouts(self) -> tuple[tuple[OverlapMode, Layout], ...]:
        return tuple((m, r.layout) for m, _, r in self.own_plans)

    def summary(self) -> str:
        """One line: the label and its predicted time, or why it cannot run."""
        if not math.isfinite(self.iteration_s):
            return f"{self.label}: cannot plan ({_first_line(self.why_not)})"
        text = f"{self.label} {self.iteration_s:.4f} s"
        return text if self.feasible else f"{text} but does not fit ({_first_line(self.why_not)})"


@dataclass(frozen=True)
class Choice:
    asked: str  # "auto" or the forced strategy
    sizes: Sizes
    winner: Candidate
    candidates: tuple[Candidate, ...]  # every one predicted, in AUTO_CANDIDATES order (forced: just it)
    why: str

    @property
    def runner_up(self) -> Candidate | None:
        rest = sorted((c for c in self.candidates if c is not self.winner and math.isfinite(c.iteration_s)),
                      key=lambda c: (not c.feasible, c.iteration_s))
        return rest[0] if rest else None


def _first_line(text: str | None) -> str:
    return (text or "").splitlines()[0] if text else ""


def _worst(pairs: Sequence[tuple[str, float, float]]) -> tuple[str | None, float, float]:
    """(node, need, cap) with the highest need / cap."""
    if not pairs:
        return None, 0.0, 0.0
    return max(pairs, key=lambda p: p[1] / p[2] if p[2] > 0 else math.inf)


def tp_candidate(result: PlanResult, label: str | None = None) -> Candidate:
    node, need, cap = _worst([(r.node_id, r.predicted_memory, r.memory_cap) for r in result.rows])
    over = [f"{r.node_id} needs {r.predicted_memory / MiB:,.0f} MiB, cap {r.memory_cap / MiB:,.0f} MiB"
            for r in result.rows if r.over_cap]
    return Candidate(result.strategy, label or f"{result.strategy} (TP over {len(result.rows)})", result.feasible,
                     result.predicted_iteration_s, result.bottleneck_s, result.comm_s, node, need, cap,
                     None if result.feasible else "over the memory cap: " + "; ".join(over), tp=result)


def for_mode(nd: NodeCost, comm: NodeComm | None, mode: OverlapMode, shape: TPShape, n_nodes: int,
             fixed: float, worst_call_s: float = 0.0) -> NodeCost:
    """The node's costs as `mode` runs its blocks, for planning a layout for that mode: chunking's
    added compute (`1 + (N - 1) fixed` of the blocks' kinds, `overlapcost`) and the CPU of the
    calls it launches beside its compute, which it pays at its own speed (per block and stage: N
    in forward and N in backward with N chunks; one in backward for `bwd`). `worst_call_s`: what
    a node without a collective probe is charged a call. Memory is unchanged (a chunk's
    activations are the batch's, cut in rows)."""
    c = mode.chunks
    grow = 1 + (c - 1) * fixed
    calls = shape.blocks * (2 * c if c > 1 else 1) if mode.on else 0
    own = comm.in_flight().allreduce_s(shape.act_bytes / c, n_nodes) if comm is not None else worst_call_s

    def scaled(k: KindCost) -> KindCost:
        return replace(k, fixed_s=k.fixed_s * grow + calls * own, icpt_s=k.icpt_s * grow, slope_s=k.slope_s * grow)

    return replace(nd, attn=scaled(nd.attn), mlp=scaled(nd.mlp))


def with_overlap(c: Candidate, nodes: Sequence[NodeCost], shape: TPShape | None, overlap: str,
                 chunks: int | None, *, bandwidth_Bps: float, latency_s: float,
                 node_cpu: Sequence[NodeComm | None], caps: Sequence[float] | None = None,
                 budget: int = DEFAULT_BUDGET) -> Candidate:
    """A TP candidate with the overlap mode the job asks for: `off` as it is; `auto` the fastest
    predicted mode (`off` among them); `on` the fastest overlapping one, or `chunks` chunks. With
    `caps` (the plan's memory caps) a `segment` candidate's overlapping modes are also predicted
    on a layout planned for each (`for_mode`), and the fastest pair is kept."""
    if overlap not in ("auto", "off", "on"):
        raise ValueError(f"overlap must be auto, off or on, got {overlap!r}")
    if chunks is not None and shape is not None and chunks > shape.rows:
        raise ValueError(f"chunks {chunks} leaves a chunk without a row: the batch has {shape.rows} rows "
                         f"(at most {shape.rows} chunks)")
    if c.tp is None or overlap == "off" or shape is None or len(c.tp.rows) < 2:
        return c
    modes: tuple[OverlapMode, ...] = MODES if overlap == "auto" else tuple(m for m in MODES if m != OFF)
    if chunks is not None:
        modes = (OverlapMode(True, chunks),)
    fixed = fixed_share([n.rows_fixed for n in nodes])
    n = len(c.tp.rows)

    def predict(tp: PlanResult, ms: Sequence[OverlapMode]) -> tuple[OverlapPrediction, ...]:
        return predict_modes(tp.segment_s, tp.predicted_iteration_s, shape, n, bandwidth_Bps=bandwidth_Bps,
                             latency_s=latency_s, node_cpu=node_cpu, rows_fixed=fixed, modes=ms,
                             node_seg=[r.segment_s for r in tp.rows])

    preds = predict(c.tp, modes)
    if not preds:
        return c
    p, tp = best_mode(preds), c.tp
    own = {q.mode: (q, c.tp) for q in preds}  # each mode's fastest (prediction, plan) so far
    if caps is not None and c.tp.strategy == "segment":
        share = chunk_share(shape, fixed)
        for m in (m for m in modes if m.on and m.chunks <= shape.rows):
            worst = max((x.in_flight().allreduce_s(shape.act_bytes / m.chunks, n) for x in node_cpu if x is not None),
                        default=0.0)
            mode_nodes = [for_mode(nd, node_cpu[d] if d < len(node_cpu) else None, m, shape, n, share, worst)
                          for d, nd in enumerate(nodes)]
            try:
                planned = plan(mode_nodes, c.tp.sizes, "segment", caps, c.tp.comm_s, budget=budget)
            except InfeasiblePlan:
                continue
            if planned.layout == c.tp.layout:
                continue
            alt = relayout(c.tp, nodes, caps, planned.layout)
            q = predict(alt, (m,))
            if alt.feasible and q and m in own and q[0].iteration_s < own[m][0].iteration_s * (1 - 1e-6):
                own[m] = (q[0], alt)
            if alt.feasible and q and q[0].iteration_s < p.iteration_s * (1 - 1e-6):
                p, tp = q[0], alt
    ranked = tuple(sorted(preds if tp is c.tp else predict(tp, modes), key=lambda q: (q.mode != p.mode, q.iteration_s)))
    elsewhere = tuple((m, q, r) for m, (q, r) in own.items() if r.layout != tp.layout and m != p.mode)
    if not p.mode.on:
        return replace(c, ranked=ranked, own_plans=elsewhere)
    base = c if tp is c.tp else tp_candidate(tp, c.label)
    where = "" if tp is c.tp else " (a layout planned for it)"
    return replace(base, label=f"{c.label}, overlap {p.mode.label}{where}", iteration_s=p.iteration_s,
                   compute_s=base.compute_s + p.chunk_overhead_s,
                   comm_s=max(0.0, p.iteration_s - base.compute_s - p.chunk_overhead_s), overlap=p, ranked=ranked,
                   own_plans=elsewhere)


def trial_modes(c: Candidate, size: int = TRIAL_MODES) -> tuple[OverlapMode, ...]:
    """The overlap modes worth measuring against each other at the start of a run (the plan's
    trial, `node/rank/trial.py`): the candidate's own mode first, then the next predicted fastest
    on its layout, `size` in all; no overlap among them when the job allowed it (the model's
    errors run both ways, and `off` pays no call's CPU beside compute). Empty when there is no
    choice to make (a forced mode, or no TP candidate)."""
    if len(c.ranked) < 2:
        return ()
    modes = [q.mode for q in c.ranked[:size]]
    if OFF not in modes and any(q.mode == OFF for q in c.ranked):
        modes[-1] = OFF
    return tuple(modes)


def dp_candidate(pred: DPPrediction) -> Candidate:
    node, need, cap = _worst([(n.node_id, n.memory, n.cap) for n in pred.nodes])
    why = None if pred.feasible else "a replica does not fit every node: " + pred.shortfall()
    return Candidate("dp", f"dp ({len(pred.nodes)} replicas)", pred.feasible, pred.iteration_s, pred.compute_s,
                     pred.exposed_s, node, need, cap, why, dp=pred)


def mesh_candidate(pred: MeshPrediction) -> Candidate:
    node, need, cap = _worst([(n.node_id, n.memory, n.cap) for n in pred.nodes])
    return Candidate("mesh", pred.label, pred.feasible, pred.iteration_s, pred.compute_s, pred.comm_s,
                     node, need, cap, None if pred.feasible else pred.why_not, mesh=pred)


def _none(strategy: str, label: str, why: str) -> Candidate:
    return Candidate(strategy, label, False, math.inf, math.inf, math.inf, None, 0.0, 0.0, why)


def choose(nodes: Sequence[NodeCost], sizes: Sizes, caps: Sequence[float], volume: CommVolume, comm_s: float,
           profile_rows: int, batch: int, strategy: str = "auto", *,
           bandwidth_Bps: float = DEFAULT_BANDWIDTH_BPS, latency_s: float = DEFAULT_LATENCY_S,
           node_cpu: Sequence[NodeComm | None] = (), budget: int = DEFAULT_BUDGET,
           overlap: str = "off", chunks: int | None = None, shape: TPShape | None = None,
           joint: bool = True) -> Choice:
    """Predict the candidates `strategy` asks for over `nodes` (rank order, the owner first) and pick.

    `volume`/`comm_s`: TP's activation all-reduces over every node at the profile's rows and their
    time (`commmodel`); `profile_rows`: the batch the profiles were taken at; `batch`: the job's
    global batch. A forced TP strategy raises InfeasiblePlan as `planner.plan` does; a forced `dp`
    returns its (possibly infeasible) candidate: `dpcost.require_fit` refuses it by name.
    `overlap`/`chunks`/`shape`: the job's overlap setting and what the overlap model needs
    (`with_overlap`; without a shape no overlap is predicted); `joint=False` keeps the layout
    planned without overlap for every mode (the bench's comparison)."""
    def hide(c: Candidate) -> Candidate:
        return with_overlap(c, nodes, shape, overlap, chunks, bandwidth_Bps=bandwidth_Bps, latency_s=latency_s,
                            node_cpu=node_cpu, caps=caps if joint else None, budget=budget)

    if strategy not in CHOICES:
        raise ValueError(f"strategy must be one of {CHOICES}, got {strategy!r}")
    owned = [replace(nodes[0], owner=True), *nodes[1:]] if nodes else []
    if strategy in ("segment", "paper", "uniform"):
        c = hide(tp_candidate(plan(nodes, sizes, strategy, caps, comm_s, budget=budget)))  # type: ignore[arg-type]
        return Choice(strategy, sizes, c, (c,), f"{strategy} was asked for")
    if strategy == "dp":
        c = dp_candidate(_dp(owned, caps, profile_rows, batch, bandwidth_Bps, latency_s, node_cpu))
        return Choice(strategy, sizes, c, (c,), "dp was asked for")
    cands = []
    try:
        cands.append(hide(tp_candidate(plan(nodes, sizes, "segment", caps, comm_s, budget=budget))))
    except InfeasiblePlan as exc:
        cands.append(_none("segment", f"segment (TP over {len(nodes)})", str(exc)))
    if len(nodes) > 1:  # one node: DP and meshes are the segment plan again
        cands.append(dp_candidate(_dp(owned, caps, profile_rows, batch, bandwidth_Bps, latency_s, node_cpu)))
        best = plan_mesh(owned, sizes, caps, volume, profile_rows, batch, bandwidth_Bps=bandwidth_Bps,
                         latency_s=latency_s, node_cpu=node_cpu)
        if best is not None:
            cands.append(mesh_candidate(best))
    return _pick(sizes, tuple(cands))


def _dp(owned: Sequence[NodeCost], caps: Sequence[float], profile_rows: int, batch: int, bandwidth_Bps: float,
        latency_s: float, node_cpu: Sequence[NodeComm | None]) -> DPPrediction:
    return predict_dp(owned, caps, profile_rows, batch, bandwidth_Bps=bandwidth_Bps, latency_s=latency_s,
                      node_cpu=node_cpu)


def _pick(sizes: Sizes, cands: tuple[Candidate, ...]) -> Choice:
    fit = [c for c in cands if c.feasible]
    if not fit:
        raise InfeasiblePlan("no candidate fits the memory caps:\n" + "\n".join(
            f"  {c.label}: {c.why_not}" for c in cands))
    best = fit[0]
    for c in fit[1:]:  # strictly faster beyond the tie tolerance: earlier candidates win ties
        if c.iteration_s < best.iteration_s * (1 - TIE_REL):
            best = c
    others = [c for c in cands if c is not best]
    reasons = []
    for c in others:
        if not c.feasible:
            reasons.append(f"{c.label} {'cannot be planned' if not math.isfinite(c.iteration_s) else 'does not fit'}")
        elif c.iteration_s <= best.iteration_s * (1 + TIE_REL):
            reasons.append(f"{c.label} ties at {c.iteration_s:.4f} s (the tie goes to {best.strategy})")
        else:
            reasons.append(f"{c.label} {c.iteration_s:.4f} s ({c.iteration_s / best.iteration_s:.2f}x)")
    why = f"{best.label} is the fastest that fits: {best.iteration_s:.4f} s per iteration (compute " \
          f"{best.compute_s:.4f} + comm {best.comm_s:.4f})" + (f"; {', '.join(reasons)}" if reasons else "")
    return Choice("auto", sizes, best, cands, why)
