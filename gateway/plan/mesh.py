"""DP×TP meshes: the nodes cut into G equal tensor-parallel groups of `tp` ranks that are
data-parallel with each other. Pure Python.

The runtime's contract (`protocol.messages.mesh_of`): rank r is in group r // tp at TP rank r % tp,
and EVERY group holds the same layout; each group takes `rows[g]` of each global batch. So a mesh
is (the groups, which node holds which TP rank, one layout, the rows per group), and

    group g   compute_g = sum_seg max_i T_(g,i),seg(layout_i) * f_(g,i)(rows_g / B_p)  + TP comm at rows_g
    DP        each TP rank i's gradients (its shard's) all-reduced over the G nodes holding rank i,
              the tp rings side by side, in DDP's buckets, hidden behind the slowest group's
              backward as in `dpcost` (every bucket but the last)
    iteration = max_g compute_g + what backward does not hide

Times scale with a group's rows as `dpcost` scales a replica's (f = `costmodel.rows_factor`: the
share the node pays whatever its rows, the rest in proportion); activations in proportion.

**Search.** For every tp with 1 < tp < N dividing N (tp = 1 is `dp`, tp = N is `segment`):
1. *Which nodes group together.* Up to `EXACT_MESH_NODES` (10) nodes every partition into groups
   is scored (at N = 10: 945 for tp 2, 126 for tp 5); beyond, the two structured ones — groups
   dealt in snake order of speed (each group a similar mix) and groups of neighbours in speed
   (tiers) — each improved by swapping nodes of neighbouring speed between groups while the
   score falls (`SWAP_ROUNDS` rounds, `SWAP_REACH` neighbours). The score is the fluid bound: node speeds v (rows/s), layout fractions f_i
   proportional to the positions' mean speed, a group's speed min_i v_(g,i) / f_i, the batch over
   their sum. Within a group, TP ranks go by speed (the same rank holds similar nodes in every
   group), permuted alike in every group so that the owner is rank 0.
2. *Layout and rows* for the best `REFINE` partitions per tp: the common layout is the exact
   `segment` plan over virtual nodes, TP rank i's virtual node being every coefficient's largest
   (time scaled by its group's rows, memory with those rows' activations) and cap the smallest
   over the groups: what fits and is fast for it is so for every real node. The rows then follow
   the groups' real times (each row to the group that finishes it soonest, TP comm included),
   and the layout is planned once more at those rows. Every real node's memory is checked at the
   end; a mesh over a cap is infeasible, named.

So the mesh found is exact over partitions only for the fluid score; the layout and rows of each
are planned, not proven jointly optimal.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

from xronos.gateway.plan.commmodel import CommVolume, NodeComm, comm_time
from xronos.gateway.plan.costmodel import SEGMENTS, KindCost, NodeCost, layout_shares, rows_factor, segment_times
from xronos.gateway.plan.dpcost import BACKWARD_FRACTION, _exposed, allreduce_s, bucket_sizes, greedy_rows, row_time
from xronos.gateway.plan.memorymodel import predict_memory
from xronos.gateway.plan.model import MiB, InfeasiblePlan
from xronos.gateway.plan.planner import plan
from xronos.protocol.layout import KINDS, Layout, Sizes

EXACT_MESH_NODES = 10
SWAP_ROUNDS = 4
SWAP_REACH = 3
REFINE = 2
MESH_BUDGET = 200  # box evaluations of each virtual segment plan (small: tp nodes)


@dataclass(frozen=True)
class MeshNode:
    node_id: str
    group: int
    tp_rank: int
    compute_s: float
    memory: float
    cap: float

    @property
    def fits(self) -> bool:
        return self.memory <= self.cap


@dataclass(frozen=True)
class MeshPrediction:
    tp: int
    groups: tuple[tuple[str, ...], ...]  # node ids per group, in TP-rank order
    layout: Layout  # every group's
    rows: tuple[int, ...]  # per group
    nodes: tuple[MeshNode, ...]  # in global rank order (group-major)
    compute_s: float  # the slowest group's (compute + TP comm) compute
    tp_comm_s: float  # and its TP all-reduces
    dp_comm_s: float  # the gradient all-reduce backward does not hide
    iteration_s: float
    partitions: int  # partitions scored for this tp

    @property
    def label(self) -> str:
        return f"mesh {len(self.groups)}x{self.tp} ({len(self.groups)} groups of TP {self.tp})"

    @property
    def comm_s(self) -> float:
        return self.tp_comm_s + self.dp_comm_s

    @property
    def feasible(self) -> bool:
        return all(n.fits for n in self.nodes)

    @property
    def why_not(self) -> str:
        return "over the memory cap: " + "; ".join(
            f"{n.node_id} needs {n.memory / MiB:,.0f} MiB, cap {n.cap / MiB:,.0f} MiB" for n in self.nodes if not n.fits)


def at_rows(node: NodeCost, rho: float) -> NodeCost:
    """`node` training rho times the profile's rows: times by `costmodel.rows_factor` (the share paid
    whatever the rows, the rest by rho), activations by rho, temporaries never below the profile's
    (as `dpcost.replica_memory`)."""
    f = rows_factor(node, rho)

    def kc(k: KindCost) -> KindCost:
        return replace(k, fixed_s=k.fixed_s * f, icpt_s=k.icpt_s * f, slope_s=k.slope_s * f,
                       mem_slope=k.mem_slope - k.act_slope * (1 - rho), act_slope=k.act_slope * rho,
                       temp_slope=k.temp_slope * max(1.0, rho))
    return replace(node, **{k: kc(node.kind(k)) for k in KINDS}, const_s=node.const_s * f,
                   mem_repl=node.mem_repl - node.act_repl * (1 - rho), act_repl=node.act_repl * rho,
                   temp_repl=node.temp_repl * max(1.0, rho))


def _envelope(nodes: Sequence[NodeCost], name: str) -> NodeCost:
    """Every numeric coefficient's largest over `nodes` (flags: any)."""
    def most(objs, cls):
        out = {}
        for f in fields(cls):
            vals = [getattr(o, f.name) for o in objs]
            if isinstance(vals[0], KindCost):
                out[f.name] = KindCost(**most(vals, KindCost))
            elif isinstance(vals[0], bool):
                out[f.name] = any(vals)
            elif isinstance(vals[0], (int, float)):
                out[f.name] = max(vals)
            else:
                out[f.name] = vals[0]
        return out
    return replace(NodeCost(**most(nodes, NodeCost)), node_id=name)


