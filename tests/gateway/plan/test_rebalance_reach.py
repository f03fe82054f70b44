"""The live policy's reach (pure): a move takes a node's share of a kind no further than `reach` x
the largest share it was measured at, because a factor measured on a sliver is local. Under a CPU
quota a sliver runs inside the quota the rank banked while it waited, and looks several times
faster per unit than the same box is at a real share (`make demo`: a Pi 4 holding 128 of 1536 MLP
columns was moved to 576 on such a factor and became the slowest rank)."""

from __future__ import annotations

import math
import random

import pytest

from xronos.gateway.plan.costmodel import kind_time
from xronos.gateway.plan.rebalance import NO_CAP, PolicyConfig, Rebalancer
from xronos.gateway.plan.refit import blend
from xronos.protocol.layout import KINDS, QUANTA, Layout
from tests.gateway.plan.test_rebalance import SIZES, UNIT_BYTES, cell

SLIVER = 0.1  # at most this share of its MLP, node 2 runs inside its banked quota


def truth(nodes, d: int, k: str, share: float) -> float:
    t = kind_time(nodes[d].kind(k), share)
    return 0.3 * t if (d == 2 and k == "mlp" and share <= SLIVER) else t


def run(config: PolicyConfig, steps: int = 80):
    base = cell([1.8, 1.0, 0.6])  # the profile, right except for the sliver
    start = Layout(attn=(8, 6, 2), mlp=(2432, 1408, 256), vocab=(30000, 15000, 5257))
    policy = Rebalancer(SIZES, start, base, [NO_CAP] * 3, UNIT_BYTES, bandwidth_Bps=125e6, config=config)
    rng = random.Random(0)
    replans, times = [], []
    for step in range(steps):
        r = policy.decide(step)
        if r is not None:
            replans.append(r)
        lay = policy.layout
        times.append(sum(max(truth(base, d, k, lay.share(k, d)) for d in range(3)) for k in KINDS))
        policy.observe([{k: truth(base, d, k, lay.share(k, d)) * (1 + rng.uniform(-0.03, 0.03)) for k in KINDS}
                        for d in range(3)])
    return replans, times


def test_a_sliver_that_looks_fast_gets_at_most_twice_the_work_per_move():
    replans, times = run(PolicyConfig())
    assert replans, "the sliver looks 3x faster than its profile: the policy does move"
    first = replans[0]
    assert first.old.mlp[2] == 256 and 256 < first.new.mlp[2] <= 2 * 256 + QUANTA["mlp"]
    assert "of the way to" in first.reason and "within reach" in first.reason
    for r in replans:  # and never more than twice what it was last measured at
        assert r.new.mlp[2] <= 2 * r.old.mlp[2] + QUANTA["mlp"]
    # measured at its new share, the box shows its real speed and the move is carried on to the
    # right layout; no iteration on the way is slower than before the first move
    assert max(times) <= times[0] * 1.001 and times[-1] < 0.9 * times[0]


def test_without_a_reach_the_first_move_trusts_the_sliver_far_beyond_it():
    replans, times = run(PolicyConfig(reach=math.inf))  # the behaviour before the reach
    assert replans[0].new.mlp[2] > 2 * 256 + QUANTA["mlp"]
    assert max(times) > 1.3 * times[0]  # and runs slower than before until it moves back


def test_reach_below_one_is_refused():
    with pytest.raises(ValueError, match="reach must be >= 1"):
        PolicyConfig(reach=0.5)


@pytest.mark.parametrize("seed", range(20))
def test_blend_covers_the_model_on_the_quanta_between_the_two_layouts(seed):
    rng = random.Random(seed)

    def random_layout(n: int) -> Layout:
        def cut(total: int, q: int) -> tuple[int, ...]:
            cuts = sorted(min(total, q * rng.randint(0, math.ceil(total / q))) for _ in range(n - 1))
            edges = [0, *cuts, total]
            return tuple(b - a for a, b in zip(edges, edges[1:]))
        return Layout(attn=cut(SIZES.attn, 1), mlp=cut(SIZES.mlp, 32), vocab=cut(SIZES.vocab, 32))

    n = rng.randint(2, 5)
    old, new = random_layout(n), random_layout(n)
    assert blend(old, new, 0.0, SIZES, QUANTA) == old and blend(old, new, 1.0, SIZES, QUANTA) == new
    alpha = rng.random()
    mid = blend(old, new, alpha, SIZES, QUANTA)
    mid.check(SIZES, world_size=n)  # sums exact, cuts on the quanta
    for k in KINDS:
        q = QUANTA[k]
        for a, b, c in zip(old.counts(k), new.counts(k), mid.counts(k)):
            assert abs(c - (a + alpha * (b - a))) <= 2 * q  # its two cuts rounded to the quantum
