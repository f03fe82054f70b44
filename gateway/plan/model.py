"""The `segment` planner's model (`xronos.gateway.plan.planner` explains the algorithm): per kind and
node, time and memory in closed form over quanta (`KindModel`), and a target vector's feasibility
tests (`Problem`): the relaxed one here (a transportation problem over the kinds' bytes, by its
subset conditions) and the integer one in `integer` (an exact dynamic programme over the
memory-bound nodes, or a constructive fallback that can only miss solutions). Pure: no I/O.
"""

from __future__ import annotations

import math
from typing import Sequence

from xronos.gateway.plan.costmodel import NodeCost
from xronos.gateway.plan.memorymodel import holes_at_work, owner_peak, predict_memory
from xronos.gateway.plan.integer import IntegerTest
from xronos.protocol.layout import KINDS, NOUN, Sizes


MiB = 1024 * 1024
SUBSETS = ((0, 1), (0, 2), (1, 2), (0, 1, 2))


class InfeasiblePlan(ValueError):
    """No assignment fits every node's memory cap (the message names each node's need and cap)."""


def _most(f: float, c: float, b: float, lim: int, q: int, total: int, tau: float) -> int:
    """Most quanta (<= lim) within tau of a node whose time is f at 0 and c + b * share above."""
    if tau < f:
        return -1
    if lim == 0 or tau < c:
        return 0
    if b == 0 or tau >= c + b:  # share 1 is the slowest a node can be
        return lim
    w = int((tau - c) / b * total / q)
    w = 0 if w < 0 else (lim if w > lim else w)
    while w < lim and c + b * (min((w + 1) * q, total) / total) <= tau:
        w += 1
    while w > 0 and c + b * (min(w * q, total) / total) > tau:
        w -= 1
    return w


class KindModel:
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
        # M_w alone (weights, gradients, moments): with the activations' part apart, the linear
        # memory the relaxations and room estimates use is a lower bound of memorymodel.predict_memory
        # (which adds max(0, A - G), see Problem.mem), so the bounds stay bounds.
        self.ms = [kc.mem_slope - kc.act_slope for kc in kcs]
        self.mt = [kc.temp_slope for kc in kcs]
        self.lim = [self.W] * len(nodes)  # alone caps, set by the problem
        self.floor = max(self.f)
        self._us: dict[float, list[int]] = {}

    def share(self, w: int) -> float:
        return min(w * self.q, self.total) / self.total

    def t(self, d: int, w: int) -> float:
        """Time of node d holding w quanta (the same arithmetic as costmodel.kind_time)."""
        if w <= 0:
            return self.f[d]
        return self.c[d] + self.b[d] * (min(w * self.q, self.total) / self.total)

    def u(self, d: int, tau: float) -> int:
        """Most quanta (<= alone cap) node d can hold within tau; -1 if not even 0 fits."""
        return _most(self.f[d], self.c[d], self.b[d], self.lim[d], self.q, self.total, tau)

    def us(self, tau: float) -> list[int]:
        """u(d, tau) for every node (memoised: the searches ask for the same targets again)."""
        got = self._us.get(tau)
        if got is None:
            q, total = self.q, self.total
            got = self._us[tau] = [_most(f, c, b, lim, q, total, tau)
                                   for f, c, b, lim in zip(self.f, self.c, self.b, self.lim)]
        return got

    def top(self) -> float:
        """The largest candidate: every node at its alone cap."""
        return max(self.t(d, l) for d, l in enumerate(self.lim))

    def prev(self, x: float) -> float:
        """Largest candidate value <= x (-inf if none)."""
        best = -math.inf
        q, total = self.q, self.total
        for w, c, b, f in zip(self.us(x), self.c, self.b, self.f):
            if w >= 0:
                v = f if w == 0 else c + b * (min(w * q, total) / total)
                if v > best:
                    best = v
        return best

    def next_above(self, x: float) -> float:
        """Smallest candidate value > x (inf if none)."""
        best = math.inf
        q, total = self.q, self.total
        for w, c, b, f, lim in zip(self.us(x), self.c, self.b, self.f, self.lim):
            if w < lim:
                v = f if w < 0 else c + b * (min((w + 1) * q, total) / total)
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
                return sum(self.us(tau))

            def uc(d: int, tau: float) -> int:
                return u(d, tau)
            top = self.top()
        else:  # the W-th smallest quantum time under these counts, floors ignored (for trimming)
            def cnt(tau: float) -> int:
                return sum(max(0, min(x, c)) for x, c in zip(self.us(tau), caps))

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


