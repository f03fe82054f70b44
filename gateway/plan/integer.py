"""The integer half of the `segment` planner's feasibility test (`model.Problem` inherits it):
whether whole quanta can cover every kind within a target vector of per-kind times under the
nodes' memory caps. Nodes whose upper corner fits are free; the memory-bound ones get an exact
dynamic programme over undominated (attention, MLP, vocabulary) states while it stays within a
transition budget, and beyond it the constructive fallback it inherits (`constructive.py`: max-flow
over the kinds' bytes, then placement), which can only miss solutions. Pure: no I/O.
"""

from __future__ import annotations

from typing import Sequence

from xronos.gateway.plan.constructive import ConstructiveTest

# The exact integer test gives up (for the constructive one) beyond this many transitions.
EXACT_DP_BUDGET = 300_000
CORNER_DP_BUDGET = 25_000  # the same at a box's upper corner (pruning only: cheaper to give up)


def undominated(states: dict[int, int], nm: int) -> dict[int, int]:
    """Drop every state (key a*(nm+1)+m, value v) another one matches or beats in all of
    attention, MLP and vocabulary. Sweep by attention downwards with a suffix-max tree over MLP."""
    size = nm + 1
    tree = [-1] * (size + 1)  # Fenwick tree of max over m' >= m (indices reversed)
    out: dict[int, int] = {}
    for key in sorted(states, reverse=True):  # attention desc, then MLP desc
        v = states[key]
        m = key % size
        i, best = size - m, -1  # query max over m' >= m among states already seen (a' >= a)
        while i > 0:
            if tree[i] > best:
                best = tree[i]
            i -= i & -i
        if v > best:
            out[key] = v
            i = size - m
            while i <= size:
                if tree[i] < v:
                    tree[i] = v
                i += i & -i
    return out


