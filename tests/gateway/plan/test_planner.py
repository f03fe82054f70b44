"""Planner: `segment` == exhaustive search over every per-kind split (binding caps included), the
proven lower bound, `paper` == the head-tied optimum, `uniform`, infeasibility, bad input."""

from dataclasses import replace
import itertools
import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from xronos.gateway.plan import integer as PI
from xronos.gateway.plan import model as PM
from xronos.gateway.plan.costmodel import KindCost, NodeCost, time_at
from xronos.gateway.plan.memorymodel import memory_at, predict_memory
from xronos.gateway.plan.planner import MiB, InfeasiblePlan, ideal_compute, plan
from xronos.protocol.layout import KINDS, Layout, Sizes

Q = {"attn": 1, "mlp": 2, "vocab": 3}  # small quanta keep exhaustive search small


def kc(fixed=0.0, icpt=0.0, slope=1.0, mem=0.0, temp=0.0):
    return KindCost(fixed, icpt, slope, mem, temp)


def node(i, attn=None, mlp=None, vocab=None, const=0.0, mem_repl=0.0, temp_repl=0.0):
    return NodeCost(f"n{i}", attn or kc(), mlp or kc(), vocab or kc(), const, mem_repl, temp_repl)


def compositions(W, N):
    """Every way to write W as an ordered sum of N non-negative integers."""
    for bars in itertools.combinations(range(W + N - 1), N - 1):
        edges = (-1, *bars, W + N - 1)
        yield [b - a - 1 for a, b in zip(edges, edges[1:])]


def brute_force(nodes, sizes, caps, quanta=Q):
    """Min over every per-kind split (in quanta) of sum_seg max_d T, under every node's cap."""
    pb = PM.Problem(nodes, sizes, caps, quanta)
    N = len(nodes)
    splits = [list(compositions(kd.W, N)) for kd in pb.kinds]
    best = math.inf
    for a in splits[0]:
        for m in splits[1]:
            if not all(pb.fits(d, (a[d], m[d], 0)) for d in range(N)):
                continue
            for v in splits[2]:
                w = [(a[d], m[d], v[d]) for d in range(N)]
                if all(pb.fits(d, w[d]) for d in range(N)):
                    best = min(best, pb.objective(w))
    return best


def random_kind(rng):
    return kc(rng.uniform(0, 0.3), rng.choice([0.0, rng.uniform(0, 0.3)]),
              rng.choice([0.0, rng.uniform(0.1, 5.0)]), rng.uniform(0, 300), rng.choice([0.0, rng.uniform(0, 200)]))


def random_instance(rng):
    N = rng.randint(1, 4)
    sizes = Sizes(attn=rng.randint(1, 4), mlp=rng.randint(1, 8), vocab=rng.randint(1, 9))
    nodes = [node(d, random_kind(rng), random_kind(rng), random_kind(rng), rng.uniform(0, 0.2),
                  rng.uniform(0, 100), rng.uniform(0, 50)) for d in range(N)]
    caps = [rng.uniform(100, 100 + 1000 / N) for _ in range(N)]  # from infeasible to loose
    return nodes, sizes, caps


def check_against_exhaustive(nodes, sizes, caps) -> str:
    """`segment` on one instance against brute force: its outcome (infeasible, coupled, separable)."""
    best = brute_force(nodes, sizes, caps)
    if best == math.inf:
        with pytest.raises(InfeasiblePlan):
            plan(nodes, sizes, "segment", caps, quanta=Q)
        return "infeasible"
    res = plan(nodes, sizes, "segment", caps, quanta=Q)
    assert res.search.objective_s == pytest.approx(best, rel=1e-12, abs=1e-15)
    assert res.optimal
    # the bound is on the layout's real compute: the model counts a remainder quantum as whole
    assert res.lower_bound_s <= res.bottleneck_s * (1 + 1e-12) + 1e-15
    if all(sizes.total(k) % Q[k] == 0 for k in Q):
        assert res.lower_bound_s == pytest.approx(best, rel=1e-12, abs=1e-15) and res.gap == pytest.approx(0, abs=1e-12)
    assert res.search.separable_s <= best * (1 + 1e-12) + 1e-15  # a lower bound
    assert res.ideal_compute_s <= best * (1 + 1e-9) + 1e-15  # the continuous relaxation too
    assert res.feasible and all(r.predicted_memory <= r.memory_cap for r in res.rows)
    res.layout.check(sizes, world_size=len(nodes), quanta=Q)
    assert res.bottleneck_s <= res.search.objective_s + 1e-12  # the remainder only helps
    return "coupled" if res.search.coupled else "separable"