class Problem(IntegerTest):
    def __init__(self, nodes: Sequence[NodeCost], sizes: Sizes, caps: Sequence[float],
                 quanta: dict[str, int]) -> None:
        self.nodes, self.sizes, self.caps, self.quanta = list(nodes), sizes, list(caps), quanta
        self.n = len(nodes)
        self.kinds = [KindModel(k, sizes, nodes, quanta) for k in KINDS]
        self.base = [nd.mem_runtime + nd.mem_repl - nd.act_repl for nd in nodes]
        # loading's largest buffer: replicated, then per kind at share 1 (a max, like M_t)
        self.load = [(nd.load_repl, *(nd.kind(k).load_slope for k in KINDS)) for nd in nodes]
        self.t0 = [nd.temp_repl for nd in nodes]
        self.const = max(nd.const_s for nd in nodes)
        ka, km, kv = self.kinds
        self._qt = [(kd.q, kd.total) for kd in self.kinds]
        self._row = [(self.base[d], ka.ms[d], km.ms[d], kv.ms[d], ka.mt[d], km.mt[d], kv.mt[d], self.t0[d],
                      self.caps[d]) for d in range(self.n)]
        # the heap holes' transient bytes W(s) = work_repl + work_slope x share of each HOLE_KINDS
        # kind (attention and MLP: memorymodel.heap_slack)
        self._work = [(nd.work_repl, nd.attn.work_slope, nd.mlp.work_slope) for nd in nodes]
        # (repl, attn, mlp, vocab) coefficients of the activations A, and of A - G
        self._ag = [((nd.act_repl, *(nd.kind(k).act_slope for k in KINDS)),  # A's, then A - G's
                     (nd.act_repl - nd.grad_repl, *(nd.kind(k).act_slope - nd.kind(k).grad_slope for k in KINDS)))
                    for nd in nodes]
        # Nodes that cannot even hold the replicated layers make every plan infeasible.
        self.short = [d for d in range(self.n) if self.mem(d, (0, 0, 0)) > self.caps[d]]
        if not self.short:
            for i, kd in enumerate(self.kinds):
                kd.lim = [self._alone(d, i) for d in range(self.n)]
                kd._us.clear()  # computed under the old caps
        # Relaxation constants: the smallest per-share bytes of each kind, each node's room.
        self.msmin = [min(kd.ms) for kd in self.kinds]
        self.room = [self.caps[d] - self.base[d] - self.t0[d] for d in range(self.n)]
        self._vtab: dict[int, list[list[int]]] = {}
        self._pcache: dict[tuple[int, ...], list[tuple[int, int, int]]] = {}
        self._xcache: list[dict[float, list[float] | None]] = [{}, {}, {}]
        self._icache: dict[tuple, tuple[list[list[int]] | None, bool]] = {}

    # -- memory (the same arithmetic as memorymodel.predict_memory) --
    def mem(self, d: int, w: Sequence[int]) -> float:
        (qa, ta), (qm, tm), (qv, tv) = self._qt
        base, ma, mm, mv, xa, xm, xv, t0, _ = self._row[d]
        a, m, v = w
        sa, sm, sv = min(a * qa, ta) / ta, min(m * qm, tm) / tm, min(v * qv, tv) / tv
        part = ma * sa + mm * sm + mv * sv
        (a0, aa, am, av), (e0, ea, em, ev) = self._ag[d]
        excess = e0 + ea * sa + em * sm + ev * sv  # A - G
        temp = max(t0, xa * sa, xm * sm, xv * sv)
        l0, la, lm, lv = self.load[d]
        nd = self.nodes[d]
        w0, wa, wm = self._work[d]
        # base + part + A - min(A, G): predict_memory's model term
        train = (base + part + (excess if excess > 0.0 else 0.0) + temp
                 + max(l0, la * sa, lm * sm, lv * sv, holes_at_work(nd, w0 + wa * sa + wm * sm)))
        if not nd.owner:
            return train
        acts = a0 + aa * sa + am * sm + av * sv
        return owner_peak(nd, nd.mem_repl - a0 + part + acts, train, {"attn": sa, "mlp": sm, "vocab": sv})

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
        return self.kinds[i].us(tau)

    def targets(self, w: Sequence[Sequence[int]]) -> tuple[float, ...]:
        """Per-kind bottleneck of counts w[d][kind index]."""
        return tuple(max(kd.t(d, w[d][i]) for d in range(self.n)) for i, kd in enumerate(self.kinds))

    def objective(self, w: Sequence[Sequence[int]]) -> float:
        """sum_seg max_d T_d,seg for counts w[d][kind index], in quanta (planning model)."""
        return sum(max(kd.t(d, w[d][i]) for d in range(self.n)) for i, kd in enumerate(self.kinds)) + self.const

    # -- relaxed feasibility of a target vector (Hall's condition of the transportation problem) --
    def relaxed(self, tau: Sequence[float]) -> tuple[int, ...] | None:
        """None if the target vector passes the relaxed test, else the first violated subset."""
        at = [self._at(i, tau[i]) for i in range(3)]
        for i in range(3):
            if at[i] is None:
                return (i,)
        for S in SUBSETS:
            if not self._joint(at, S):  # type: ignore[arg-type]
                return S
        return None

    def holds(self, tau: Sequence[float], S: tuple[int, ...]) -> bool:
        """Whether the relaxed condition of subset S alone holds at tau."""
        at = [self._at(i, tau[i]) if i in S else None for i in range(3)]
        if any(at[i] is None for i in S):
            return False
        return len(S) == 1 or self._joint(at, S)  # type: ignore[arg-type]

    def _at(self, i: int, tau: float) -> list[float] | None:
        """Kind i alone at target tau: None if its nodes cannot cover it within tau, else each
        node's bytes of it at the kind's smallest per-share bytes (memoised per target)."""
        cache = self._xcache[i]
        if tau in cache:
            return cache[tau]
        kd = self.kinds[i]
        U = kd.us(tau)
        xs = None
        if min(U) >= 0 and sum(U) >= kd.W:
            m, q, total = self.msmin[i], kd.q, kd.total
            xs = [m * (min(x * q, total) / total) for x in U]
        cache[tau] = xs
        return xs

    def _joint(self, xs: list[list[float]], S: tuple[int, ...]) -> bool:
        need = sum(self.msmin[i] for i in S)
        if len(S) == 2:
            have = sum(map(min, self.room, map(float.__add__, xs[S[0]], xs[S[1]])))
        else:
            have = sum(map(min, self.room, map(lambda x, y, z: x + y + z, *xs)))
        return have >= need * (1 - 1e-12)

