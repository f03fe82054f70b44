"""Planner: each node's count of every segment kind, under every node's memory cap.

Inputs: one `NodeCost` per node (rank order), the model's `Sizes`, memory caps in bytes, a
constant communication time. Counts are planned in quanta (`Sizes.quanta(kind)` per kind: 1
attention unit, 32 MLP columns, 32 vocabulary rows) and turned into a `Layout` by
`Layout.from_quanta` (the rank holding a dimension's end takes its remainder).

Strategies:
- `segment` (default) minimises the iteration's compute `sum_seg max_d T_d,seg(w_d,seg)` (every
  all-reduce is a barrier, ARCHITECTURE.md), each kind split on its own, exactly (below).
- `paper`  the paper's §IV-B4 greedy over head-tied units (p_d = h_d/H for every kind): one unit
           at a time to the node whose total T_d is smallest after taking it, among nodes whose
           memory can take another; it minimises `max_d T_d`, the paper's Eq. 2.
- `uniform` Megatron-LM: every kind split evenly in quanta (remainders to the first ranks);
           memory is ignored as the baseline does, so the result may be over cap (`feasible`).
Every result carries the ideal bound: fractional shares per kind, every segment perfectly
balanced, under the same caps (a continuous relaxation, below), and `lower_bound_s`.

**The `segment` algorithm.** Write the plan as bottleneck targets tau_k per kind. Times are
nondecreasing in a node's count, so a node can take at most u_d,k(tau_k) quanta of kind k within
the target (closed form: the fitted time is affine in the share). A target vector is *feasible*
iff counts w_d,k <= u_d,k exist that cover every kind and fit every node's memory; the plan cost
is sum_k tau_k, and the optimum is a feasible vector of candidate values (each tau_k is some
T_d,k(w)).

1. *Separable optimum (a proven lower bound).* Dropping the coupling (each node's memory checked
   for one kind at a time, `alone` caps) separates the problem into one exact min-bottleneck per
   kind: the smallest candidate tau with sum_d min(u_d(tau), alone_d) >= W, found by bisection
   on tau and an exact selection among the few candidates left. If those counts also fit every
   node's memory together, they are optimal and the search stops here (no caps binding).
2. *Coupled (binding caps).* A relaxed feasibility test for a target vector: per-unit memory of
   a kind is (in a profile, nearly) node-independent, so with the smallest per-unit bytes m_k
   and each node's room R_d (cap minus replicated memory and replicated temporaries) it is a
   transportation problem — kinds supply m_k bytes, node d takes at most R_d, and at most
   m_k*share(u_d,k) of kind k — which by max-flow/min-cut is feasible iff for every subset S of
   kinds  sum_{k in S} m_k <= sum_d min(R_d, sum_{k in S} m_k*share(u_d,k))  (7 subsets, O(N)).
   Feasibility is monotone in tau, so a best-first branch and bound over boxes of target
   vectors (monotonic optimisation) is exact: a box is dropped when its upper corner fails the
   relaxed test, or the exact integer test there (when affordable), or when its lower corner's
   sum cannot beat the incumbent; a box whose lower corner passes is settled by the integer test
   at that corner (infeasible: the box without that corner is searched on); otherwise its widest
   side is halved at a candidate. The integer test is an exact dynamic programme over the
   memory-bound nodes (nodes that fit all they may take keep it) — state: attention and MLP
   quanta placed, value: most vocabulary quanta; dominated states and states the remaining nodes
   cannot complete are dropped; the last node is checked, not enumerated — and, when that would
   pass `EXACT_DP_BUDGET` transitions, a constructive one (kind by kind from the coarsest, each
   bound node's share from a max-flow of bytes, rounded and repaired) that can only miss
   solutions, never invent them. The first incumbent comes from a greedy walk up from the
   separable targets (violated relaxed conditions raised as little as possible, then a common
   lift toward the top corner, doubled from 1/256 of the way and bisected: the integer test
   costs more the higher its targets); if the walk fails, the integer test at the top corner
   (every node at its most, trimmed). Once a constructive test fails at a lower corner, the bound
   is settled there and `polish` looks for a better plan above it. Trimming a surplus always drops
   the slowest quanta first. Beyond `EXACT_NODES` (8) nodes the search stops once every open
   box's lower bound is within `GAP_TOL` (0.1 %) of the incumbent: closing that last part steps
   one vocabulary quantum at a time and took most of the boxes. **Lower bound**: the smallest lower-corner sum among boxes
   still open (none: the optimum), the target vectors whose integer test was only constructive,
   and the incumbent; it is at least the separable bound. With the exact test throughout and no
   box left the plan is proven optimal (`optimal`); otherwise `gap` says how close it is. The
   search is deterministic (budgeted in box evaluations, not in seconds).
3. *Ideal.* The same search over continuous shares (no integer test: the relaxation is its own
   solution), to `IDEAL_TOL`: the first box narrower than that settles the bound (boxes leave the
   heap in order of their sums), which is the ideal compute (a lower bound on the continuous
   optimum, which it meets when no cap binds: then each kind is balanced alone).

Where the parts live: the planning model and its feasibility tests in `xronos.gateway.plan.model`,
the two searches (integer targets, continuous ideal) in `xronos.gateway.plan.search`, the
strategies and the result here.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace
from typing import Literal, Sequence

from xronos.gateway.plan.costmodel import SEGMENTS, NodeCost, layout_shares, segment_times, time_at
from xronos.gateway.plan.memorymodel import memory_at, predict_memory
from xronos.gateway.plan.model import MiB, InfeasiblePlan, Problem, infeasible
from xronos.gateway.plan.search import SearchStats, segment_search
from xronos.gateway.plan.ideal import IDEAL_BUDGET, ideal_bound
from xronos.protocol.layout import KINDS, NOUN, QUANTA, Layout, Sizes

__all__ = ["DEFAULT_BUDGET", "STRATEGIES", "InfeasiblePlan", "MiB", "PlanResult", "PlanRow", "SearchStats",
           "Strategy", "ideal_compute", "plan", "relayout"]

Strategy = Literal["segment", "paper", "uniform"]
STRATEGIES: tuple[str, ...] = ("segment", "paper", "uniform")
# Box evaluations of the branch and bound; beyond it the plan is the incumbent, with its bound.
DEFAULT_BUDGET = 1000


@dataclass(frozen=True)
class PlanRow:
    node_id: str
    rank: int
    attn: int  # attention units held
    mlp: int  # MLP columns held
    vocab: int  # vocabulary rows held
    shares: dict[str, float]  # kind -> share of the kind
    segment_s: dict[str, float]  # this node's predicted seconds in each segment (SEGMENTS)
    predicted_compute_s: float  # sum of segment_s: the node's own compute per iteration
    predicted_memory: float
    memory_cap: float
    over_cap: bool
    idle_s: float  # sum over segments of (slowest node - this node): waiting at barriers

    @property
    def units(self) -> int:
        """Attention units (the head-tied strategies' unit)."""
        return self.attn

    def count(self, kind: str) -> int:
        return getattr(self, kind)


@dataclass(frozen=True)
class PlanResult:
    strategy: str
    sizes: Sizes
    layout: Layout
    rows: tuple[PlanRow, ...]
    segment_s: dict[str, float]  # per segment: the slowest node's time (what the barrier costs)
    bottleneck_s: float  # sum of segment_s: predicted compute per iteration
    comm_s: float
    predicted_iteration_s: float  # bottleneck + comm
    ideal_compute_s: float  # continuous relaxation under the caps; inf if not even that fits
    ideal_iteration_s: float
    lower_bound_s: float  # proven lower bound on any quantum plan's (real) compute under the caps
    optimal: bool  # proven minimal over quantum plans in the planning model (segment search closed)
    feasible: bool  # every node within its cap
    search: SearchStats | None = None

    @property
    def units(self) -> tuple[int, ...]:
        """Attention units per rank."""
        return self.layout.attn

    @property
    def units_total(self) -> int:
        return self.sizes.attn

    @property
    def gap(self) -> float:
        """(the layout's compute - lower bound) / lower bound."""
        planned = self.bottleneck_s
        if self.lower_bound_s <= 0 or not math.isfinite(self.lower_bound_s):
            return 0.0 if planned == self.lower_bound_s else math.inf
        return max(0.0, planned - self.lower_bound_s) / self.lower_bound_s

    def counts(self, kind: str) -> tuple[int, ...]:
        return self.layout.counts(kind)

def _uniform(pb: Problem) -> list[list[int]]:
    out = [[0, 0, 0] for _ in range(pb.n)]
    for i, kd in enumerate(pb.kinds):
        base, extra = divmod(kd.W, pb.n)
        for d in range(pb.n):
            out[d][i] = base + (1 if d < extra else 0)
    return out


def _paper(nodes: Sequence[NodeCost], H: int, caps: Sequence[float]) -> list[int] | None:
    """Paper §IV-B4 over head-tied units; None when every node is full before all H are placed."""
    times = [[time_at(n, h / H) for h in range(H + 1)] for n in nodes]
    memory = [[memory_at(n, h / H) for h in range(H + 1)] for n in nodes]
    hmax = [bisect.bisect_right(m, c) - 1 for m, c in zip(memory, caps)]
    if min(hmax) < 0:
        return None
    units = [0] * len(nodes)
    candidates = list(range(len(nodes)))
    for _ in range(H):
        candidates = [d for d in candidates if units[d] + 1 <= hmax[d]]
        if not candidates:
            return None
        best = min(candidates, key=lambda d: (times[d][units[d] + 1], d))
        units[best] += 1
    return units



def ideal_compute(nodes: Sequence[NodeCost], sizes: Sizes, caps: Sequence[float],
                  quanta: dict[str, int] = QUANTA, budget: int = DEFAULT_BUDGET) -> float:
    """Lower bound on any plan's compute: continuous shares per kind, each segment balanced, under
    the caps (relaxed as in the search: smallest per-share bytes, replicated temporaries); inf when
    not even that places the model."""
    pb = Problem(nodes, sizes, caps, quanta)
    return ideal_bound(pb, budget)


# --------------------------------------------------------------------------------------------


def _check(nodes: Sequence[NodeCost], sizes: Sizes, strategy: str, caps: Sequence[float], comm_s: float) -> None:
    if not nodes:
        raise ValueError("nodes: a plan needs at least one node")
    if not isinstance(sizes, Sizes):
        raise ValueError(f"sizes: expected the model's Sizes, got {sizes!r}")
    if len(caps) != len(nodes):
        raise ValueError(f"caps: {len(caps)} memory caps for {len(nodes)} nodes")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not (comm_s >= 0 and math.isfinite(comm_s)):
        raise ValueError(f"comm_s must be finite and >= 0, got {comm_s}")
    for n in nodes:
        values = {"const_s": n.const_s, "mem_repl": n.mem_repl, "temp_repl": n.temp_repl,
                  "mem_runtime": n.mem_runtime, "load_repl": n.load_repl, "act_repl": n.act_repl,
                  "grad_repl": n.grad_repl}
        for k in KINDS:
            kc = n.kind(k)
            for f in ("fixed_s", "icpt_s", "slope_s", "mem_slope", "temp_slope", "load_slope", "act_slope",
                      "grad_slope"):
                values[f"{k}.{f}"] = getattr(kc, f)
        for f, v in values.items():
            if not (v >= 0 and math.isfinite(v)):  # monotone costs are what make the search exact
                raise ValueError(f"node {n.node_id}: {f} must be finite and >= 0, got {v}")
        parts = [("act_repl", n.act_repl, n.mem_repl), ("grad_repl", n.grad_repl, n.mem_repl)] + [
            (f"{k}.{f}", getattr(n.kind(k), f), n.kind(k).mem_slope) for k in KINDS for f in ("act_slope", "grad_slope")]
        for f, part, whole in parts:
            if part > whole:  # parts of Eq. 9's M_w + M_a: the planner's M_w alone must stay >= 0
                raise ValueError(f"node {n.node_id}: {f} ({part}) exceeds the memory it is part of ({whole})")
    for n, c in zip(nodes, caps):
        if not (c >= 0 and math.isfinite(c)):
            raise ValueError(f"node {n.node_id}: memory cap must be finite and >= 0, got {c}")
    ids = [n.node_id for n in nodes]
    if len(set(ids)) != len(ids):
        raise ValueError(f"node ids must be unique, got {ids}")


def plan(
    nodes: Sequence[NodeCost],
    sizes: Sizes,
    strategy: Strategy,
    caps: Sequence[float],
    comm_s: float = 0.0,
    *,
    quanta: dict[str, int] = QUANTA,
    budget: int = DEFAULT_BUDGET,
) -> PlanResult:
    """Plan every kind's counts over the nodes (in rank order). Raises InfeasiblePlan for
    segment/paper when no plan fits the caps."""
    _check(nodes, sizes, strategy, caps, comm_s)
    # Rank 0 is the owner: it reads the data and gathers the export (memorymodel.owner_peak).
    nodes = [replace(nodes[0], owner=True), *nodes[1:]]
    pb = Problem(nodes, sizes, caps, quanta)
    stats, lower = None, None
    if strategy == "uniform":
        q = _uniform(pb)
        layout = Layout.from_quanta([x[0] for x in q], [x[1] for x in q], [x[2] for x in q], sizes, quanta)
    elif strategy == "paper":
        if pb.short:
            raise infeasible(pb, f"nodes {[nodes[d].node_id for d in pb.short]} cannot even hold the "
                                  f"replicated layers")
        units = _paper(nodes, sizes.attn, caps)
        if units is None:
            raise infeasible(pb, "the paper's head-tied greedy ran out of nodes with memory for "
                                  "another unit")
        layout = Layout.tied(units, sizes, quanta)
        # The greedy checks memory at the tied share h/H; the layout cuts MLP and vocabulary at the
        # nearest quantum, which can round a node's share up past its cap.
        over = []
        for d, nd in enumerate(nodes):
            need = predict_memory(nd, layout_shares(layout, d))
            if need > caps[d]:
                over.append(f"{nd.node_id} needs {need / MiB:.1f} MiB of its {caps[d] / MiB:.1f} MiB cap holding "
                            + ", ".join(f"{layout.counts(k)[d]} {NOUN[k]}" for k in KINDS))
        if over:
            raise infeasible(pb, "the paper's head-tied layout, cut at the quantum, exceeds the caps: "
                                  + "; ".join(over))
    else:
        if pb.short:
            raise infeasible(pb, f"nodes {[nodes[d].node_id for d in pb.short]} cannot even hold the "
                                  f"replicated layers")
        for kd in pb.kinds:
            if sum(kd.lim) < kd.W:
                room = min(kd.total, sum(kd.lim) * kd.q)
                raise infeasible(pb, f"{kd.name}: even holding nothing else, the nodes fit {room} of the "
                                      f"{kd.total} {NOUN[kd.name]}")
        q, stats, lower = segment_search(pb, budget)
        layout = Layout.from_quanta([x[0] for x in q], [x[1] for x in q], [x[2] for x in q], sizes, quanta)
    ideal = ideal_bound(pb, IDEAL_BUDGET)  # the same for every strategy
    return _result(strategy, pb, layout, comm_s, ideal, lower, stats)


def relayout(base: PlanResult, nodes: Sequence[NodeCost], caps: Sequence[float], layout: Layout, *,
             quanta: dict[str, int] = QUANTA) -> PlanResult:
    """`base` (planned over `nodes` and `caps`) with another layout, one planned in another model
    (an overlap mode's, `choose.with_overlap`): the layout's times and memory in this model, the
    base's ideal and lower bounds (the bounds of the model without overlap), not proven optimal."""
    totals = {k: sum(layout.counts(k)) for k in KINDS}
    if layout.world_size != len(nodes) or totals != {k: base.sizes.total(k) for k in KINDS}:
        raise ValueError(f"relayout: a layout of {layout.world_size} ranks holding {totals} for a plan of "
                         f"{len(nodes)} nodes over {base.sizes}")
    pb = Problem([replace(nodes[0], owner=True), *nodes[1:]], base.sizes, caps, quanta)
    r = _result(base.strategy, pb, layout, base.comm_s, base.ideal_compute_s, None, None)
    return replace(r, lower_bound_s=base.lower_bound_s, optimal=False)


def _result(strategy: str, pb: Problem, layout: Layout, comm_s: float, ideal: float,
            lower: float | None, stats: SearchStats | None) -> PlanResult:
    per = []
    for d, nd in enumerate(pb.nodes):
        sh = layout_shares(layout, d)
        per.append((sh, segment_times(nd, sh), predict_memory(nd, sh)))
    seg_max = {s: max(p[1][s] for p in per) for s in SEGMENTS}
    bottleneck = sum(seg_max.values())
    rows = []
    for d, (nd, (sh, segs, mem)) in enumerate(zip(pb.nodes, per)):
        own = sum(segs.values())
        rows.append(PlanRow(
            node_id=nd.node_id, rank=d, attn=layout.attn[d], mlp=layout.mlp[d], vocab=layout.vocab[d],
            shares=sh, segment_s=segs, predicted_compute_s=own, predicted_memory=mem,
            memory_cap=float(pb.caps[d]), over_cap=mem > pb.caps[d],
            idle_s=sum(seg_max[s] - segs[s] for s in SEGMENTS)))
    # Proven optimal in the planning model, which counts the quantum holding a dimension's
    # remainder as whole; the layout gives the remainder to the rank holding the end, whose real
    # share is smaller. So the model's bound on the layouts' real compute is lower by at most the
    # steepest node's missing part of that quantum, per kind (`xronos plan` once printed a bound
    # of 0.0055 s over a plan's real 0.0054 s: 100 MLP columns in quanta of 32).
    optimal = bool(stats is not None and stats.exact_test and not stats.budget_hit and lower is not None
                   and lower >= stats.objective_s)
    if lower is None:
        lower = ideal  # the continuous relaxation: real shares, no quanta
    else:
        lower = max(ideal, lower - sum(max(kd.b) * (kd.W * kd.q - kd.total) / kd.total for kd in pb.kinds))
    return PlanResult(
        strategy=strategy, sizes=pb.sizes, layout=layout, rows=tuple(rows), segment_s=seg_max,
        bottleneck_s=bottleneck, comm_s=comm_s, predicted_iteration_s=bottleneck + comm_s,
        ideal_compute_s=ideal, ideal_iteration_s=ideal + comm_s, lower_bound_s=lower, optimal=optimal,
        feasible=not any(r.over_cap for r in rows), search=stats,
    )
