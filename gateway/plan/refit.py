"""The arithmetic of the live re-balancing policy (`rebalance.Rebalancer`), pure: the base model
without a profile, refitting a node's costs by measured factors (one point, or the line through
two shares), the barrier time of a layout, the units a move hands over, a box's level shift,
whether a move carries on the previous one, the layout part of the way between two and how far a
move may reach; and the speed estimate the policy keeps (below).

**Speed estimate.** Each node's cost per kind is a base model (a profile's `NodeCost`, or — with
no profile — `unit_costs`: one second per whole kind, so the fit below is seconds per share)
times a *speed factor* c[d][k] = measured / predicted at the node's current share. The measured
figure is the rank's `compute_{kind}_s` of an iteration, plus — when given — its share of the
rank's `compute_rest_s` (the optimizer step and clipping, which grow with the parameters held:
booked in proportion to the bytes of each kind the rank holds, as the cost model books a layer's
optimizer step in its kind; without it a slowed box's slower optimizer step is not seen); the
factor is the median of that (node, kind)'s last `window` samples (a spike shorter than half the
window does not move it). A node holding none of a kind measures only that kind's replicated
part, which says little about its slope: its factor for that kind is the one it had at the last
switch, when it held the kind (scaled by its level shifts since); else its relative slowness (the
median, over the kinds it does hold, of its factor over the kind's mean) times the kind's factor
at average slowness (the holders' factors over their own slowness). A slow box given nothing, or
a sliver of one kind, must not pass for an average or a fast one. Refitting is scaling every coefficient of the kind
(fixed, intercept, slope) by the factor: `refit(base, factors)`.

**Share dependence.** Scaling a model by a factor measured at one share is exact only if the
model's intercept is right; the unit model has none, and a node's replicated work and per-call
overheads make a small share look slow per unit — a re-plan then takes more from the node that
already looked slow, which then looks slower still (a runaway towards giving it nothing). And a
node given nothing used to pass for an average one and get work back: between the two, layouts
could swing (a 2-rank run was seen going 6,6 -> 10,2 -> 7,5 -> 12,0 under CPU quotas). So a node
holding nothing keeps the factors it had (above), and at every switch each (node, kind) keeps its
last estimate at the old share as an *anchor* (seconds at that share). Once it has settled at the
new share, and the two shares differ by at least `anchor_gap` of the larger, its kind is refitted
as the line through both points (`intercept + slope x share`, both >= 0; else the plain factor).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Mapping, Sequence

from xronos.gateway.plan.costmodel import KindCost, NodeCost, kind_time, layout_shares
from xronos.gateway.plan.memorymodel import predict_memory
from xronos.protocol.layout import KINDS, QUANTA, Layout, Sizes


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


def speed_factors(samples: Sequence[Mapping[str, Sequence[float]]],
                  last_factors: Sequence[Mapping[str, float]]) -> list[dict[str, float]] | None:
    """Every node's speed factor per kind (the median of its recent samples: measured over
    predicted), the kinds it holds none of inferred; None until every kind has one."""
    factors = [{k: statistics.median(q) if q else None for k, q in node.items()} for node in samples]
    means = {}
    for k in KINDS:
        known = [f[k] for f in factors if f[k] is not None]
        if not known:
            return None
        means[k] = statistics.fmean(known)
    # Each node's relative slowness (its factors over the kinds' means), then each kind's
    # factor at average slowness (the holders' factors divided by their own slowness).
    slow: list[float | None] = []
    for f in factors:
        rel = [f[k] / means[k] for k in KINDS if f[k] is not None and means[k] > 0]
        slow.append(statistics.median(rel) if rel else None)
    typical = {k: statistics.fmean(f[k] / sl for f, sl in zip(factors, slow)
                                   if f[k] is not None and sl is not None and sl > 0) for k in KINDS}
    # A kind a node holds none of: its factor at the last switch (kept across level shifts,
    # scaled by them), else inferred from its relative slowness, else average. Not inferred
    # first: a slow box left with a sliver of one kind measures mostly that sliver's replicated
    # part, which made it look faster than it is and get work back.
    out = []
    for d, (f, sl) in enumerate(zip(factors, slow)):
        last = last_factors[d]
        out.append({k: f[k] if f[k] is not None else last[k] if k in last
                    else (sl if sl is not None else 1.0) * typical[k] for k in KINDS})
    return out


def noise(samples: Sequence[Mapping[str, Sequence[float]]], layout: Layout, nodes: Sequence[NodeCost]) -> float:
    """Relative standard error of `layout`'s predicted barrier time: per kind, the slowest node's
    median factor's (1.25 x sigma / sqrt(n), sigma from the interquartile range: a stream that
    flips between two levels has a wide one, where the median absolute deviation would see only
    the majority's), weighted by the kind's part of the barrier time."""
    total = err = 0.0
    for k in KINDS:
        times = [kind_time(n.kind(k), layout.share(k, d)) for d, n in enumerate(nodes)]
        d = max(range(len(times)), key=times.__getitem__)
        total += times[d]
        q = samples[d][k]
        if len(q) >= 3:
            med = statistics.median(q)
            lo, _, hi = statistics.quantiles(q, n=4, method="inclusive")
            if med > 0:
                err += times[d] * 1.25 * (hi - lo) / 1.349 / math.sqrt(len(q)) / med
    return err / total if total > 0 else 0.0


def measured_costs(base: Sequence[NodeCost], factors: Sequence[Mapping[str, float]],
                   anchors: Sequence[Mapping[str, tuple[float, float]]],
                   samples: Sequence[Mapping[str, Sequence[float]]], layout: Layout, gap: float) -> list[NodeCost]:
    """The nodes' costs as measured: each kind scaled by its factor, or — where the node has an
    anchor (share, seconds) at a share at least `gap` of the larger away from its current one and
    samples at the current one — the line through both (`two_point`)."""
    out = []
    for d, (b, f) in enumerate(zip(base, factors)):
        node = refit(b, f)
        lines = {}
        for k, anchor in anchors[d].items():
            at = layout.share(k, d)
            if at > 0 and samples[d][k] and abs(at - anchor[0]) >= gap * max(at, anchor[0]):
                kc = two_point(b.kind(k), f[k], at, anchor)
                if kc is not None:
                    lines[k] = kc
        out.append(replace(node, **lines) if lines else node)
    return out


def reach_fraction(layout: Layout, target: Layout, samples: Sequence[Mapping[str, Sequence[float]]],
                   anchors: Sequence[Mapping[str, tuple[float, float]]], reach: float) -> float:
    """How far (0 to 1) from `layout` towards `target` a move may go: no node more of a kind than
    `reach` x the largest share it was measured at (now, with samples, or at its anchor), nor more
    than the even share of a kind it was never measured at."""
    n = layout.world_size
    alpha = 1.0
    for d in range(n):
        for k in KINDS:
            cur, want = layout.share(k, d), target.share(k, d)
            seen = [s for s in (cur if samples[d][k] else 0.0, anchors[d].get(k, (0.0,))[0]) if s > 0]
            limit = reach * max(seen) if seen else max(cur, 1 / n)
            if want > limit > cur:
                alpha = min(alpha, (limit - cur) / (want - cur))
            elif want > cur >= limit:
                alpha = 0.0
    return alpha


def with_rest(times: Mapping[str, float], layout: Layout, d: int, unit_bytes: Mapping[str, float],
              sizes: Sizes) -> Mapping[str, float]:
    """Rank d's measured seconds per kind with its "rest" (the optimizer step, clipping, the
    replicated layers) booked to the kinds it holds in proportion to their bytes."""
    held = {k: unit_bytes[k] * layout.share(k, d) * sizes.total(k) for k in KINDS}
    total = sum(held.values())
    if "rest" not in times or total <= 0:
        return times
    return {k: times[k] + times["rest"] * held[k] / total for k in KINDS}


def step_within_caps(layout: Layout, target: Layout, alpha: float, base: Sequence[NodeCost],
                     caps: Sequence[float], sizes: Sizes) -> tuple[Layout, float]:
    """The layout `alpha` of the way from `layout` to `target` (`blend`), halved until every node
    fits its memory cap (the first node as the owner): (that step, its fraction), or (`layout`, 0)."""
    owner = [replace(base[0], owner=True), *base[1:]]
    while alpha > 0:
        step = target if alpha >= 1 else blend(layout, target, alpha, sizes, QUANTA)
        if all(predict_memory(nd, layout_shares(step, d)) <= cap
               for d, (nd, cap) in enumerate(zip(owner, caps))) or alpha >= 1:
            return step, alpha
        alpha /= 2  # a rounded step past a cap: a shorter one
    return layout, 0.0


def fit_move(moves: Sequence[tuple[float, float]], per_byte: float, fixed: float) -> tuple[float, float]:
    """A re-shard's cost model, (fixed seconds, seconds per byte), from the measured moves
    (bytes, seconds) and the prior (`fixed` + bytes x `per_byte`: the link's bandwidth).

    A move costs a part that does not grow with its bytes (the ranks meet at the boundary, build the
    new shard's tensors and optimizer state, free the old) and its bytes over the link. One number
    cannot say which part a measurement exceeded the prior by, and the two guesses fail unequally:
    scaling the whole prior by measured / prior (as this did) read a 16 %-of-the-way first move that
    took 10x its 5 ms prior as a link ten times slower, priced the whole move at 0.5 s instead of
    about 0.1, and the payback test then kept a box slowed 7.5x on its share for the rest of the
    job; taking the excess as fixed errs once, on the next big move, which is then measured. So:
      - moves of one size (the largest under twice the smallest): at their median size the model
        gives their median time; what exceeds the prior there is fixed, and a move faster than the
        prior scales both parts down (the link is faster than assumed);
      - moves of sizes at least 2x apart: the least-squares line through them (seconds against
        bytes), its intercept at least 0; a line that falls with the bytes is noise, read as one size.
    """
    pts = [(b, s) for b, s in moves if b >= 0 and s > 0 and math.isfinite(b) and math.isfinite(s)]
    if not pts:
        return fixed, per_byte
    sizes = [b for b, _ in pts]
    if len(pts) >= 2 and max(sizes) >= 2 * min(sizes):
        n = len(pts)
        mb, ms = sum(sizes) / n, sum(s for _, s in pts) / n
        sbb = sum((b - mb) ** 2 for b in sizes)  # > 0 unless every move was empty
        slope = sum((b - mb) * (s - ms) for b, s in pts) / sbb if sbb > 0 else 0.0
        if slope > 0:
            intercept = ms - slope * mb
            if intercept >= 0:
                return intercept, slope
            return 0.0, sum(b * s for b, s in pts) / sum(b * b for b in sizes)  # through the origin
    b, s = statistics.median(sizes), statistics.median(s for _, s in pts)
    prior = fixed + b * per_byte
    if prior <= 0:
        return s, per_byte
    if s >= prior:
        return fixed + (s - prior), per_byte
    return fixed * s / prior, per_byte * s / prior