def test_segment_equals_exhaustive_search_on_random_instances():
    rng = random.Random(1234)
    seen = {"infeasible": 0, "coupled": 0, "separable": 0}
    for _ in range(250):
        seen[check_against_exhaustive(*random_instance(rng))] += 1
    # The generator exercises every outcome, binding caps (coupled search) included.
    assert min(seen.values()) >= 40, seen


def with_activations(rng, nd):
    """`nd` with part of each memory term its activations and part its gradients (never both
    resident: memorymodel.not_coexisting), in random proportions, so A > G on some and A < G on others."""
    def split(kc_):
        act = rng.uniform(0, kc_.mem_slope)
        return replace(kc_, act_slope=act, grad_slope=rng.uniform(0, kc_.mem_slope - act))
    act = rng.uniform(0, nd.mem_repl)
    return replace(nd, attn=split(nd.attn), mlp=split(nd.mlp), vocab=split(nd.vocab), act_repl=act,
                   grad_repl=rng.uniform(0, nd.mem_repl - act))


def test_segment_equals_exhaustive_search_with_activations_apart_from_gradients():
    """The memory is then S + max(A, G): not linear per kind; the planner's linear part is only a
    lower bound of it, and its exact test must still match the exhaustive search."""
    from xronos.gateway.plan.memorymodel import predict_memory

    rng = random.Random(4321)
    seen = {"infeasible": 0, "coupled": 0, "separable": 0}
    for _ in range(150):
        nodes, sizes, caps = random_instance(rng)
        nodes = [with_activations(rng, nd) for nd in nodes]
        pb = PM.Problem(nodes, sizes, caps, Q)
        for d, nd in enumerate(nodes):
            w = tuple(rng.randint(0, kd.W) for kd in pb.kinds)
            sh = {k: pb.kinds[i].share(w[i]) for i, k in enumerate(KINDS)}
            assert pb.mem(d, w) == pytest.approx(predict_memory(nd, sh), rel=1e-12)
        seen[check_against_exhaustive(nodes, sizes, caps)] += 1
    assert min(seen.values()) >= 20, seen


def test_constructive_test_never_invents_a_plan(monkeypatch):
    """Without the exact dynamic programme the search is still sound: every plan fits, no plan
    beats the optimum, and the lower bound stays below it."""
    monkeypatch.setattr(PI, "EXACT_DP_BUDGET", -1)
    rng = random.Random(99)
    exact = planned = 0
    for _ in range(150):
        nodes, sizes, caps = random_instance(rng)
        best = brute_force(nodes, sizes, caps)
        try:
            res = plan(nodes, sizes, "segment", caps, quanta=Q)
        except InfeasiblePlan:
            continue  # may miss a tight plan, never invent one
        assert best < math.inf
        planned += 1
        assert res.feasible
        assert res.search.objective_s >= best * (1 - 1e-12) - 1e-15
        assert res.lower_bound_s <= best * (1 + 1e-12) + 1e-15
        exact += res.search.objective_s <= best * (1 + 1e-12) + 1e-15
    # On these tiny instances (a quantum is up to half a kind) rounding is at its worst; still it
    # mostly finds the optimum.
    assert planned >= 70 and exact >= 0.75 * planned, (exact, planned)


def test_separable_when_no_cap_binds():
    """Loose caps: each kind is its own exact min-bottleneck, found without the coupled search."""
    rng = random.Random(7)
    for _ in range(40):
        nodes, sizes, _ = random_instance(rng)
        caps = [1e12] * len(nodes)
        res = plan(nodes, sizes, "segment", caps, quanta=Q)
        assert not res.search.coupled and res.optimal
        assert res.search.objective_s == pytest.approx(brute_force(nodes, sizes, caps), rel=1e-12, abs=1e-15)


