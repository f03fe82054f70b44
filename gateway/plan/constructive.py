"""The constructive half of the `segment` planner's integer test (`integer.IntegerTest` inherits it):
beyond the exact programme's budget, the memory-bound nodes' counts are built kind by kind — a
max-flow of the kinds' bytes over the nodes' room, rounded down, then each leftover quantum placed
where the kinds still to place keep the most room. Every count is checked against the exact memory:
it can miss a solution, never invent one. Pure: no I/O.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence


class ConstructiveTest:
    """The constructive test and the per-node packing it shares with the exact programme
    (`_most_of`). A base of `integer.IntegerTest`, so of `model.Problem` only: it uses the
    problem's kinds, caps, base, load, t0 and its `fits`."""

    kinds: list  # model.KindModel per kind (not imported: model imports this module, through integer)
    caps: list[float]
    base: list[float]
    load: list[tuple[float, ...]]
    t0: list[float]

    def _most_of(self, d: int, w: Sequence[int], i: int, top: int) -> int:
        """Most quanta <= top of kind i node d fits next to the other kinds' counts in w (-1: not
        even 0). Closed form of the piecewise-linear memory, then checked exactly."""
        x = list(w)
        x[i] = 0
        if not self.fits(d, x):
            return -1
        x[i] = top
        if self.fits(d, x):
            return top
        kd = self.kinds[i]
        rest = 0.0
        temp = self.t0[d]
        for j, kj in enumerate(self.kinds):
            if j != i:
                sj = kj.share(w[j])
                rest += kj.ms[d] * sj
                temp = max(temp, kj.mt[d] * sj)
        room = self.caps[d] - self.base[d] - rest - max(self.load[d])  # a guess, checked below
        ms, mt = kd.ms[d], kd.mt[d]
        smax = 1.0
        if ms > 0:
            smax = min(smax, (room - temp) / ms)
        if ms + mt > 0:
            smax = min(smax, room / (ms + mt))
        g = max(0, min(top, int(smax * kd.total / kd.q)))
        x[i] = g
        while g > 0 and not self.fits(d, x):
            g -= 1
            x[i] = g
        while g < top:
            x[i] = g + 1
            if not self.fits(d, x):
                break
            g += 1
        return g

    def _construct(self, bound: list[int], ub: list[list[int]], need: list[int]) -> list[list[int]] | None:
        """The bound nodes' counts, kind by kind from the coarsest: a max-flow of bytes gives each
        node's share (rounded down), and each leftover quantum goes where the kinds still to place
        keep the most room by the relaxed test; the finest kind last, each node taking all it fits.
        Every count is checked against the exact memory: it can miss a solution, never invent one."""
        nb = len(bound)
        order = sorted(range(3), key=lambda i: -max(self.kinds[i].ms[d] / self.kinds[i].total for d in bound))
        out = [[0, 0, 0] for _ in bound]
        for pos, i in enumerate(order):
            rest = order[pos + 1:]
            if not rest:  # the last kind: every node takes all it fits
                for j, d in enumerate(bound):
                    out[j][i] = self._most_of(d, out[j], i, ub[d][i])
                    if out[j][i] < 0:
                        return None
                if sum(out[j][i] for j in range(nb)) < need[i]:
                    return None
                continue
            todo = [i, *rest]
            per = {k: max(self.kinds[k].ms[d] for d in bound) * self.kinds[k].q / self.kinds[k].total
                   for k in todo}
            rooms = [self._room(d, out[j], ub[d]) for j, d in enumerate(bound)]
            if per[i] > 0:
                flow = maxflow([need[k] * per[k] for k in todo],
                                [[ub[d][k] * per[k] for d in bound] for k in todo], rooms)
                frac = []
                for j, d in enumerate(bound):
                    x = flow[0][j] / per[i]
                    out[j][i] = min(ub[d][i], int(x + 1e-9))
                    frac.append((out[j][i] - x, j))
                # Largest remainders first: the rounded-down flow's leftovers, where they fit.
                left = need[i] - sum(out[j][i] for j in range(nb))
                for _, j in sorted(frac):
                    if left <= 0:
                        break
                    d = bound[j]
                    if out[j][i] < ub[d][i]:
                        out[j][i] += 1
                        if self.fits(d, out[j]):
                            left -= 1
                        else:
                            out[j][i] -= 1
            left = need[i] - sum(out[j][i] for j in range(nb))
            if left > 0 and not self._place(bound, out, ub, need, i, rest, left):
                return None
        if any(not self.fits(d, out[j]) for j, d in enumerate(bound)):
            return None
        return out

    def _place(self, bound: list[int], out: list[list[int]], ub: list[list[int]], need: list[int],
               i: int, rest: list[int], left: int) -> bool:
        """Place `left` more quanta of kind i, one at a time on the bound node that leaves the kinds
        still to place the most room by the relaxed test over them (kept as per-node terms, so a
        move re-evaluates one node)."""
        nb = len(bound)
        subsets = [S for r in range(1, len(rest) + 1) for S in itertools.combinations(rest, r)]
        xcap = {k: [self.kinds[k].ms[d] * self.kinds[k].share(ub[d][k]) for d in bound] for k in rest}
        want = [max(1e-300, sum(need[k] * max(self.kinds[k].ms[d] for d in bound) * self.kinds[k].q
                                / self.kinds[k].total for k in S)) for S in subsets]

        def terms(j: int) -> list[float]:
            room = self._room(bound[j], out[j], ub[bound[j]])
            return [min(room, sum(xcap[k][j] for k in S)) for S in subsets]

        per = [terms(j) for j in range(nb)]
        have = [sum(per[j][s] for j in range(nb)) for s in range(len(subsets))]
        for _ in range(left):
            best, score, best_terms = -1, -math.inf, None
            for j, d in enumerate(bound):
                if out[j][i] >= ub[d][i]:
                    continue
                out[j][i] += 1
                if self.fits(d, out[j]):
                    t = terms(j)
                    sc = min(((have[s] - per[j][s] + t[s]) - want[s]) / want[s] for s in range(len(subsets))) \
                        if subsets else 0.0
                    if sc > score:
                        best, score, best_terms = j, sc, t
                out[j][i] -= 1
            if best < 0:
                return False
            out[best][i] += 1
            if best_terms is not None:
                for s in range(len(subsets)):
                    have[s] += best_terms[s] - per[best][s]
                per[best] = best_terms
        return True

    def _room(self, d: int, w: list[int], ub: list[int]) -> float:
        """Bytes node d has left for more partitioned weights (temporaries at their largest)."""
        temp = max(self.t0[d], *(kd.mt[d] * kd.share(ub[i]) for i, kd in enumerate(self.kinds)))
        part = sum(kd.ms[d] * kd.share(w[i]) for i, kd in enumerate(self.kinds))
        return max(0.0, self.caps[d] - self.base[d] - part - temp)