def _partitions(n: int, tp: int) -> itertools.chain:
    """Every partition of range(n) into groups of tp, node 0's group first (each as sorted tuples)."""
    def rec(left: tuple[int, ...]):
        if not left:
            yield ()
            return
        first, rest = left[0], left[1:]
        for mates in itertools.combinations(rest, tp - 1):
            group = (first, *mates)
            remaining = tuple(x for x in rest if x not in mates)
            for tail in rec(remaining):
                yield (group, *tail)
    return rec(tuple(range(n)))


def _align(groups, speed) -> tuple[tuple[int, ...], ...]:
    """TP ranks by speed in every group, then permuted alike so node 0 (the owner) is rank 0."""
    ordered = [sorted(g, key=lambda d: (-speed[d], d)) for g in groups]
    g0 = next(i for i, g in enumerate(ordered) if 0 in g)
    ordered.insert(0, ordered.pop(g0))
    j = ordered[0].index(0)
    perm = [j] + [i for i in range(len(ordered[0])) if i != j]
    return tuple(tuple(g[i] for i in perm) for g in ordered)


def _score(groups, speed) -> float:
    """The fluid bound of a partition (module docstring): seconds per unit of batch, TP ranks by speed."""
    groups = [sorted(g, key=lambda d: -speed[d]) for g in groups]
    tp = len(groups[0])
    f = [sum(speed[g[i]] for g in groups) for i in range(tp)]
    tot = sum(f)
    return 1.0 / sum(min(speed[g[i]] / (f[i] / tot) for i in range(tp)) for g in groups)


def _snake(order: Sequence[int], G: int) -> list[list[int]]:
    groups: list[list[int]] = [[] for _ in range(G)]
    for k, d in enumerate(order):
        r, c = divmod(k, G)
        groups[c if r % 2 == 0 else G - 1 - c].append(d)
    return groups


def _swap_improve(groups, speed, rounds: int):
    """Swap nodes of neighbouring speed (up to `SWAP_REACH` apart in speed order) between groups
    while the fluid score falls: O(N) swaps a round, so the search stays cheap at N = 64."""
    best, score = [list(g) for g in groups], _score(groups, speed)
    order = sorted(range(len(speed)), key=lambda d: (-speed[d], d))
    for _ in range(rounds):
        improved = False
        for k, a in enumerate(order):
            for b in order[k + 1:k + 1 + SWAP_REACH]:
                ga = next(i for i, g in enumerate(best) if a in g)
                gb = next(i for i, g in enumerate(best) if b in g)
                if ga == gb:
                    continue
                trial = [list(g) for g in best]
                trial[ga][trial[ga].index(a)], trial[gb][trial[gb].index(b)] = b, a
                s = _score(trial, speed)
                if s < score * (1 - 1e-12):
                    best, score, improved = trial, s, True
        if not improved:
            break
    return best


def candidates(n: int, tp: int, speed: Sequence[float]) -> tuple[list, int]:
    """(the best REFINE aligned partitions by the fluid score, how many were scored)."""
    if n <= EXACT_MESH_NODES:
        parts = [_align(p, speed) for p in _partitions(n, tp)]
    else:
        order = sorted(range(n), key=lambda d: (-speed[d], d))
        G = n // tp
        starts = [_snake(order, G), [order[k * tp:(k + 1) * tp] for k in range(G)]]
        parts = [_align(_swap_improve(s, speed, SWAP_ROUNDS), speed) for s in starts]
    scored = sorted(set(parts), key=lambda p: (_score(p, speed), p))
    return scored[:REFINE], len(parts)