def test_each_kind_follows_its_own_speed():
    # n0 is fast at attention and slow at the MLP, n1 the other way round: the splits go opposite.
    nodes = [node(0, attn=kc(slope=1.0), mlp=kc(slope=4.0)), node(1, attn=kc(slope=4.0), mlp=kc(slope=1.0))]
    res = plan(nodes, Sizes(attn=10, mlp=320, vocab=64), "segment", [1e12, 1e12])
    assert res.layout.attn == (8, 2) and res.layout.mlp == (64, 256)
    assert res.segment_s["attn"] == pytest.approx(0.8) and res.segment_s["mlp"] == pytest.approx(0.8)
    # The paper's tied unit cannot do both: its bottleneck sum is worse.
    paper = plan(nodes, Sizes(attn=10, mlp=320, vocab=64), "paper", [1e12, 1e12])
    assert paper.bottleneck_s > res.bottleneck_s


def test_memory_coupling_sends_each_kind_where_it_fits():
    # Both nodes equally fast; n0 has room for its even share of the attention or of the MLP,
    # not both.
    big = dict(attn=kc(slope=1.0, mem=100), mlp=kc(slope=1.0, mem=100), vocab=kc(slope=0.1, mem=0))
    nodes = [node(0, **big), node(1, **big)]
    sizes = Sizes(attn=4, mlp=4, vocab=4)
    loose = plan(nodes, sizes, "segment", [1e9, 1e9], quanta={"attn": 1, "mlp": 1, "vocab": 1})
    assert loose.layout.attn == (2, 2) and loose.layout.mlp == (2, 2)
    tight = plan(nodes, sizes, "segment", [60.0, 1e9], quanta={"attn": 1, "mlp": 1, "vocab": 1})
    assert tight.search.coupled and tight.optimal
    r0 = tight.rows[0]
    assert r0.predicted_memory <= 60.0 and r0.attn + r0.mlp <= 2
    assert tight.search.objective_s == pytest.approx(
        brute_force(nodes, sizes, [60.0, 1e9], {"attn": 1, "mlp": 1, "vocab": 1}))
    assert tight.lower_bound_s > tight.search.separable_s  # the coupling costs something here


def test_remainder_goes_to_the_end_holder_and_is_never_worse():
    nodes = [node(0, mlp=kc(slope=1.0)), node(1, mlp=kc(slope=1.2))]
    sizes = Sizes(attn=2, mlp=100, vocab=70)  # 100 = 3*32 + 4, 70 = 2*32 + 6
    res = plan(nodes, sizes, "segment", [1e12, 1e12])
    res.layout.check(sizes, world_size=2)
    assert sum(res.layout.mlp) == 100 and all(c % 32 == 0 for c in res.layout.mlp[:1])
    assert res.bottleneck_s <= res.search.objective_s


def test_paper_is_the_head_tied_optimum():
    """The paper's greedy over tied units reaches the min over h of max_d T_d(h/H) (costs monotone)."""
    rng = random.Random(3)
    for _ in range(60):
        nodes, sizes, caps = random_instance(rng)
        H = sizes.attn
        best = math.inf
        for units in compositions(H, len(nodes)):
            if all(memory_at(n, u / H) <= c for n, u, c in zip(nodes, units, caps)):
                best = min(best, max(time_at(n, u / H) for n, u in zip(nodes, units)))
        if best == math.inf:
            with pytest.raises(InfeasiblePlan):
                plan(nodes, sizes, "paper", caps, quanta=Q)
            continue
        try:
            res = plan(nodes, sizes, "paper", caps, quanta=Q)
        except InfeasiblePlan as exc:  # the greedy's units fit at h/H, their quantum cuts do not
            assert "cut at the quantum, exceeds the caps" in str(exc)
            continue
        assert res.feasible
        units = res.units
        assert sum(units) == H
        assert max(time_at(n, u / H) for n, u in zip(nodes, units)) == pytest.approx(best)
        assert res.layout == Layout.tied(units, sizes, Q)
        assert res.search is None and not res.optimal


