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
   solutions, never invent them. The first incumbent is the integer test at the top corner
   (every node at its most, trimmed); if that fails, a greedy walk up from the separable targets.
   Once a constructive test fails at a lower corner, the bound is settled there and `_polish`
   looks for a better plan above it. Trimming a surplus always drops the slowest quanta first.
   **Lower bound**: the smallest lower-corner sum among boxes still open (none: the optimum),
   the target vectors whose integer test was only constructive, and the incumbent; it is at least
   the separable bound. With the exact test throughout and no box left the plan is proven optimal
   (`optimal`). The search is deterministic (budgeted in box evaluations, not in seconds).
3. *Ideal.* The same search over continuous shares (no integer test: the relaxation is its own
   solution), to `IDEAL_TOL`: the smallest open box's sum is the ideal compute (a lower bound on
   the continuous optimum, which it meets when no cap binds: then each kind is balanced alone).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

from xronos.gateway.costmodel import (
    SEGMENTS, NodeCost, layout_shares, memory_at, predict_memory, segment_times, time_at,
)
from xronos.protocol.layout import KINDS, NOUN, QUANTA, Layout, Sizes

Strategy = Literal["segment", "paper", "uniform"]
STRATEGIES: tuple[str, ...] = ("segment", "paper", "uniform")
MiB = 1024 * 1024
# Box evaluations of the branch and bound; beyond it the plan is the incumbent, with its bound.
DEFAULT_BUDGET = 1000
# The exact integer test gives up (for the constructive one) beyond this many transitions.
EXACT_DP_BUDGET = 300_000
CORNER_DP_BUDGET = 25_000  # the same at a box's upper corner (pruning only: cheaper to give up)
_SUBSETS = ((0, 1), (0, 2), (1, 2), (0, 1, 2))
IDEAL_BUDGET = 400  # box evaluations of the ideal's search (its bound stays valid when cut short)
IDEAL_TOL = 1e-3  # relative width below which the ideal's search stops splitting a box


class InfeasiblePlan(ValueError):
    """No assignment fits every node's memory cap (the message names each node's need and cap)."""


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
class SearchStats:
    """How the `segment` search went (None for the other strategies)."""

    objective_s: float  # sum_seg max_d in the planning model (quanta; >= the layout's bottleneck)
    separable_s: float  # the separable optimum: a lower bound, reached when no cap binds
    coupled: bool  # caps bound, the branch and bound ran
    boxes: int  # box evaluations
    exact_test: bool  # every integer test was the exact dynamic programme
    budget_hit: bool


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
    lower_bound_s: float  # proven lower bound on any quantum plan's compute under the caps
    optimal: bool  # bottleneck proven minimal over quantum plans (segment search closed)
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
        """(planned - lower bound) / lower bound, in the planning model."""
        planned = self.search.objective_s if self.search else self.bottleneck_s
        if self.lower_bound_s <= 0 or not math.isfinite(self.lower_bound_s):
            return 0.0 if planned == self.lower_bound_s else math.inf
        return max(0.0, planned - self.lower_bound_s) / self.lower_bound_s

    def counts(self, kind: str) -> tuple[int, ...]:
        return self.layout.counts(kind)


# --------------------------------------------------------------------------------------------
# The planning model: per kind, per node, closed-form time and memory in quanta.