def _evaluate(nodes, groups, layout, batch, caps, volume, profile_rows, bw, lat, cpu, f_bwd, scored):
    """The mesh at `layout` with the rows that its groups' real times give (module docstring)."""
    tp = len(groups[0])
    seg_cache = {}
    for g in groups:
        for i, d in enumerate(g):
            seg_cache[d] = segment_times(nodes[d], layout_shares(layout, i))

    def tp_comm(g: int, r: int) -> float:
        if r == 0:
            return 0.0
        v = CommVolume(volume.count, volume.nbytes * r / profile_rows)
        return comm_time(v, tp, bw, lat, [cpu[d] for d in groups[g] if cpu[d] is not None])

    def compute(g: int, r: int) -> float:
        return sum(max(seg_cache[d][s] * rows_factor(nodes[d], r / profile_rows) for d in groups[g]) for s in SEGMENTS)

    def group_time(g: int, r: int) -> float:
        return compute(g, r) + tp_comm(g, r)

    rows = greedy_rows(group_time, len(groups), batch)
    times = [group_time(g, r) for g, r in enumerate(rows)]
    slow = max(range(len(groups)), key=lambda g: times[g])
    window = f_bwd * compute(slow, rows[slow])
    exposed = 0.0
    for i in range(tp):
        d0 = groups[0][i]
        sh = layout_shares(layout, i)
        grads = nodes[d0].grad_repl + sum(nodes[d0].kind(k).grad_slope * sh[k] for k in KINDS)
        ring_cpu = [cpu[g[i]] for g in groups if cpu[g[i]] is not None]
        buckets = [allreduce_s(b, len(groups), bw, lat, ring_cpu) for b in bucket_sizes(grads)]
        exposed = max(exposed, _exposed(buckets, window))
    out = []
    for g, grp in enumerate(groups):
        rho = rows[g] / profile_rows
        for i, d in enumerate(grp):
            mem = predict_memory(at_rows(nodes[d], rho), layout_shares(layout, i))
            own = sum(seg_cache[d].values()) * rows_factor(nodes[d], rho)
            out.append(MeshNode(nodes[d].node_id, g, i, own, mem, caps[d]))
    ids = tuple(tuple(nodes[d].node_id for d in g) for g in groups)
    return MeshPrediction(tp, ids, layout, tuple(rows), tuple(out), compute(slow, rows[slow]), tp_comm(slow, rows[slow]),
                          exposed, times[slow] + exposed, scored)


def _mesh_at(nodes, sizes, caps, volume, profile_rows, batch, groups, bw, lat, cpu, f_bwd, scored):
    speed = [1.0 / row_time(nd, profile_rows) for nd in nodes]
    gs = [sum(speed[d] for d in g) for g in groups]
    rows = [max(1, round(batch * s / sum(gs))) for s in gs]  # a first guess; replanned below
    best = None
    for _ in range(2):
        virtual = [_envelope([at_rows(nodes[g[i]], rows[k] / profile_rows) for k, g in enumerate(groups)], f"tp{i}")
                   for i in range(len(groups[0]))]
        vcaps = [min(caps[g[i]] for g in groups) for i in range(len(groups[0]))]
        try:
            layout = plan(virtual, sizes, "segment", vcaps, 0.0, budget=MESH_BUDGET).layout
        except InfeasiblePlan:
            return best
        pred = _evaluate(nodes, groups, layout, batch, caps, volume, profile_rows, bw, lat, cpu, f_bwd, scored)
        if best is None or (pred.feasible, -pred.iteration_s) > (best.feasible, -best.iteration_s):
            best = pred
        rows = list(pred.rows)
    return best


def plan_mesh(nodes: Sequence[NodeCost], sizes: Sizes, caps: Sequence[float], volume: CommVolume,
              profile_rows: int, batch: int, *, bandwidth_Bps: float, latency_s: float,
              node_cpu: Sequence[NodeComm | None] = (), backward_fraction: float = BACKWARD_FRACTION,
              ) -> MeshPrediction | None:
    """The fastest mesh found (feasible first) over every tp with 1 < tp < N dividing N; None when
    N has no such divisor or no mesh could be planned. `nodes[0]` is the owner (rank 0)."""
    n = len(nodes)
    cpu = list(node_cpu) + [None] * (n - len(node_cpu))
    speed = [1.0 / row_time(nd, profile_rows) for nd in nodes]
    best = None
    for tp in range(2, n):
        if n % tp:
            continue
        parts, scored = candidates(n, tp, speed)
        for groups in parts:
            pred = _mesh_at(nodes, sizes, caps, volume, profile_rows, batch, groups, bandwidth_Bps, latency_s,
                            cpu, backward_fraction, scored)
            if pred is not None and (best is None or (pred.feasible, -pred.iteration_s)
                                     > (best.feasible, -best.iteration_s)):
                best = pred
    return best
