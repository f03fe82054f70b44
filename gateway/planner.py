"""Planner: integer units per node minimising the slowest node under memory caps (paper Eq. 2-5).

Strategies over the same inputs (NodeCost per node, H, caps in bytes, a constant comm time):
- `greedy`  the paper's §IV-B4 search: one unit at a time to the node that is fastest after
            taking it, among nodes whose memory can take another unit; O(HN).
- `optimal` exact: binary search over the candidate bottleneck values T_d(h). Because T_d and
            M_d are monotone in h, a bottleneck T is reachable iff every node fits T at 0 units
            and sum_d max{h : T_d(h) <= T, M_d(h) <= cap_d} >= H.
- `uniform` Megatron-LM: H // N each, the remainder to the first nodes; memory is ignored like
            the baseline does, so the result may be over cap (flagged, `feasible=False`).
Every result also carries the ideal lower bound: continuous ratios, perfect balance, same caps.

Because T_d is nondecreasing in h, greedy hands out the H smallest marginal times and so reaches
the optimal bottleneck too (the tests check both against exhaustive search); `optimal` is the
exact certificate, and trims its surplus from the slowest node, so per-node splits may differ.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass
from typing import Literal, Sequence

from xronos.gateway.costmodel import NodeCost, memory_at, time_at
from xronos.protocol.layout import Layout, Sizes

Strategy = Literal["greedy", "optimal", "uniform"]
STRATEGIES: tuple[str, ...] = ("greedy", "optimal", "uniform")
MiB = 1024 * 1024


class InfeasiblePlan(ValueError):
    """No assignment of the H units fits every node's memory cap."""


@dataclass(frozen=True)
class PlanRow:
    node_id: str
    rank: int
    units: int
    ratio: float
    predicted_compute_s: float
    predicted_memory: float
    memory_cap: float
    over_cap: bool
    idle_s: float  # bottleneck - own compute: time spent waiting at synchronisation points


@dataclass(frozen=True)
class PlanResult:
    strategy: str
    units_total: int
    rows: tuple[PlanRow, ...]
    bottleneck_s: float  # max_d T_d
    comm_s: float
    predicted_iteration_s: float  # bottleneck + comm
    ideal_compute_s: float  # continuous relaxation; inf if not even that fits the caps
    ideal_iteration_s: float
    feasible: bool
    sizes: Sizes | None = None  # set by the caller that knows the model (gateway.profiles)

    @property
    def units(self) -> tuple[int, ...]:
        return tuple(r.units for r in self.rows)

    @property
    def layout(self) -> Layout:
        """The head-tied plan as a per-segment layout (MLP and vocabulary follow the heads)."""
        if self.sizes is None:
            raise ValueError("plan has no model sizes: cannot build its layout")
        return Layout.tied(self.units, self.sizes)


@dataclass(frozen=True)
class _Tables:
    times: tuple[list[float], ...]  # times[d][h], h = 0..H
    memory: tuple[list[float], ...]
    hmax: tuple[int, ...]  # most units each node's cap allows; -1 if not even 0 fits


def _tables(nodes: Sequence[NodeCost], H: int, caps: Sequence[float]) -> _Tables:
    times = tuple([time_at(n, h / H) for h in range(H + 1)] for n in nodes)
    memory = tuple([memory_at(n, h / H) for h in range(H + 1)] for n in nodes)
    # Memory is nondecreasing in h, so the units that fit form a prefix.
    hmax = tuple(bisect.bisect_right(m, c) - 1 for m, c in zip(memory, caps))
    return _Tables(times, memory, hmax)