def infeasible(pb: Problem, why: str) -> InfeasiblePlan:
    lines = []
    even = [max(1, -(-kd.W // pb.n)) for kd in pb.kinds]
    for d, nd in enumerate(pb.nodes):
        per = []
        for i, kd in enumerate(pb.kinds):
            per.append(f"{kd.name} {kd.ms[d] * kd.share(even[i]) / MiB:.1f}")
        sh = {k: pb.kinds[i].share(even[i]) for i, k in enumerate(KINDS)}
        need = predict_memory(nd, sh)
        if pb.short and d in pb.short:  # the owner's runtime, data stack and export gather count too
            alone = (f"holding nothing it already needs {pb.mem(d, (0, 0, 0)) / MiB:.1f} MiB"
                     + (" (rank 0, the owner: with its data stack and the export's gather)" if nd.owner else ""))
        else:
            alone = "alone fits at most " + ", ".join(
                f"{min(kd.total, kd.lim[d] * kd.q)} of {kd.total} {NOUN[kd.name]}" for kd in pb.kinds)
        lines.append(f"  {nd.node_id}: cap {pb.caps[d] / MiB:.1f} MiB; replicated {pb.base[d] / MiB:.1f} MiB; "
                     f"at the even share needs {need / MiB:.1f} MiB ({', '.join(per)} MiB); {alone}")
    return InfeasiblePlan(f"no plan fits the memory caps ({why}):\n" + "\n".join(lines))