def maxflow(supply: list[float], cap: list[list[float]], room: list[float]) -> list[list[float]]:
    """Max-flow source -> kind i (supply[i]) -> node j (cap[i][j]) -> sink (room[j]); flows[i][j].
    Shortest augmenting paths (Edmonds-Karp) on a graph of a few kinds and n nodes."""
    K, n = len(supply), len(room)
    flow = [[0.0] * n for _ in range(K)]
    left, rroom = list(supply), list(room)
    eps = 1e-9 * max([1.0, *supply])
    while True:
        starts = [("k", i) for i in range(K) if left[i] > eps]
        prev: dict[tuple[str, int], tuple[str, int] | None] = dict.fromkeys(starts)
        queue, end = starts, None
        while queue and end is None:
            nxt = []
            for v in queue:
                kind, x = v
                if kind == "k":
                    for j in range(n):
                        if ("n", j) not in prev and cap[x][j] - flow[x][j] > eps:
                            prev[("n", j)] = v
                            if rroom[j] > eps:
                                end = ("n", j)
                                break
                            nxt.append(("n", j))
                else:
                    for i in range(K):
                        if ("k", i) not in prev and flow[i][x] > eps:
                            prev[("k", i)] = v
                            nxt.append(("k", i))
                if end is not None:
                    break
            queue = nxt
        if end is None:
            return flow
        path = [end]
        while prev[path[-1]] is not None:
            path.append(prev[path[-1]])  # type: ignore[arg-type]
        path.reverse()  # kind, node, kind, node, ...
        amount = min(left[path[0][1]], rroom[end[1]])
        for a, b in zip(path, path[1:]):
            amount = min(amount, cap[a[1]][b[1]] - flow[a[1]][b[1]] if a[0] == "k" else flow[b[1]][a[1]])
        for a, b in zip(path, path[1:]):
            if a[0] == "k":
                flow[a[1]][b[1]] += amount
            else:
                flow[b[1]][a[1]] -= amount
        left[path[0][1]] -= amount
        rroom[end[1]] -= amount