class _Kind:
    """One kind's planning data: quanta, per-node time coefficients, alone caps."""

    def __init__(self, name: str, sizes: Sizes, nodes: Sequence[NodeCost], quanta: dict[str, int]) -> None:
        self.name = name
        self.q = quanta[name]
        self.total = sizes.total(name)
        self.W = sizes.quanta(name, quanta)
        kcs = [n.kind(name) for n in nodes]
        self.f = [kc.fixed_s for kc in kcs]
        self.c = [kc.fixed_s + kc.icpt_s for kc in kcs]  # time of the first share above 0
        self.b = [kc.slope_s for kc in kcs]
        self.ms = [kc.mem_slope for kc in kcs]
        self.mt = [kc.temp_slope for kc in kcs]
        self.lim = [self.W] * len(nodes)  # alone caps, set by the problem
        self.floor = max(self.f)

    def share(self, w: int) -> float:
        return min(w * self.q, self.total) / self.total

    def t(self, d: int, w: int) -> float:
        """Time of node d holding w quanta (the same arithmetic as costmodel.kind_time)."""
        if w <= 0:
            return self.f[d]
        return self.c[d] + self.b[d] * (min(w * self.q, self.total) / self.total)

    def u(self, d: int, tau: float) -> int:
        """Most quanta (<= alone cap) node d can hold within tau; -1 if not even 0 fits."""
        if tau < self.f[d]:
            return -1
        lim = self.lim[d]
        c, b = self.c[d], self.b[d]
        if lim == 0 or tau < c:
            return 0
        if b == 0 or tau >= c + b:  # share 1 is the slowest a node can be
            return lim
        q, total = self.q, self.total
        w = int((tau - c) / b * total / q)
        w = 0 if w < 0 else (lim if w > lim else w)
        while w < lim and c + b * (min((w + 1) * q, total) / total) <= tau:
            w += 1
        while w > 0 and c + b * (min(w * q, total) / total) > tau:
            w -= 1
        return w

    def top(self) -> float:
        """The largest candidate: every node at its alone cap."""
        return max(self.t(d, l) for d, l in enumerate(self.lim))

    def prev(self, x: float) -> float:
        """Largest candidate value <= x (-inf if none)."""
        best = -math.inf
        for d in range(len(self.f)):
            w = self.u(d, x)
            if w >= 0:
                v = self.t(d, w)
                if v > best:
                    best = v
        return best

    def next_above(self, x: float) -> float:
        """Smallest candidate value > x (inf if none)."""
        best = math.inf
        for d in range(len(self.f)):
            w = self.u(d, x) + 1
            if w <= self.lim[d]:
                v = self.t(d, w)
                if v < best:
                    best = v
        return best

    def solve(self, caps: Sequence[int] | None = None) -> float:
        """Exact min-bottleneck of this kind alone: the smallest candidate tau with
        sum_d min(u_d(tau), caps_d) >= W (caps: the alone caps by default; sum(caps) >= W)."""
        W, n = self.W, len(self.f)
        u = self.u
        if caps is None:
            def cnt(tau: float) -> int:
                return sum(u(d, tau) for d in range(n))

            def uc(d: int, tau: float) -> int:
                return u(d, tau)
            top = self.top()
        else:  # the W-th smallest quantum time under these counts, floors ignored (for trimming)
            def cnt(tau: float) -> int:
                return sum(max(0, min(u(d, tau), c)) for d, c in enumerate(caps))

            def uc(d: int, tau: float) -> int:
                return max(0, min(u(d, tau), caps[d]))
            top = max(self.t(d, c) for d, c in enumerate(caps))
        lo = self.floor if caps is None else min(self.f)
        clo = cnt(lo)
        if clo >= W:
            return lo
        hi = top
        chi = cnt(hi)
        while chi - clo > 2 * n:
            mid = lo + (hi - lo) / 2
            if mid <= lo or mid >= hi:
                break
            c = cnt(mid)
            if c >= W:
                hi, chi = mid, c
            else:
                lo, clo = mid, c
        vals = sorted(self.t(d, w) for d in range(n) for w in range(uc(d, lo) + 1, uc(d, hi) + 1))
        return vals[W - clo - 1]


def _undominated(states: dict[int, int], nm: int) -> dict[int, int]:
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


