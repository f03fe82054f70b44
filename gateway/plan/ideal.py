"""The `segment` planner's ideal bound (`xronos.gateway.plan.planner` explains it): continuous shares
per kind, every segment balanced, under the same memory caps, found by the same branch and bound
over boxes of target vectors (`search.Search`) as the integer plan. Pure.
"""

from __future__ import annotations

import math
from typing import Sequence

from xronos.gateway.plan.memorymodel import predict_memory
from xronos.gateway.plan.model import KindModel, Problem
from xronos.gateway.plan.search import Search
from xronos.protocol.layout import KINDS

IDEAL_BUDGET = 400  # box evaluations of the ideal's search (its bound stays valid when cut short)
IDEAL_TOL = 1e-3  # relative width below which the ideal's search stops splitting a box


class ContKind:
    """One kind with continuous shares (the ideal's relaxation)."""

    def __init__(self, kd: KindModel, pb: Problem, i: int) -> None:
        self.kd, self.n = kd, pb.n
        self.smax = []
        for d in range(pb.n):  # largest share that fits alone: M = base + m s + max(t0, mt s) <= cap
            room = pb.caps[d] - pb.base[d]
            m, mt = kd.ms[d], kd.mt[d]
            s = 1.0
            if m > 0:
                s = min(s, (room - pb.t0[d]) / m)
            if m + mt > 0:
                s = min(s, room / (m + mt))
            self.smax.append(max(0.0, s))

    def vec(self, tau: float) -> list[float]:
        """Every node's largest share within tau (-1: not even 0 fits)."""
        kd = self.kd
        return [-1.0 if tau < f else 0.0 if tau < c else sm if b == 0 else min(sm, (tau - c) / b)
                for f, c, b, sm in zip(kd.f, kd.c, kd.b, self.smax)]

    def total(self, tau: float) -> float:
        return sum(self.vec(tau))

    def solve(self) -> float:
        lo = self.kd.floor
        if self.total(lo) >= 1 - 1e-12:
            return lo
        hi = max(self.kd.c[d] + self.kd.b[d] * self.smax[d] for d in range(self.n))
        if self.total(hi) < 1 - 1e-12:
            return math.inf
        while True:
            mid = lo + (hi - lo) / 2
            if mid <= lo or mid >= hi:
                return hi
            if self.total(mid) >= 1 - 1e-12:
                hi = mid
            else:
                lo = mid

    def top(self) -> float:
        return max(self.kd.c[d] + self.kd.b[d] * self.smax[d] for d in range(self.n))


def ideal_bound(pb: Problem, budget: int, ub: float = math.inf) -> float:
    """The continuous relaxation's bound; `ub` (a known plan's compute) prunes its search."""
    if pb.short:
        return math.inf
    conts = [ContKind(kd, pb, i) for i, kd in enumerate(pb.kinds)]
    lo = [c.solve() for c in conts]
    if not all(math.isfinite(x) for x in lo):
        return math.inf
    room = pb.room

    cache: list[dict[float, list[float] | None]] = [{}, {}, {}]

    def scaled(i: int, tau: float) -> list[float] | None:
        """Kind i at target tau: None if the shares cannot cover it, else each node's bytes at the
        kind's smallest per-share bytes (memoised: neighbouring boxes share coordinates)."""
        got = cache[i].get(tau, False)
        if got is False:
            v = conts[i].vec(tau)
            m = pb.msmin[i]
            got = cache[i][tau] = None if min(v) < 0 or sum(v) < 1 - 1e-12 else [m * x for x in v]
        return got  # type: ignore[return-value]

    def relaxed(tau: Sequence[float]) -> tuple[int, ...] | None:
        ss = []
        for i in range(3):
            x = scaled(i, tau[i])
            if x is None:
                return (i,)
            ss.append(x)
        a, b, c = ss
        for S, xs in (((0, 1), map(float.__add__, a, b)), ((0, 2), map(float.__add__, a, c)),
                      ((1, 2), map(float.__add__, b, c)), ((0, 1, 2), map(lambda x, y, z: x + y + z, a, b, c))):
            need = sum(pb.msmin[i] for i in S)
            if sum(map(min, room, xs)) < need * (1 - 1e-12):
                return S
        return None

    # The separable shares fit together: balanced per kind is then the continuous optimum.
    if relaxed(lo) is None and cont_fits(pb, conts, lo):
        return sum(lo) + pb.const
    top = [c.top() for c in conts]
    if relaxed(top) is not None:
        return math.inf
    ident = [lambda x: x] * 3
    up = [lambda x: math.nextafter(x, math.inf)] * 3
    search = Search(ident, up, relaxed, lambda tau: (True, True), budget, tol=IDEAL_TOL)
    search.ub = ub - pb.const
    search.run(lo, top)
    return min(search.lower + pb.const, ub)


def cont_fits(pb: Problem, conts: list[ContKind], tau: Sequence[float]) -> bool:
    """Whether the balanced shares at tau, trimmed proportionally to sum to 1, fit every node."""
    shares = []
    for i, c in enumerate(conts):
        v = c.vec(tau[i])
        tot = sum(v)
        shares.append([x / tot for x in v])
    for d in range(pb.n):
        sh = {k: shares[i][d] for i, k in enumerate(KINDS)}
        if predict_memory(pb.nodes[d], sh) > pb.caps[d] * (1 + 1e-12):
            return False
    return True
