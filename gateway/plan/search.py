"""The `segment` planner's searches (`xronos.gateway.plan.planner` explains the algorithm): best-first
branch and bound over boxes of target vectors on the planning model (`segment_search`, then
`polish`); the same search over continuous shares gives the ideal bound (`ideal.py`). Pure.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from xronos.gateway.plan.model import Problem, infeasible

# Beyond EXACT_NODES nodes the `segment` search stops once its plan is within GAP_TOL of the
# proven bound (the last 0.1 % is most of the boxes: one vocabulary quantum at a time); up to it,
# a home's few boxes, it proves the optimum.
EXACT_NODES = 8
GAP_TOL = 1e-3
# The walk lifts integer-infeasible targets by a common fraction of the way to the top corner,
# doubling from LIFT_FIRST and then bisecting LIFT_STEPS times: the integer test's cost grows with
# its targets (the top corner's can take 100x one near the optimum), so it starts low.
LIFT_FIRST = 1 / 256
LIFT_STEPS = 8


@dataclass(frozen=True)
class SearchStats:
    """How the `segment` search went (None for the other strategies)."""

    objective_s: float  # sum_seg max_d in the planning model (quanta; >= the layout's bottleneck)
    separable_s: float  # the separable optimum: a lower bound, reached when no cap binds
    coupled: bool  # caps bound, the branch and bound ran
    boxes: int  # box evaluations
    exact_test: bool  # every integer test was the exact dynamic programme
    budget_hit: bool


# --------------------------------------------------------------------------------------------
# Branch and bound over target vectors (monotonic optimisation).


@dataclass
class Search:
    """Best-first search over boxes [lo, hi] of target vectors."""

    prev: list[Callable[[float], float]]  # largest candidate <= x
    next_above: list[Callable[[float], float]]  # smallest candidate > x (continuous: x itself +)
    relaxed: Callable[[Sequence[float]], tuple[int, ...] | None]
    point: Callable[[Sequence[float]], tuple[object | None, bool]]  # (solution, exact)
    budget: int
    corner: Callable[[Sequence[float]], tuple[object | None, bool]] | None = None  # exact-only test
    targets: Callable[[object], tuple[float, ...]] = tuple  # a solution's per-kind bottlenecks
    tol: float = 0.0  # relative: boxes whose width sum is below tol * lower sum are not split
    gap: float = 0.0  # relative: stop once the incumbent is within this of every open box's bound
    ub: float = math.inf
    best: object = None
    best_tau: tuple[float, ...] | None = None
    boxes: int = 0
    exact: bool = True
    unresolved: float = math.inf
    open_lb: float = math.inf
    budget_hit: bool = False
    stop_at: tuple[float, ...] | None = None
    _ids: itertools.count = field(default_factory=itertools.count)

    def offer(self, tau: Sequence[float], sol: object) -> None:
        s = sum(tau)
        if s < self.ub:
            self.ub, self.best, self.best_tau = s, sol, tuple(tau)

    def run(self, lo: Sequence[float], hi: Sequence[float]) -> None:
        heap = [(sum(lo), next(self._ids), tuple(lo), tuple(hi))]
        while heap:
            lb, _, l, h = heapq.heappop(heap)
            if lb >= self.ub:
                heap = []
                break
            if lb * (1 + self.gap) >= self.ub:  # close enough: what is left only proves the last bit
                heapq.heappush(heap, (lb, 0, l, h))
                break
            if self.boxes >= self.budget:
                heapq.heappush(heap, (lb, 0, l, h))
                self.budget_hit = True
                break
            self.boxes += 1
            # Nothing above the incumbent minus the other sides' floors can help.
            h = tuple(min(h[k], self.prev[k](self.ub - (lb - l[k]))) for k in range(3))
            if any(h[k] < l[k] for k in range(3)):
                continue
            if self.relaxed(h) is not None:
                continue  # the whole box is infeasible
            if self.corner is not None and h != l:
                # The exact integer test at the upper corner, when affordable, drops whole boxes
                # between the relaxed and the integer frontier at once (and finds plans early).
                sol, exact = self.corner(h)
                if sol is not None:
                    self.offer(self.targets(sol), sol)
                    if lb >= self.ub:
                        continue
                elif exact:
                    continue
            if self.relaxed(l) is None:
                sol, exact = self.point(l)
                if sol is not None:
                    self.offer(l, sol)
                    continue
                if not exact:
                    # Every box left starts at or above lb: the bound is settled here; what is left
                    # to do is finding a good plan above it (`polish`).
                    self.exact = False
                    self.unresolved = min(self.unresolved, lb)
                    self.stop_at = l
                    heap = []
                    break
                # The box without its lower corner: one coordinate above l_k, the earlier equal.
                for k in range(3):
                    nk = self.next_above[k](l[k])
                    if nk <= h[k]:
                        nl = tuple(nk if j == k else l[j] for j in range(3))
                        nh = tuple(l[j] if j < k else h[j] for j in range(3))
                        heapq.heappush(heap, (sum(nl), next(self._ids), nl, nh))
                continue
            widths = [h[k] - l[k] for k in range(3)]
            if self.tol and sum(widths) <= self.tol * max(lb, 1e-300):
                # Boxes leave the heap in order of their lower bounds, and the optimum lies in one
                # of them: none can bring the bound below this one's, so it is settled.
                self.unresolved = min(self.unresolved, lb)
                break
            k = max(range(3), key=lambda j: widths[j])
            mid = self.prev[k](l[k] + widths[k] / 2)
            if mid < l[k]:
                mid = l[k]
            if mid >= h[k]:
                mid = self.prev[k](math.nextafter(h[k], -math.inf))
                if mid < l[k]:
                    mid = l[k]
            right = self.next_above[k](mid)
            lh = tuple(mid if j == k else h[j] for j in range(3))
            heapq.heappush(heap, (lb, next(self._ids), l, lh))
            if right <= h[k]:
                rl = tuple(right if j == k else l[j] for j in range(3))
                heapq.heappush(heap, (sum(rl), next(self._ids), rl, h))
        self.open_lb = min((b[0] for b in heap), default=math.inf)

    @property
    def lower(self) -> float:
        return min(self.ub, self.open_lb, self.unresolved)


def walk(pb: Problem, lo: Sequence[float], top: Sequence[float], steps: int = 300
          ) -> tuple[tuple[float, ...], object] | None:
    """A first feasible target vector: from the separable targets, repeatedly raise the kinds of a
    violated subset as little as possible (one kind alone, or all of them by a common fraction of
    the way to their tops, whichever adds less), until the integer test passes."""
    prev = [kd.prev for kd in pb.kinds]
    nxt = [kd.next_above for kd in pb.kinds]
    tau = list(lo)
    for _ in range(steps):
        bad = pb.relaxed(tau)
        if bad is None:
            sol, _ = pb.integer(tau)
            if sol is not None:
                return tuple(tau), sol
            # Relaxed-feasible but not in integers: raise every kind by the smallest common
            # fraction of the way to its top that the integer test accepts.
            base = list(tau)

            def lift(t: float) -> list[float]:
                return [max(base[k], prev[k](base[k] + t * (top[k] - base[k]))) for k in range(3)]

            lo_t, hi_t = 0.0, LIFT_FIRST
            while pb.integer(lift(hi_t))[0] is None:
                if hi_t >= 1.0:
                    return None
                lo_t, hi_t = hi_t, min(1.0, 2 * hi_t)
            for _ in range(LIFT_STEPS):
                mid = (lo_t + hi_t) / 2
                lo_t, hi_t = (lo_t, mid) if pb.integer(lift(mid))[0] is not None else (mid, hi_t)
            tau = lift(hi_t)
            continue
        moves = []
        for k in bad:
            if pb.holds(with_target(tau, k, top[k]), bad):
                x = bisect_up(lambda v, k=k: pb.holds(with_target(tau, k, v), bad), tau[k], top[k], prev[k], nxt[k])
                moves.append((x - tau[k], with_target(tau, k, x)))
        if len(bad) > 1:

            def at(t: float) -> list[float]:
                return [max(tau[k], prev[k](tau[k] + t * (top[k] - tau[k]))) if k in bad else tau[k]
                        for k in range(3)]

            if pb.holds(at(1.0), bad):
                lo_t, hi_t = 0.0, 1.0
                for _ in range(24):  # 2^-24 of the way: finer than the candidates
                    mid = (lo_t + hi_t) / 2
                    lo_t, hi_t = (lo_t, mid) if pb.holds(at(mid), bad) else (mid, hi_t)
                cand = at(hi_t)
                moves.append((sum(cand) - sum(tau), cand))
        if not moves:
            return None
        tau = list(min(moves, key=lambda m: m[0])[1])
    return None


def with_target(tau: Sequence[float], k: int, v: float) -> list[float]:
    out = list(tau)
    out[k] = v
    return out


def bisect_up(ok: Callable[[float], bool], lo: float, hi: float, prev: Callable[[float], float],
               next_above: Callable[[float], float]) -> float:
    """Smallest candidate in (lo, hi] with ok (ok(hi) holds, monotone)."""
    for _ in range(200):
        mid = prev(lo + (hi - lo) / 2)
        if mid <= lo:
            mid = next_above(lo)
        if mid >= hi:
            return hi
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


# --------------------------------------------------------------------------------------------
# Strategies.


def segment_search(pb: Problem, budget: int) -> tuple[list[list[int]], SearchStats, float]:
    kinds = pb.kinds
    lo = [kd.solve() for kd in kinds]
    sep = sum(lo) + pb.const
    w, _ = pb.integer(lo)
    if w is not None:
        obj = pb.objective(w)
        return w, SearchStats(obj, sep, False, 0, True, False), sep
    prev = [kd.prev for kd in kinds]
    nxt = [kd.next_above for kd in kinds]
    top = [kd.top() for kd in kinds]
    if pb.relaxed(top) is not None:
        raise infeasible(pb, "even with every node at its most, the kinds do not fit the memory together")
    search = Search(prev, nxt, pb.relaxed, pb.integer, budget,
                     corner=lambda tau: pb.integer(tau, exact_only=True), targets=pb.targets,
                     gap=GAP_TOL if pb.n > EXACT_NODES else 0.0)
    # The first incumbent: a greedy walk up from the separable targets, which usually ends within
    # a fraction of a percent of the optimum, so the search's boxes start small (the integer test
    # costs more the higher its targets). Failing that, the test at the top corner (every node at
    # its most, trimmed from the slowest down).
    first = walk(pb, lo, top)
    if first is not None:
        search.offer(first[0], first[1])
    else:
        sol, exact = pb.integer(top, quick=True)
        if sol is not None:
            search.offer(pb.targets(sol), sol)
        elif exact:
            raise infeasible(pb, "no integer split of the quanta fits the memory caps even with every "
                                  "node at its most")
    search.run(lo, top)
    if search.best is None:
        sol, exact = pb.integer(top)
        if sol is None:
            raise infeasible(pb, "no integer split of the quanta fits the memory caps (only a fractional "
                                  "one would: the caps are too tight for the quantum)" if exact else
                                  "the search found no integer split of the quanta within its budget")
        search.offer(top, sol)
    if search.stop_at is not None or search.budget_hit:
        start = search.stop_at or lo
        polish(pb, search, start)
    w = search.best  # type: ignore[assignment]
    obj = pb.objective(w)
    lower = min(search.lower + pb.const, obj)
    stats = SearchStats(obj, sep, True, search.boxes, search.exact, search.budget_hit)
    return w, stats, max(lower, sep)


def polish(pb: Problem, search: Search, start: Sequence[float], rounds: int = 3) -> None:
    """A better plan above a target vector the search could not settle: lift it toward the
    incumbent by the smallest common fraction the integer test accepts, then lower one kind at a
    time as far as the test still passes."""
    ref = search.best_tau
    assert ref is not None
    kinds = pb.kinds

    def at(t: float) -> list[float]:
        return [max(start[k], kinds[k].prev(start[k] + t * (ref[k] - start[k]))) for k in range(3)]

    lo_t, hi_t = 0.0, 1.0
    for _ in range(14):
        mid = (lo_t + hi_t) / 2
        sol, _ = pb.integer(at(mid))
        if sol is not None:
            search.offer(pb.targets(sol), sol)
            hi_t = mid
        else:
            lo_t = mid
    tau = list(search.best_tau)  # type: ignore[arg-type]
    for _ in range(rounds):
        moved = False
        for k in range(3):
            low = start[k]
            if tau[k] <= low:
                continue

            def ok(v: float, k: int = k) -> bool:
                return pb.integer(with_target(tau, k, v))[0] is not None

            v = low if ok(low) else bisect_up(ok, low, tau[k], kinds[k].prev, kinds[k].next_above)
            if v < tau[k]:
                sol, _ = pb.integer(with_target(tau, k, v))
                if sol is not None:
                    tau[k] = v
                    search.offer(pb.targets(sol), sol)
                    moved = True
        if not moved:
            break