class IntegerTest(ConstructiveTest):
    """Integer feasibility at a target vector, on the problem's per-node memory model. A base of
    `model.Problem` only: it uses the problem's n, kinds, caps, base, load (annotated in the base),
    its `fits` and `U` and the caches it sets up."""

    n: int
    _vtab: dict[int, list[list[int]]]
    _pcache: dict[tuple[int, ...], list[tuple[int, int, int]]]
    _icache: dict[tuple, tuple[list[list[int]] | None, bool]]

    def integer(self, tau: Sequence[float], exact_only: bool = False, quick: bool = False
                ) -> tuple[list[list[int]] | None, bool]:
        """(counts per node per kind covering every kind within tau and the caps, or None; whether
        the answer is exact). Exact DP when small, else the constructive test. Memoised."""
        key = (tuple(tau), exact_only, quick)
        got = self._icache.get(key)
        if got is None:
            got = self._icache[key] = self._integer(tau, exact_only, quick)
        w, exact = got
        return ([list(x) for x in w] if w is not None else None), exact

    def _integer(self, tau: Sequence[float], exact_only: bool, quick: bool
                 ) -> tuple[list[list[int]] | None, bool]:
        Us = [self.U(i, tau[i]) for i in range(3)]
        ub = [[Us[i][d] for i in range(3)] for d in range(self.n)]
        if any(min(x) < 0 for x in ub):
            return None, True
        free = [self.fits(d, ub[d]) for d in range(self.n)]
        need = [self.kinds[i].W - sum(ub[d][i] for d in range(self.n) if free[d]) for i in range(3)]
        bound = [d for d in range(self.n) if not free[d]]
        w = [list(x) if free[d] else [0, 0, 0] for d, x in enumerate(ub)]
        if all(x <= 0 for x in need):
            return self._trim(w), True
        need = [max(0, x) for x in need]
        if not bound:
            return None, True
        got, done = self._dp(bound, ub, need, CORNER_DP_BUDGET if exact_only or quick else EXACT_DP_BUDGET)
        if done:
            if got is None:
                return None, True
            for d, x in zip(bound, got):
                w[d] = list(x)
            return self._trim(w), True
        if exact_only:
            return None, False
        got = self._construct(bound, ub, need)
        if got is None:
            return None, False
        for d, x in zip(bound, got):
            w[d] = list(x)
        return self._trim(w), True

    def _choices(self, d: int, ua: int, um: int) -> list[tuple[int, int, int]]:
        """(attention, MLP, most vocabulary by memory alone) node d can hold, for counts up to
        (ua, um). The per-node table of the most vocabulary is grown on demand and kept (targets
        visited by the search ask for overlapping corners of it)."""
        table = self._vtab.setdefault(d, [])
        W = self.kinds[2].W
        out = []
        for a in range(ua + 1):
            if a == len(table):
                table.append([])
            row = table[a]
            while len(row) <= um and (not row or row[-1] >= 0):
                row.append(self._most_of(d, [a, len(row), 0], 2, W))
            for m in range(min(um, len(row) - 1) + 1):
                v = row[m]
                if v < 0:
                    break  # more MLP only needs more memory
                out.append((a, m, v))
            if not row or row[0] < 0:
                break  # more attention only needs more memory
        return out

    def _dp(self, bound: list[int], ub: list[list[int]], need: list[int], limit: float
            ) -> tuple[list[tuple[int, int, int]] | None, bool]:
        """Exact: can the bound nodes hold `need` (attention, MLP, vocabulary quanta) within
        their time bounds `ub` and their memory? Returns (counts per bound node or None, True),
        or (None, False) once it would take more than `limit` transitions.

        Nodes whose time bounds allow no attention trade only MLP against vocabulary, and nodes
        allowed no MLP only attention against vocabulary: each such group is a 1-D programme
        (quanta placed -> most vocabulary). The other nodes run the 2-D programme (state:
        attention and MLP placed, capped at the need; value: most vocabulary; dominated states
        and states the remaining nodes cannot complete are dropped). The groups meet at the end
        through suffix maxima."""
        na, nm, nv = need
        size = nm + 1
        per: dict[int, list[tuple[int, int, int]]] = {}
        for d in bound:
            ua, um, uv = ub[d]
            key = (d, ua, um, uv, na, nm)  # neighbouring targets often leave a node's bounds alone
            got = self._pcache.get(key)
            if got is None:
                ch: dict[int, int] = {}
                for a, m, v in self._choices(d, ua, um):
                    a, m, v = min(a, na), min(m, nm), min(v, uv)
                    k = a * size + m
                    if v > ch.get(k, -1):
                        ch[k] = v
                got = self._pcache[key] = [(k // size, k % size, v) for k, v in undominated(ch, nm).items()]
            per[d] = got
        g_m = [d for d in bound if all(c[0] == 0 for c in per[d])]  # MLP vs vocabulary only
        g_a = [d for d in bound if d not in g_m and all(c[1] == 0 for c in per[d])]
        g2 = sorted((d for d in bound if d not in g_m and d not in g_a), key=lambda d: len(per[d]))
        ops = [0]

        def line(group: list[int], axis: int, cap: int) -> tuple[list[int], list[list[tuple[int, int]]]] | None:
            """1-D programme along `axis` (0 attention, 1 MLP): best[x] = most vocabulary with x
            placed (capped), plus per-node back-pointers (x before, the node's count)."""
            best = [-1] * (cap + 1)
            best[0] = 0
            backs = []
            for d in group:
                choices = [(c[axis], c[2]) for c in per[d]]
                ops[0] += (cap + 1) * len(choices)
                if ops[0] > limit:
                    return None
                nxt = [-1] * (cap + 1)
                bk = [(0, 0)] * (cap + 1)
                for x, sv in enumerate(best):
                    if sv < 0:
                        continue
                    for q, v in choices:
                        t = x + q if x + q < cap else cap
                        if sv + v > nxt[t]:
                            nxt[t] = sv + v
                            bk[t] = (x, q)
                best = nxt
                backs.append(bk)
            return best, backs

        lm = line(g_m, 1, nm)
        la = line(g_a, 0, na)
        if lm is None or la is None:
            return None, False
        best_m, back_m = lm
        best_a, back_a = la
        # suffix maxima: the most vocabulary the group holds with at least x quanta placed
        suf_m, suf_a = list(best_m), list(best_a)
        for x in range(nm - 1, -1, -1):
            if suf_m[x + 1] > suf_m[x]:
                suf_m[x] = suf_m[x + 1]
        for x in range(na - 1, -1, -1):
            if suf_a[x + 1] > suf_a[x]:
                suf_a[x] = suf_a[x + 1]

        def rest_ok(sa: int, sm: int, sv: int) -> bool:
            ra, rm = suf_a[max(0, na - sa)], suf_m[max(0, nm - sm)]
            return ra >= 0 and rm >= 0 and sv + ra + rm >= nv

        # What the 2-D nodes after position j, plus both groups, can add at most (for pruning).
        reach_a = max(x for x, v in enumerate(best_a) if v >= 0)
        reach_m = max(x for x, v in enumerate(best_m) if v >= 0)
        extra = [[reach_a, reach_m, max(v for v in best_a if v >= 0) + max(v for v in best_m if v >= 0)]
                 for _ in range(len(g2) + 1)]
        for j in range(len(g2) - 1, -1, -1):
            c = per[g2[j]]
            extra[j] = [extra[j + 1][0] + max(x[0] for x in c), extra[j + 1][1] + max(x[1] for x in c),
                        extra[j + 1][2] + max(x[2] for x in c)]
        layer: dict[int, int] = {0: 0}
        back: list[dict[int, tuple[int, tuple[int, int, int]]]] = []
        for j, d in enumerate(g2):
            choices = per[d]
            ops[0] += len(layer) * len(choices)
            if ops[0] > limit:
                return None, False
            ra, rm, rv = extra[j + 1]
            nxt: dict[int, int] = {}
            bk: dict[int, tuple[int, tuple[int, int, int]]] = {}
            get = nxt.get
            for key, sv in layer.items():
                sa, sm = divmod(key, size)
                for c in choices:
                    a, m, v = c
                    ta, tm = sa + a, sm + m
                    if ta > na:
                        ta = na
                    elif ta + ra < na:
                        continue
                    if tm > nm:
                        tm = nm
                    elif tm + rm < nm:
                        continue
                    val = sv + v
                    if val + rv < nv:
                        continue
                    k = ta * size + tm
                    if val > get(k, -1):
                        nxt[k] = val
                        bk[k] = (key, c)
            back.append(bk)
            if not nxt:
                return None, True
            layer = undominated(nxt, nm)
        found = None
        for key, sv in layer.items():
            sa, sm = divmod(key, size)
            if rest_ok(sa, sm, sv):
                found = key
                break
        if found is None:
            return None, True
        counts: dict[int, tuple[int, int, int]] = {}
        key = found
        for d, bk in zip(reversed(g2), reversed(back)):
            key, choice = bk[key]
            counts[d] = choice
        sa, sm = divmod(found, size)
        v2 = layer[found]
        # the groups' targets: at least what is missing, the one with the most vocabulary
        xa = max(range(max(0, na - sa), na + 1), key=lambda x: (best_a[x], -x))
        xm = max(range(max(0, nm - sm), nm + 1), key=lambda x: (best_m[x], -x))
        assert v2 + best_a[xa] + best_m[xm] >= nv
        for group, backs, x, axis in ((g_a, back_a, xa, 0), (g_m, back_m, xm, 1)):
            for d, bk in zip(reversed(group), reversed(backs)):
                x, q = bk[x]
                c = next(c for c in per[d] if c[axis] == q)
                counts[d] = c
        return [counts[d] for d in bound], True


    def _trim(self, w: list[list[int]]) -> list[list[int]]:
        """Hand back each kind's surplus, always the slowest quantum first (ties: highest rank):
        keep each node's quanta up to the kind's min-bottleneck under the current counts, then
        drop the surplus at that level from the highest ranks. The targets stay met and the rest
        ends up as balanced as this allows."""
        for i, kd in enumerate(self.kinds):
            counts = [x[i] for x in w]
            if sum(counts) == kd.W:
                continue
            level = kd.solve(counts)
            keep = [max(0, min(kd.u(d, level), c)) for d, c in enumerate(counts)]
            surplus = sum(keep) - kd.W
            for d in range(self.n - 1, -1, -1):
                if surplus <= 0:
                    break
                while surplus > 0 and keep[d] > 0 and kd.t(d, keep[d]) == level:
                    keep[d] -= 1
                    surplus -= 1
            assert surplus == 0, "trim: the level's ties do not cover the surplus"
            for d in range(self.n):
                w[d][i] = keep[d]
        return w