def _infeasible(nodes: Sequence[NodeCost], H: int, caps: Sequence[float], tab: _Tables) -> InfeasiblePlan:
    share = -(-H // len(nodes))  # someone must take at least ceil(H/N) units
    lines = [
        f"  {n.node_id}: needs {tab.memory[d][0] / MiB:.1f} MiB at 0 units, "
        f"{tab.memory[d][share] / MiB:.1f} MiB at the even share of {share} units; "
        f"cap {caps[d] / MiB:.1f} MiB; "
        + (f"fits at most {tab.hmax[d]} units" if tab.hmax[d] >= 0 else "fits not even 0 units")
        for d, n in enumerate(nodes)
    ]
    room = sum(max(h, 0) for h in tab.hmax)
    short = [n.node_id for n, h in zip(nodes, tab.hmax) if h < 0]
    why = (f"nodes {short} cannot even hold the replicated layers" if short
           else f"together the nodes fit {room} of the {H} units")
    return InfeasiblePlan(f"no plan fits the memory caps ({why}):\n" + "\n".join(lines))


def _greedy(tab: _Tables, H: int) -> list[int] | None:
    """Paper §IV-B4; None when every node is full before all H units are placed."""
    units = [0] * len(tab.times)
    candidates = list(range(len(units)))
    for _ in range(H):
        # Drop nodes whose memory cannot take another unit, then give the unit to the node
        # that is fastest after taking it (ties: lowest rank).
        candidates = [d for d in candidates if units[d] + 1 <= tab.hmax[d]]
        if not candidates:
            return None
        best = min(candidates, key=lambda d: (tab.times[d][units[d] + 1], d))
        units[best] += 1
    return units


def _counts(tab: _Tables, T: float) -> list[int]:
    """Most units each node can take while finishing within T and fitting its cap."""
    return [bisect.bisect_right(t, T, 0, hm + 1) - 1 for t, hm in zip(tab.times, tab.hmax)]


def _optimal(tab: _Tables, H: int) -> list[int]:
    floor = max(t[0] for t in tab.times)  # every node runs its replicated layers anyway
    values = sorted({v for t, hm in zip(tab.times, tab.hmax) for v in t[: hm + 1] if v >= floor})
    lo, hi = 0, len(values) - 1  # values[hi] is reachable: the caps admit H units in total
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(_counts(tab, values[mid])) >= H:
            hi = mid
        else:
            lo = mid + 1
    units = _counts(tab, values[lo])
    # Hand back the surplus, always from the node that is currently slowest (ties: highest rank):
    # the bottleneck stays optimal and the rest ends up as balanced as this order allows.
    heap = [(-tab.times[d][u], -d) for d, u in enumerate(units) if u > 0]
    heapq.heapify(heap)
    for _ in range(sum(units) - H):
        _, neg_d = heapq.heappop(heap)
        d = -neg_d
        units[d] -= 1
        if units[d] > 0:
            heapq.heappush(heap, (-tab.times[d][units[d]], -d))
    return units


def _uniform(n: int, H: int) -> list[int]:
    base, extra = divmod(H, n)
    return [base + (1 if d < extra else 0) for d in range(n)]


def ideal_compute(nodes: Sequence[NodeCost], caps: Sequence[float]) -> float:
    """Lower bound on any plan's bottleneck: continuous ratios, all nodes finishing together.

    Smallest T with sum_d pmax_d(T) >= 1, where pmax_d(T) is the largest ratio node d can take
    within time T and memory cap; inf when even that cannot place the whole model.
    """
    if any(memory_at(n, 0.0) > c for n, c in zip(nodes, caps)):
        return math.inf
    pcap = [_largest_ratio(lambda p, n=n, c=c: memory_at(n, p) <= c) for n, c in zip(nodes, caps)]

    def pmax(n: NodeCost, u: float, T: float) -> float:
        if T < n.t_repl + n.t_icpt:
            return 0.0
        if n.t_slope == 0:
            return u
        return min(u, (T - n.t_repl - n.t_icpt) / n.t_slope)

    def enough(T: float) -> bool:
        # A small tolerance so an exact integer plan (ratios summing to 1 up to rounding) counts.
        return sum(pmax(n, u, T) for n, u in zip(nodes, pcap)) >= 1 - 1e-12

    if sum(pcap) < 1 - 1e-12:
        return math.inf
    lo = max(n.t_repl for n in nodes)
    hi = max(time_at(n, u) for n, u in zip(nodes, pcap))
    if enough(lo):
        return lo
    # Bisect down to adjacent floats: pmax is monotone in T even in floating point.
    while True:
        mid = lo + (hi - lo) / 2
        if mid <= lo or mid >= hi:
            return hi
        if enough(mid):
            hi = mid
        else:
            lo = mid


def _largest_ratio(fits) -> float:
    """Largest p in [0, 1] with fits(p), for a monotone predicate true at 0."""
    if fits(1.0):
        return 1.0
    lo, hi = 0.0, 1.0
    while True:
        mid = lo + (hi - lo) / 2
        if mid <= lo or mid >= hi:
            return lo
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)


def plan(
    nodes: Sequence[NodeCost],
    H: int,
    strategy: Strategy,
    caps: Sequence[float],
    comm_s: float = 0.0,
) -> PlanResult:
    """Assign H units to the nodes (in rank order). Raises InfeasiblePlan for greedy/optimal."""
    if not nodes:
        raise ValueError("nodes: a plan needs at least one node")
    if H < 1:
        raise ValueError(f"H: the model must have >= 1 partition unit, got {H}")
    if len(caps) != len(nodes):
        raise ValueError(f"caps: {len(caps)} memory caps for {len(nodes)} nodes")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not (comm_s >= 0 and math.isfinite(comm_s)):
        raise ValueError(f"comm_s must be finite and >= 0, got {comm_s}")
    for n in nodes:
        for field in ("t_repl", "t_icpt", "t_slope", "m_repl", "m_slope", "mt_repl", "mt_part"):
            v = getattr(n, field)
            if not (v >= 0 and math.isfinite(v)):  # monotone costs are what make the search exact
                raise ValueError(f"node {n.node_id}: {field} must be finite and >= 0, got {v}")
    for n, c in zip(nodes, caps):
        if not (c >= 0 and math.isfinite(c)):
            raise ValueError(f"node {n.node_id}: memory cap must be finite and >= 0, got {c}")
    ids = [n.node_id for n in nodes]
    if len(set(ids)) != len(ids):
        raise ValueError(f"node ids must be unique, got {ids}")
    tab = _tables(nodes, H, caps)
    if strategy == "uniform":
        units = _uniform(len(nodes), H)
    else:
        found = None
        if min(tab.hmax) >= 0:  # even with 0 units a node holds every replicated layer
            if strategy == "greedy":
                found = _greedy(tab, H)
            elif sum(tab.hmax) >= H:
                found = _optimal(tab, H)
        if found is None:
            raise _infeasible(nodes, H, caps, tab)
        units = found
    assert sum(units) == H
    times = [tab.times[d][u] for d, u in enumerate(units)]
    bottleneck = max(times)
    rows = tuple(
        PlanRow(
            node_id=n.node_id, rank=d, units=u, ratio=u / H, predicted_compute_s=times[d],
            predicted_memory=tab.memory[d][u], memory_cap=float(caps[d]),
            over_cap=u > tab.hmax[d], idle_s=bottleneck - times[d],
        )
        for d, (n, u) in enumerate(zip(nodes, units))
    )
    ideal = ideal_compute(nodes, caps)
    return PlanResult(
        strategy=strategy, units_total=H, rows=rows, bottleneck_s=bottleneck, comm_s=comm_s,
        predicted_iteration_s=bottleneck + comm_s, ideal_compute_s=ideal,
        ideal_iteration_s=ideal + comm_s, feasible=not any(r.over_cap for r in rows),
    )
