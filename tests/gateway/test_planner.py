"""Planner: optimal == exhaustive search, greedy never better, uniform baseline, infeasibility."""

import itertools
import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from xronos.gateway.costmodel import NodeCost, memory_at, time_at
from xronos.gateway.planner import MiB, InfeasiblePlan, ideal_compute, plan


def node(i, t_repl=0.1, t_icpt=0.0, t_slope=1.0, m_repl=0.0, m_slope=0.0, mt_repl=0.0, mt_part=0.0):
    return NodeCost(f"n{i}", t_repl, t_icpt, t_slope, m_repl, m_slope, mt_repl, mt_part)


def compositions(H, N):
    """Every way to write H as an ordered sum of N non-negative integers."""
    for bars in itertools.combinations(range(H + N - 1), N - 1):
        edges = (-1, *bars, H + N - 1)
        yield [b - a - 1 for a, b in zip(edges, edges[1:])]


def brute_force(nodes, H, caps):
    best = math.inf
    for units in compositions(H, len(nodes)):
        if all(memory_at(n, u / H) <= c for n, u, c in zip(nodes, units, caps)):
            best = min(best, max(time_at(n, u / H) for n, u in zip(nodes, units)))
    return best


def random_instance(rng):
    N, H = rng.randint(1, 5), rng.randint(1, 16)
    nodes = [node(d, t_repl=rng.uniform(0, 0.5), t_icpt=rng.choice([0.0, rng.uniform(0, 0.3)]),
                  t_slope=rng.choice([0.0, rng.uniform(0.1, 5.0)]),
                  m_repl=rng.uniform(0, 100), m_slope=rng.uniform(0, 400),
                  mt_repl=rng.uniform(0, 50), mt_part=rng.uniform(0, 200))
             for d in range(N)]
    # Caps from tight (often infeasible) to loose.
    caps = [rng.uniform(50, 100 + 500 / N) for _ in range(N)]
    return nodes, H, caps


def test_optimal_equals_exhaustive_search_on_random_instances():
    rng = random.Random(1234)
    infeasible = 0
    for _ in range(400):
        nodes, H, caps = random_instance(rng)
        best = brute_force(nodes, H, caps)
        if best == math.inf:
            infeasible += 1
            for strategy in ("optimal", "greedy"):
                with pytest.raises(InfeasiblePlan):
                    plan(nodes, H, strategy, caps)
            continue
        opt = plan(nodes, H, "optimal", caps)
        assert opt.bottleneck_s == best
        assert sum(opt.units) == H and opt.feasible
        assert all(r.predicted_memory <= r.memory_cap for r in opt.rows)
        greedy = plan(nodes, H, "greedy", caps)
        assert greedy.feasible and sum(greedy.units) == H
        # Never better; in fact equal: with costs nondecreasing in units, handing each unit to the
        # node that is fastest after taking it picks the H smallest marginal times, which is the
        # min-max optimum. Only the per-node split may differ (ties).
        assert greedy.bottleneck_s == opt.bottleneck_s
        assert opt.ideal_compute_s <= opt.bottleneck_s
    assert 40 <= infeasible <= 360  # the generator exercises both outcomes


@settings(max_examples=200, deadline=None)
@given(
    N=st.integers(1, 6), H=st.integers(1, 40),
    speeds=st.lists(st.floats(0.05, 20), min_size=6, max_size=6),
    icpts=st.lists(st.floats(0, 2), min_size=6, max_size=6),
    comm=st.floats(0, 3),
)
def test_properties_without_memory_pressure(N, H, speeds, icpts, comm):
    nodes = [node(d, t_repl=0.2, t_icpt=icpts[d], t_slope=speeds[d]) for d in range(N)]
    caps = [1.0] * N
    opt, greedy = plan(nodes, H, "optimal", caps, comm), plan(nodes, H, "greedy", caps, comm)
    assert greedy.bottleneck_s >= opt.bottleneck_s
    assert opt.ideal_compute_s <= opt.bottleneck_s
    assert opt.predicted_iteration_s == opt.bottleneck_s + comm
    assert opt.ideal_iteration_s == opt.ideal_compute_s + comm
    for r in opt.rows:
        assert r.idle_s == opt.bottleneck_s - r.predicted_compute_s >= 0


def test_faster_node_gets_more_units():
    nodes = [node(0, t_slope=1.0), node(1, t_slope=3.0)]
    res = plan(nodes, 8, "optimal", [1.0, 1.0])
    assert res.units == (6, 2)  # 0.1 + 6/8 = 0.85 vs 0.1 + 3*2/8 = 0.85
    assert res.bottleneck_s == pytest.approx(0.85)
    assert res.ideal_compute_s == pytest.approx(0.85)
    assert plan(nodes, 8, "greedy", [1.0, 1.0]).units == (6, 2)