class _Problem:
    def __init__(self, nodes: Sequence[NodeCost], sizes: Sizes, caps: Sequence[float],
                 quanta: dict[str, int]) -> None:
        self.nodes, self.sizes, self.caps, self.quanta = list(nodes), sizes, list(caps), quanta
        self.n = len(nodes)
        self.kinds = [_Kind(k, sizes, nodes, quanta) for k in KINDS]
        self.base = [nd.mem_repl for nd in nodes]
        self.t0 = [nd.temp_repl for nd in nodes]
        self.const = max(nd.const_s for nd in nodes)
        ka, km, kv = self.kinds
        self._qt = [(kd.q, kd.total) for kd in self.kinds]
        self._row = [(self.base[d], ka.ms[d], km.ms[d], kv.ms[d], ka.mt[d], km.mt[d], kv.mt[d], self.t0[d],
                      self.caps[d]) for d in range(self.n)]
        # Nodes that cannot even hold the replicated layers make every plan infeasible.
        self.short = [d for d in range(self.n) if self.mem(d, (0, 0, 0)) > self.caps[d]]
        if not self.short:
            for i, kd in enumerate(self.kinds):
                kd.lim = [self._alone(d, i) for d in range(self.n)]
        # Relaxation constants: the smallest per-share bytes of each kind, each node's room.
        self.msmin = [min(kd.ms) for kd in self.kinds]
        self.room = [self.caps[d] - self.base[d] - self.t0[d] for d in range(self.n)]
        self._ucache: list[dict[float, list[int]]] = [{}, {}, {}]
        self._vtab: dict[int, list[list[int]]] = {}
        self._icache: dict[tuple, tuple[list[list[int]] | None, bool]] = {}

    # -- memory (the same arithmetic as costmodel.predict_memory) --
    def mem(self, d: int, w: Sequence[int]) -> float:
        (qa, ta), (qm, tm), (qv, tv) = self._qt
        base, ma, mm, mv, xa, xm, xv, t0, _ = self._row[d]
        a, m, v = w
        sa, sm, sv = min(a * qa, ta) / ta, min(m * qm, tm) / tm, min(v * qv, tv) / tv
        part = ma * sa + mm * sm + mv * sv
        temp = max(t0, xa * sa, xm * sm, xv * sv)
        return base + part + temp

    def fits(self, d: int, w: Sequence[int]) -> bool:
        return self.mem(d, w) <= self._row[d][8]

    def _alone(self, d: int, i: int) -> int:
        """Most quanta of kind i node d fits holding nothing of the other kinds."""
        lo, hi = 0, self.kinds[i].W  # fits(lo) holds
        w = [0, 0, 0]

        def ok(x: int) -> bool:
            w[i] = x
            return self.fits(d, w)

        if ok(hi):
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        return lo

    def U(self, i: int, tau: float) -> list[int]:
        cache = self._ucache[i]
        got = cache.get(tau)
        if got is None:
            kd = self.kinds[i]
            got = cache[tau] = [kd.u(d, tau) for d in range(self.n)]
        return got

    def targets(self, w: Sequence[Sequence[int]]) -> tuple[float, ...]:
        """Per-kind bottleneck of counts w[d][kind index]."""
        return tuple(max(kd.t(d, w[d][i]) for d in range(self.n)) for i, kd in enumerate(self.kinds))

    def objective(self, w: Sequence[Sequence[int]]) -> float:
        """sum_seg max_d T_d,seg for counts w[d][kind index], in quanta (planning model)."""
        return sum(max(kd.t(d, w[d][i]) for d in range(self.n)) for i, kd in enumerate(self.kinds)) + self.const

    # -- relaxed feasibility of a target vector (Hall's condition of the transportation problem) --
    def relaxed(self, tau: Sequence[float]) -> tuple[int, ...] | None:
        """None if the target vector passes the relaxed test, else the first violated subset."""
        Us = [self.U(i, tau[i]) for i in range(3)]
        for i in range(3):
            if not self._single(Us, i):
                return (i,)
        xs = self._bytes(Us)
        for S in _SUBSETS:
            if not self._joint(xs, S):
                return S
        return None

    def holds(self, tau: Sequence[float], S: tuple[int, ...]) -> bool:
        """Whether the relaxed condition of subset S alone holds at tau."""
        Us = [self.U(i, tau[i]) for i in range(3)]
        if len(S) == 1:
            return self._single(Us, S[0])
        if not all(self._single(Us, i) for i in S):
            return False
        return self._joint(self._bytes(Us), S)

    def _single(self, Us: list[list[int]], i: int) -> bool:
        U = Us[i]
        return min(U) >= 0 and sum(U) >= self.kinds[i].W

    def _bytes(self, Us: list[list[int]]) -> list[list[float]]:
        return [[m * kd.share(x) for x in U] for m, kd, U in zip(self.msmin, self.kinds, Us)]

    def _joint(self, xs: list[list[float]], S: tuple[int, ...]) -> bool:
        need = sum(self.msmin[i] for i in S)
        if len(S) == 2:
            have = sum(map(min, self.room, map(float.__add__, xs[S[0]], xs[S[1]])))
        else:
            have = sum(map(min, self.room, map(lambda x, y, z: x + y + z, *xs)))
        return have >= need * (1 - 1e-12)

    # -- integer feasibility at a target vector --
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
            uv = ub[d][2]
            ch: dict[int, int] = {}
            for a, m, v in self._choices(d, ub[d][0], ub[d][1]):
                a, m, v = min(a, na), min(m, nm), min(v, uv)
                k = a * size + m
                if v > ch.get(k, -1):
                    ch[k] = v
            per[d] = [(k // size, k % size, v) for k, v in _undominated(ch, nm).items()]
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
            layer = _undominated(nxt, nm)
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
        room = self.caps[d] - self.base[d] - rest
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
            kd, rest = self.kinds[i], order[pos + 1:]
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
                flow = _maxflow([need[k] * per[k] for k in todo],
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


def _maxflow(supply: list[float], cap: list[list[float]], room: list[float]) -> list[list[float]]:
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


# --------------------------------------------------------------------------------------------
# Branch and bound over target vectors (monotonic optimisation).


@dataclass
class _Search:
    """Best-first search over boxes [lo, hi] of target vectors."""

    prev: list[Callable[[float], float]]  # largest candidate <= x
    next_above: list[Callable[[float], float]]  # smallest candidate > x (continuous: x itself +)
    relaxed: Callable[[Sequence[float]], tuple[int, ...] | None]
    point: Callable[[Sequence[float]], tuple[object | None, bool]]  # (solution, exact)
    budget: int
    corner: Callable[[Sequence[float]], tuple[object | None, bool]] | None = None  # exact-only test
    targets: Callable[[object], tuple[float, ...]] = tuple  # a solution's per-kind bottlenecks
    tol: float = 0.0  # relative: boxes whose width sum is below tol * lower sum are not split
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
                    # to do is finding a good plan above it (`_polish`).
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
                self.unresolved = min(self.unresolved, lb)
                continue
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


def _walk(pb: _Problem, lo: Sequence[float], top: Sequence[float], steps: int = 300
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

            if pb.integer(lift(1.0))[0] is None:
                return None
            lo_t, hi_t = 0.0, 1.0
            for _ in range(14):
                mid = (lo_t + hi_t) / 2
                lo_t, hi_t = (lo_t, mid) if pb.integer(lift(mid))[0] is not None else (mid, hi_t)
            tau = lift(hi_t)
            continue
        moves = []
        for k in bad:
            if pb.holds(_with(tau, k, top[k]), bad):
                x = _bisect_up(lambda v, k=k: pb.holds(_with(tau, k, v), bad), tau[k], top[k], prev[k], nxt[k])
                moves.append((x - tau[k], _with(tau, k, x)))
        if len(bad) > 1:

            def at(t: float) -> list[float]:
                return [max(tau[k], prev[k](tau[k] + t * (top[k] - tau[k]))) if k in bad else tau[k]
                        for k in range(3)]

            if pb.holds(at(1.0), bad):
                lo_t, hi_t = 0.0, 1.0
                for _ in range(50):
                    mid = (lo_t + hi_t) / 2
                    lo_t, hi_t = (lo_t, mid) if pb.holds(at(mid), bad) else (mid, hi_t)
                cand = at(hi_t)
                moves.append((sum(cand) - sum(tau), cand))
        if not moves:
            return None
        tau = list(min(moves, key=lambda m: m[0])[1])
    return None


def _with(tau: Sequence[float], k: int, v: float) -> list[float]:
    out = list(tau)
    out[k] = v
    return out


def _bisect_up(ok: Callable[[float], bool], lo: float, hi: float, prev: Callable[[float], float],
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


def _segment(pb: _Problem, budget: int) -> tuple[list[list[int]], SearchStats, float]:
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
        raise _infeasible(pb, "even with every node at its most, the kinds do not fit the memory together")
    search = _Search(prev, nxt, pb.relaxed, pb.integer, budget,
                     corner=lambda tau: pb.integer(tau, exact_only=True), targets=pb.targets)
    # The first incumbent: the integer test at the top corner (every node at its most, trimmed
    # from the slowest down); failing that, a greedy walk up from the separable targets.
    sol, exact = pb.integer(top, quick=True)
    if sol is not None:
        search.offer(pb.targets(sol), sol)
    elif exact:
        raise _infeasible(pb, "no integer split of the quanta fits the memory caps even with every "
                              "node at its most")
    else:
        first = _walk(pb, lo, top)
        if first is not None:
            search.offer(first[0], first[1])
    search.run(lo, top)
    if search.best is None:
        sol, exact = pb.integer(top)
        if sol is None:
            raise _infeasible(pb, "no integer split of the quanta fits the memory caps (only a fractional "
                                  "one would: the caps are too tight for the quantum)" if exact else
                                  "the search found no integer split of the quanta within its budget")
        search.offer(top, sol)
    if search.stop_at is not None or search.budget_hit:
        start = search.stop_at or lo
        _polish(pb, search, start)
    w = search.best  # type: ignore[assignment]
    obj = pb.objective(w)
    lower = min(search.lower + pb.const, obj)
    stats = SearchStats(obj, sep, True, search.boxes, search.exact, search.budget_hit)
    return w, stats, max(lower, sep)


def _polish(pb: _Problem, search: _Search, start: Sequence[float], rounds: int = 3) -> None:
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
                return pb.integer(_with(tau, k, v))[0] is not None

            v = low if ok(low) else _bisect_up(ok, low, tau[k], kinds[k].prev, kinds[k].next_above)
            if v < tau[k]:
                sol, _ = pb.integer(_with(tau, k, v))
                if sol is not None:
                    tau[k] = v
                    search.offer(pb.targets(sol), sol)
                    moved = True
        if not moved:
            break


def _uniform(pb: _Problem) -> list[list[int]]:
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


# --------------------------------------------------------------------------------------------
# The ideal: continuous shares per kind, every segment balanced, under the same caps.


class _Cont:
    """One kind with continuous shares (the ideal's relaxation)."""

    def __init__(self, kd: _Kind, pb: _Problem, i: int) -> None:
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

    def s(self, d: int, tau: float) -> float:
        kd = self.kd
        if tau < kd.f[d]:
            return -1.0
        if tau < kd.c[d]:
            return 0.0
        if kd.b[d] == 0:
            return self.smax[d]
        return min(self.smax[d], (tau - kd.c[d]) / kd.b[d])

    def total(self, tau: float) -> float:
        return sum(self.s(d, tau) for d in range(self.n))

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


def ideal_compute(nodes: Sequence[NodeCost], sizes: Sizes, caps: Sequence[float],
                  quanta: dict[str, int] = QUANTA, budget: int = DEFAULT_BUDGET) -> float:
    """Lower bound on any plan's compute: continuous shares per kind, each segment balanced, under
    the caps (relaxed as in the search: smallest per-share bytes, replicated temporaries); inf when
    not even that places the model."""
    pb = _Problem(nodes, sizes, caps, quanta)
    return _ideal(pb, budget)


def _ideal(pb: _Problem, budget: int, ub: float = math.inf) -> float:
    """The continuous relaxation's bound; `ub` (a known plan's compute) prunes its search."""
    if pb.short:
        return math.inf
    conts = [_Cont(kd, pb, i) for i, kd in enumerate(pb.kinds)]
    lo = [c.solve() for c in conts]
    if not all(math.isfinite(x) for x in lo):
        return math.inf
    room = pb.room

    def relaxed(tau: Sequence[float]) -> tuple[int, ...] | None:
        ss = []
        for i, c in enumerate(conts):
            v = c.vec(tau[i])
            if min(v) < 0 or sum(v) < 1 - 1e-12:
                return (i,)
            m = pb.msmin[i]
            ss.append([m * x for x in v])
        a, b, c = ss
        for S, xs in (((0, 1), map(float.__add__, a, b)), ((0, 2), map(float.__add__, a, c)),
                      ((1, 2), map(float.__add__, b, c)), ((0, 1, 2), map(lambda x, y, z: x + y + z, a, b, c))):
            need = sum(pb.msmin[i] for i in S)
            if sum(map(min, room, xs)) < need * (1 - 1e-12):
                return S
        return None

    # The separable shares fit together: balanced per kind is then the continuous optimum.
    if relaxed(lo) is None and _cont_fits(pb, conts, lo):
        return sum(lo) + pb.const
    top = [c.top() for c in conts]
    if relaxed(top) is not None:
        return math.inf
    ident = [lambda x: x] * 3
    up = [lambda x: math.nextafter(x, math.inf)] * 3
    search = _Search(ident, up, relaxed, lambda tau: (True, True), budget, tol=IDEAL_TOL)
    search.ub = ub - pb.const
    search.run(lo, top)
    return min(search.lower + pb.const, ub)


def _cont_fits(pb: _Problem, conts: list[_Cont], tau: Sequence[float]) -> bool:
    """Whether the balanced shares at tau, trimmed proportionally to sum to 1, fit every node."""
    shares = []
    for i, c in enumerate(conts):
        v = [c.s(d, tau[i]) for d in range(pb.n)]
        tot = sum(v)
        shares.append([x / tot for x in v])
    for d in range(pb.n):
        sh = {k: shares[i][d] for i, k in enumerate(KINDS)}
        if predict_memory(pb.nodes[d], sh) > pb.caps[d] * (1 + 1e-12):
            return False
    return True


# --------------------------------------------------------------------------------------------


def _infeasible(pb: _Problem, why: str) -> InfeasiblePlan:
    lines = []
    even = [max(1, -(-kd.W // pb.n)) for kd in pb.kinds]
    for d, nd in enumerate(pb.nodes):
        per = []
        for i, kd in enumerate(pb.kinds):
            per.append(f"{kd.name} {kd.ms[d] * kd.share(even[i]) / MiB:.1f}")
        sh = {k: pb.kinds[i].share(even[i]) for i, k in enumerate(KINDS)}
        need = predict_memory(nd, sh)
        if pb.short and d in pb.short:
            alone = "fits not even the replicated layers"
        else:
            alone = "alone fits at most " + ", ".join(
                f"{min(kd.total, kd.lim[d] * kd.q)} of {kd.total} {NOUN[kd.name]}" for kd in pb.kinds)
        lines.append(f"  {nd.node_id}: cap {pb.caps[d] / MiB:.1f} MiB; replicated {pb.base[d] / MiB:.1f} MiB; "
                     f"at the even share needs {need / MiB:.1f} MiB ({', '.join(per)} MiB); {alone}")
    return InfeasiblePlan(f"no plan fits the memory caps ({why}):\n" + "\n".join(lines))


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
        values = {"const_s": n.const_s, "mem_repl": n.mem_repl, "temp_repl": n.temp_repl}
        for k in KINDS:
            kc = n.kind(k)
            for f in ("fixed_s", "icpt_s", "slope_s", "mem_slope", "temp_slope"):
                values[f"{k}.{f}"] = getattr(kc, f)
        for f, v in values.items():
            if not (v >= 0 and math.isfinite(v)):  # monotone costs are what make the search exact
                raise ValueError(f"node {n.node_id}: {f} must be finite and >= 0, got {v}")
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
    pb = _Problem(nodes, sizes, caps, quanta)
    stats, lower = None, None
    if strategy == "uniform":
        q = _uniform(pb)
        layout = Layout.from_quanta([x[0] for x in q], [x[1] for x in q], [x[2] for x in q], sizes, quanta)
    elif strategy == "paper":
        if pb.short:
            raise _infeasible(pb, f"nodes {[nodes[d].node_id for d in pb.short]} cannot even hold the "
                                  f"replicated layers")
        units = _paper(nodes, sizes.attn, caps)
        if units is None:
            raise _infeasible(pb, "the paper's head-tied greedy ran out of nodes with memory for "
                                  "another unit")
        layout = Layout.tied(units, sizes, quanta)
    else:
        if pb.short:
            raise _infeasible(pb, f"nodes {[nodes[d].node_id for d in pb.short]} cannot even hold the "
                                  f"replicated layers")
        for kd in pb.kinds:
            if sum(kd.lim) < kd.W:
                room = min(kd.total, sum(kd.lim) * kd.q)
                raise _infeasible(pb, f"{kd.name}: even holding nothing else, the nodes fit {room} of the "
                                      f"{kd.total} {NOUN[kd.name]}")
        q, stats, lower = _segment(pb, budget)
        layout = Layout.from_quanta([x[0] for x in q], [x[1] for x in q], [x[2] for x in q], sizes, quanta)
    ideal = _ideal(pb, IDEAL_BUDGET)  # the same for every strategy
    return _result(strategy, pb, layout, comm_s, ideal, lower, stats)


def _result(strategy: str, pb: _Problem, layout: Layout, comm_s: float, ideal: float,
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
    if lower is None:
        lower = ideal
    optimal = bool(stats is not None and stats.exact_test and not stats.budget_hit and lower >= stats.objective_s)
    return PlanResult(
        strategy=strategy, sizes=pb.sizes, layout=layout, rows=tuple(rows), segment_s=seg_max,
        bottleneck_s=bottleneck, comm_s=comm_s, predicted_iteration_s=bottleneck + comm_s,
        ideal_compute_s=ideal, ideal_iteration_s=ideal + comm_s, lower_bound_s=lower, optimal=optimal,
        feasible=not any(r.over_cap for r in rows), search=stats,
    )