def test_uniform_splits_every_kind_evenly_and_flags_over_cap():
    nodes = [node(d, attn=kc(mem=30 * MiB), mlp=kc(mem=60 * MiB), mem_repl=10 * MiB) for d in range(3)]
    sizes = Sizes(attn=8, mlp=320, vocab=100)
    caps = [1e12, 30 * MiB, 1e12]
    res = plan(nodes, sizes, "uniform", caps)
    assert res.layout.attn == (3, 3, 2)
    assert res.layout.mlp == (128, 96, 96)  # 10 quanta of 32: 4, 3, 3
    assert res.layout.vocab == (64, 32, 4)  # 4 quanta (the last partial): 2, 1, 1 -> cuts at 64, 96
    assert [r.over_cap for r in res.rows] == [False, True, False] and not res.feasible
    # The heterogeneity-aware strategies route around the small node instead.
    seg = plan(nodes, sizes, "segment", caps)
    assert seg.feasible and seg.rows[1].predicted_memory <= 30 * MiB


def test_result_fields_add_up():
    rng = random.Random(5)
    nodes, sizes, caps = random_instance(rng)
    nodes = [node(d, random_kind(rng), random_kind(rng), random_kind(rng), 0.05 * d) for d in range(3)]
    res = plan(nodes, Sizes(attn=6, mlp=200, vocab=500), "segment", [1e12] * 3, comm_s=0.25)
    assert set(res.segment_s) == {"attn", "mlp", "vocab", "out"}
    assert res.segment_s["out"] == pytest.approx(0.1)  # the slowest constant segment
    assert res.bottleneck_s == pytest.approx(sum(res.segment_s.values()))
    assert res.predicted_iteration_s == pytest.approx(res.bottleneck_s + 0.25)
    assert res.ideal_iteration_s == pytest.approx(res.ideal_compute_s + 0.25)
    for r in res.rows:
        assert r.predicted_compute_s == pytest.approx(sum(r.segment_s.values()))
        assert r.idle_s == pytest.approx(res.bottleneck_s - r.predicted_compute_s)
        assert r.idle_s >= -1e-12
        assert (r.attn, r.mlp, r.vocab) == tuple(res.layout.counts(k)[r.rank] for k in KINDS)
        assert r.predicted_memory == predict_memory(nodes[r.rank], r.shares)
    assert res.units == res.layout.attn and res.counts("mlp") == res.layout.mlp


@settings(max_examples=150, deadline=None)
@given(N=st.integers(1, 6), H=st.integers(1, 24), mlp=st.integers(1, 3000), vocab=st.integers(1, 3000),
       slopes=st.lists(st.floats(0.05, 20), min_size=18, max_size=18),
       icpts=st.lists(st.floats(0, 2), min_size=18, max_size=18), comm=st.floats(0, 3))
def test_properties_without_memory_pressure(N, H, mlp, vocab, slopes, icpts, comm):
    nodes = [node(d, *(kc(0.1, icpts[3 * d + i], slopes[3 * d + i]) for i in range(3))) for d in range(N)]
    sizes = Sizes(attn=H, mlp=mlp, vocab=vocab)
    res = plan(nodes, sizes, "segment", [1.0] * N, comm)
    res.layout.check(sizes, world_size=N)
    assert res.optimal and not res.search.coupled
    assert res.ideal_compute_s <= res.bottleneck_s * (1 + 1e-9)
    assert res.lower_bound_s <= res.search.objective_s
    for other in ("paper", "uniform"):
        assert plan(nodes, sizes, other, [1.0] * N, comm).bottleneck_s >= res.bottleneck_s * (1 - 1e-9) \
            or sizes.mlp % 32 or sizes.vocab % 32  # (a remainder can let another layout win slightly)


def test_infeasible_error_names_need_and_cap_per_kind():
    heavy = dict(attn=kc(mem=400 * MiB), mlp=kc(mem=800 * MiB), vocab=kc(mem=200 * MiB), mem_repl=100 * MiB)
    nodes = [node(0, **heavy), node(1, **heavy)]
    sizes = Sizes(attn=8, mlp=256, vocab=256)
    with pytest.raises(InfeasiblePlan) as err:
        plan(nodes, sizes, "segment", [400 * MiB, 500 * MiB])
    msg = str(err.value)
    assert "mlp: even holding nothing else, the nodes fit 224 of the 256 MLP columns" in msg
    assert "n0: cap 400.0 MiB; replicated 100.0 MiB; at the even share needs" in msg
    assert "attn 200.0, mlp 400.0, vocab 100.0 MiB" in msg
    assert "alone fits at most 6 of 8 attention units, 96 of 256 MLP columns, 256 of 256 vocabulary rows" in msg
    assert "n1: cap 500.0 MiB" in msg
    # Every kind fits alone but not all together: the coupled test says so.
    with pytest.raises(InfeasiblePlan, match="do not fit the memory together"):
        plan(nodes, sizes, "segment", [700 * MiB, 700 * MiB])
    with pytest.raises(InfeasiblePlan, match=r"\['n1'\] cannot even hold the replicated layers"):
        plan(nodes, sizes, "segment", [1e12, 50 * MiB])
    with pytest.raises(InfeasiblePlan, match="head-tied greedy ran out"):
        plan(nodes, sizes, "paper", [700 * MiB, 700 * MiB])
    assert isinstance(err.value, ValueError)


