"""The arithmetic of the live re-balancing policy (`rebalance.Rebalancer`), pure: the base model
without a profile, refitting a node's costs by measured factors (one point, or the line through
two shares), the barrier time of a layout, the units a move hands over, a box's level shift,
whether a move carries on the previous one, and the layout part of the way between two.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Mapping, Sequence

from xronos.gateway.plan.costmodel import KindCost, NodeCost, kind_time
from xronos.protocol.layout import KINDS, Layout, Sizes


def unit_costs(node_ids: Sequence[str]) -> list[NodeCost]:
    """The base model without a profile: one second per whole kind, nothing fixed, no memory."""
    one = KindCost(fixed_s=0.0, icpt_s=0.0, slope_s=1.0, mem_slope=0.0, temp_slope=0.0)
    return [NodeCost(n, one, one, one, const_s=0.0, mem_repl=0.0, temp_repl=0.0) for n in node_ids]


def refit(base: NodeCost, factors: Mapping[str, float]) -> NodeCost:
    """`base` with every coefficient of kind k scaled by factors[k] (memory unchanged)."""
    def scale(kc: KindCost, f: float) -> KindCost:
        return replace(kc, fixed_s=kc.fixed_s * f, icpt_s=kc.icpt_s * f, slope_s=kc.slope_s * f)

    return replace(base, **{k: scale(base.kind(k), factors[k]) for k in KINDS})


def barrier_time(nodes: Sequence[NodeCost], layout: Layout) -> float:
    """Sum over kinds of the slowest node's time (the layout-dependent part of an iteration)."""
    return sum(max(kind_time(n.kind(k), layout.share(k, d)) for d, n in enumerate(nodes)) for k in KINDS)


def moved_units(old: Layout, new: Layout) -> dict[str, int]:
    """Per kind, the units that change rank (each rank's new range minus what it already held)."""
    out = {}
    for k in KINDS:
        moved = 0
        for r in range(old.world_size):
            (a, b), (c, d) = old.range(k, r), new.range(k, r)
            moved += (d - c) - max(0, min(b, d) - max(a, c))
        out[k] = moved
    return out


def level_shift(levels: Sequence[float], run: int, tol: float) -> float | None:
    """The new level over the old when the last `run` levels all lie beyond `tol` (relative) on
    one side of the (at least 2 x `run`) levels before them, else None. Above: beyond their
    median. Below: beyond their lower quartile — measurement outliers only ever slow an iteration
    down, so a few of them among the reference must not make the box look faster."""
    if len(levels) < 3 * run:
        return None
    ref, last = list(levels[:-run]), list(levels[-run:])
    med = statistics.median(ref)
    low = statistics.quantiles(ref, n=4, method="inclusive")[0]
    if med > 0 and all(x > med * (1 + tol) for x in last):
        return statistics.median(last) / med
    if low > 0 and all(x * (1 + tol) < low for x in last):
        return statistics.median(last) / low
    return None


def continues(previous: Layout | None, current: Layout, new: Layout) -> bool:
    """`new` carries on the move previous -> current: no (rank, kind) count goes back the way it
    came (a rank that gave units away does not get any back, and the other way round)."""
    if previous is None:
        return False
    return all((b - c) * (c - a) >= 0 for k in KINDS
               for a, c, b in zip(getattr(previous, k), getattr(current, k), getattr(new, k)))


def two_point(base: KindCost, f: float, at: float, anchor: tuple[float, float]) -> KindCost | None:
    """The kind as the line through (anchor share, anchor seconds) and (at, f x base(at)): fixed
    part scaled by f, intercept and slope from the two points; None when not physical."""
    s_a, t_a = anchor
    t_c = f * kind_time(base, at)
    slope = (t_c - t_a) / (at - s_a)
    icpt = t_c - slope * at
    fixed = base.fixed_s * f
    if slope <= 0 or icpt < 0:
        return None
    return replace(base, fixed_s=fixed, icpt_s=max(0.0, icpt - fixed), slope_s=slope)


def blend(old: Layout, new: Layout, alpha: float, sizes: Sizes, quanta: Mapping[str, int]) -> Layout:
    """The layout `alpha` of the way from `old` to `new` (0: old, 1: new): every cut between ranks
    moved that fraction of its way, at a multiple of the kind's quantum (or the kind's end). Each
    rank's count is then within a quantum of (1 - alpha) x old + alpha x new, and the cuts stay in
    order, so the counts cover the model exactly."""
    out = {}
    for k in KINDS:
        total, q = sizes.total(k), quanta[k]
        cuts, at_old, at_new, prev = [], 0, 0, 0
        for a, b in zip(old.counts(k)[:-1], new.counts(k)[:-1]):
            at_old, at_new = at_old + a, at_new + b
            cut = min(total, q * round((at_old + alpha * (at_new - at_old)) / q))
            prev = max(prev, cut)
            cuts.append(prev)
        edges = [0, *cuts, total]
        out[k] = tuple(e - s for s, e in zip(edges, edges[1:]))
    return Layout(**out)