def test_optimal_returns_surplus_from_the_slowest_node_deterministically():
    # Flat times: every node reaches the bottleneck with all its units; surplus must be trimmed.
    nodes = [node(d, t_repl=0.0, t_icpt=1.0, t_slope=0.0) for d in range(3)]
    a = plan(nodes, 5, "optimal", [1.0] * 3)
    assert sum(a.units) == 5 and a.bottleneck_s == 1.0
    assert a.units == plan(nodes, 5, "optimal", [1.0] * 3).units


def test_memory_cap_limits_the_fast_node():
    # The fast node fits only 2 of 8 units: M = 100 + 400 p <= 200.
    nodes = [node(0, t_slope=1.0, m_repl=100, m_slope=400), node(1, t_slope=4.0)]
    for strategy in ("optimal", "greedy"):
        res = plan(nodes, 8, strategy, [200.0, 1e9])
        assert res.units == (2, 6), strategy
    # The ideal bound respects the cap too: p0 <= 0.25 so node 1 must take 0.75 -> 0.1 + 3.0.
    assert plan(nodes, 8, "optimal", [200.0, 1e9]).ideal_compute_s == pytest.approx(3.1)


def test_uniform_spreads_the_remainder_and_flags_over_cap():
    nodes = [node(d, m_repl=10 * MiB, m_slope=100 * MiB) for d in range(3)]
    caps = [1e12, 30 * MiB, 1e12]
    res = plan(nodes, 8, "uniform", caps)
    assert res.units == (3, 3, 2)
    assert [r.over_cap for r in res.rows] == [False, True, False]
    assert not res.feasible
    assert plan(nodes, 2, "uniform", [1e12] * 3).units == (1, 1, 0)
    assert plan(nodes, 9, "uniform", [1e12] * 3).feasible
    # The heterogeneity-aware planners route around the small node instead.
    assert plan(nodes, 8, "optimal", caps).rows[1].units <= 2


def test_infeasible_error_names_needs_and_caps():
    nodes = [node(0, m_repl=100 * MiB, m_slope=800 * MiB), node(1, m_repl=100 * MiB, m_slope=800 * MiB)]
    caps = [300 * MiB, 200 * MiB]
    for strategy in ("greedy", "optimal"):
        with pytest.raises(InfeasiblePlan) as err:
            plan(nodes, 8, strategy, caps)
        msg = str(err.value)
        assert "together the nodes fit 3 of the 8 units" in msg
        assert "n0: needs 100.0 MiB at 0 units, 500.0 MiB at the even share of 4 units" in msg
        assert "cap 300.0 MiB; fits at most 2 units" in msg
        assert "n1:" in msg and "cap 200.0 MiB; fits at most 1 units" in msg
    assert isinstance(err.value, ValueError)
    with pytest.raises(InfeasiblePlan, match=r"\['n1'\] cannot even hold the replicated layers"):
        plan(nodes, 8, "optimal", [1e12, 50 * MiB])


def test_ideal_bound_infinite_when_nothing_fits():
    nodes = [node(0, m_repl=100, m_slope=100)]
    assert ideal_compute(nodes, [150.0]) == math.inf
    res = plan(nodes, 4, "uniform", [150.0])
    assert res.ideal_iteration_s == math.inf and not res.feasible


@pytest.mark.parametrize("kwargs, match", [
    (dict(nodes=[], H=4, strategy="optimal", caps=[]), "at least one node"),
    (dict(nodes=[node(0)], H=0, strategy="optimal", caps=[1.0]), "H"),
    (dict(nodes=[node(0)], H=4, strategy="best", caps=[1.0]), "strategy"),
    (dict(nodes=[node(0)], H=4, strategy="greedy", caps=[1.0, 2.0]), "caps"),
    (dict(nodes=[node(0), node(0)], H=4, strategy="greedy", caps=[1.0, 1.0]), "unique"),
    (dict(nodes=[node(0, t_slope=-1.0)], H=4, strategy="greedy", caps=[1.0]), "t_slope"),
    (dict(nodes=[node(0, t_repl=math.nan)], H=4, strategy="greedy", caps=[1.0]), "t_repl"),
    (dict(nodes=[node(0)], H=4, strategy="greedy", caps=[math.nan]), "memory cap"),
    (dict(nodes=[node(0)], H=4, strategy="greedy", caps=[1.0], comm_s=-1.0), "comm_s"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan(**kwargs)