def test_ideal_bound_infinite_when_nothing_fits():
    nodes = [node(0, attn=kc(mem=100), mem_repl=100)]
    assert ideal_compute(nodes, Sizes(attn=4, mlp=32, vocab=32), [150.0]) == math.inf
    res = plan(nodes, Sizes(attn=4, mlp=32, vocab=32), "uniform", [150.0])
    assert res.ideal_iteration_s == math.inf and not res.feasible


SZ = Sizes(attn=4, mlp=64, vocab=64)


@pytest.mark.parametrize("kwargs, match", [
    (dict(nodes=[], sizes=SZ, strategy="segment", caps=[]), "at least one node"),
    (dict(nodes=[node(0)], sizes=4, strategy="segment", caps=[1.0]), "sizes"),
    (dict(nodes=[node(0)], sizes=SZ, strategy="optimal", caps=[1.0]), "strategy"),
    (dict(nodes=[node(0)], sizes=SZ, strategy="greedy", caps=[1.0]), "strategy"),
    (dict(nodes=[node(0)], sizes=SZ, strategy="paper", caps=[1.0, 2.0]), "caps"),
    (dict(nodes=[node(0), node(0)], sizes=SZ, strategy="paper", caps=[1.0, 1.0]), "unique"),
    (dict(nodes=[node(0, mlp=kc(slope=-1.0))], sizes=SZ, strategy="segment", caps=[1.0]), "mlp.slope_s"),
    (dict(nodes=[node(0, const=math.nan)], sizes=SZ, strategy="segment", caps=[1.0]), "const_s"),
    (dict(nodes=[node(0)], sizes=SZ, strategy="segment", caps=[math.nan]), "memory cap"),
    (dict(nodes=[node(0)], sizes=SZ, strategy="segment", caps=[1.0], comm_s=-1.0), "comm_s"),
    (dict(nodes=[node(0, attn=KindCost(0.0, 0.0, 1.0, 10.0, 0.0, act_slope=11.0))], sizes=SZ, strategy="segment",
          caps=[1.0]), r"attn.act_slope \(11.0\) exceeds the memory it is part of \(10.0\)"),
    (dict(nodes=[replace(node(0, mem_repl=5.0), grad_repl=6.0)], sizes=SZ, strategy="segment", caps=[1.0]),
     "grad_repl"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan(**kwargs)


@pytest.mark.parametrize("n, seed", [(3, 1), (5, 2), (16, 1), (16, 2)])
def test_binding_caps_at_model_scale_are_planned_within_half_a_percent(n, seed):
    """GPT-2-Medium-sized kinds (16 heads, 128 MLP quanta, 1563 vocabulary quanta), memory about
    each node's fair share with the fast nodes the tightest (bench/plan_speed's instances)."""
    from xronos.bench.plan_speed import tight_reports
    from xronos.gateway.plan.costmodel import node_cost
    from xronos.gateway.plan.profiles import memory_cap, node_profile

    reports = tight_reports(n, seed)
    nodes = [node_cost(node_profile(r)) for r in reports]
    caps = [memory_cap(r) for r in reports]
    res = plan(nodes, reports[0].sizes, "segment", caps)
    assert res.search.coupled and res.feasible
    # The real layouts' bound sits below the model's by at most the remainder quanta (16 rows of
    # 50,000 here), which a search that stops within GAP_TOL of the separable bound shows.
    assert res.search.separable_s * (1 - 1e-4) <= res.lower_bound_s <= res.search.objective_s
    assert res.gap <= 0.005
    assert res.ideal_compute_s <= res.lower_bound_s
    paper = plan(nodes, reports[0].sizes, "paper", caps)
    assert paper.bottleneck_s >= res.bottleneck_s
