"""Batch shares of data parallelism (`gateway.plan.shares`): proportional rows by largest remainder,
the min-max split, and the refusal of shares no plan can run."""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import pytest

from xronos.gateway.plan.shares import (ShareError, balanced_shares, check_shares, proportional_shares,
                                        slowest_time)


def test_proportional_rows_sum_to_the_batch_and_follow_the_speeds() -> None:
    assert proportional_shares([2.0, 1.0, 1.0], 8) == (4, 2, 2)
    assert proportional_shares([1.0], 5) == (5,)
    # quotas 3.33/3.33/3.33: one remainder each, the first goes to the lowest index
    assert proportional_shares([1.0, 1.0, 1.0], 10) == (4, 3, 3)
    # quotas 1.6/0.4 -> floors 1/0, the larger remainder (0.6) takes the last row
    assert proportional_shares([4.0, 1.0], 2) == (2, 0)


def test_a_rank_of_speed_zero_gets_no_rows_and_ties_go_to_the_faster() -> None:
    assert proportional_shares([3.0, 0.0, 1.0], 4) == (3, 0, 1)
    assert proportional_shares([0.0, 5.0], 7) == (0, 7)
    # 3 rows over 6/2/2 -> quotas 1.8/0.6/0.6: floors 1/0/0, the remainders 0.8 then 0.6 (tied: lower index)
    assert proportional_shares([6.0, 2.0, 2.0], 3) == (2, 1, 0)
    # 5 rows over 3/1/1 -> quotas 3/1/1 exactly: no rounding at all
    assert proportional_shares([3.0, 1.0, 1.0], 5) == (3, 1, 1)
    # 2 rows over speeds 1/3 -> 0.5/1.5: both remainders 0.5, the faster (rank 1) takes it
    assert proportional_shares([1.0, 3.0], 2) == (0, 2)


def test_proportional_is_floor_or_ceiling_of_every_quota_randomised() -> None:
    rnd = random.Random(36)
    for _ in range(500):
        n = rnd.randint(1, 9)
        speeds = [rnd.choice([0.0, rnd.uniform(0.01, 50.0)]) for _ in range(n)]
        if sum(speeds) == 0:
            speeds[0] = 1.0
        batch = rnd.randint(1, 300)
        rows = proportional_shares(speeds, batch)
        assert sum(rows) == batch and all(r >= 0 for r in rows)
        total = sum(map(Fraction, speeds))
        for r, s in zip(rows, speeds):
            q = batch * Fraction(s) / total
            assert math.floor(q) <= r <= math.ceil(q), (speeds, batch, rows)
        if len(set(speeds)) == n:  # the order of the ranks matters only to break ties between equal speeds
            assert proportional_shares(speeds[::-1], batch) == rows[::-1]


def _brute_minmax(speeds: list[float], batch: int) -> float:
    best = math.inf
    for split in itertools.product(range(batch + 1), repeat=len(speeds)):
        if sum(split) == batch:
            best = min(best, slowest_time(split, speeds))
    return best


def test_balanced_is_the_least_slowest_time_against_brute_force() -> None:
    rnd = random.Random(7)
    for _ in range(300):
        n = rnd.randint(1, 4)
        speeds = [rnd.choice([0.0, float(rnd.randint(1, 9)), rnd.uniform(0.1, 9.0)]) for _ in range(n)]
        if sum(speeds) == 0:
            speeds[-1] = 2.0
        batch = rnd.randint(1, 9)
        rows = balanced_shares(speeds, batch)
        assert sum(rows) == batch and all(r >= 0 for r in rows)
        assert all(r == 0 for r, s in zip(rows, speeds) if s == 0)
        assert slowest_time(rows, speeds) == pytest.approx(_brute_minmax(speeds, batch), rel=1e-12), (speeds, batch)
        # never slower than the proportional split
        assert slowest_time(rows, speeds) <= slowest_time(proportional_shares(speeds, batch), speeds) * (1 + 1e-12)


def test_balanced_matches_the_greedy_from_nothing_on_large_batches() -> None:
    """The shortcut start (floors of a scaled-down quota) ends where row-by-row d'Hondt ends."""
    rnd = random.Random(11)
    for _ in range(100):
        n = rnd.randint(1, 8)
        speeds = [rnd.uniform(0.05, 20.0) for _ in range(n)]
        batch = rnd.randint(1, 400)
        rows = [0] * n
        for _ in range(batch):
            r = min(range(n), key=lambda d: (Fraction(rows[d] + 1) / Fraction(speeds[d]), -speeds[d], d))
            rows[r] += 1
        assert balanced_shares(speeds, batch) == tuple(rows)


def test_balanced_leaves_a_slow_rank_idle_where_one_row_would_hold_everyone_up() -> None:
    speeds = [7.0, 1.0, 1.0, 1.0]
    assert proportional_shares(speeds, 5) == (4, 1, 0, 0)
    assert balanced_shares(speeds, 5) == (5, 0, 0, 0)
    assert slowest_time((5, 0, 0, 0), speeds) == pytest.approx(5 / 7)
    assert slowest_time((4, 1, 0, 0), speeds) == 1.0


@pytest.mark.parametrize("speeds,batch,needle", [
    ([], 4, "speeds: need at least one rank"),
    ([1.0, -1.0], 4, "speeds[1]: must be a finite number >= 0"),
    ([1.0, math.nan], 4, "speeds[1]"),
    ([math.inf], 4, "speeds[0]"),
    ([0.0, 0.0], 4, "at least one rank must have a speed > 0"),
    ([1.0, True], 4, "speeds[1]"),
    ([1.0], 0, "global batch: must be an integer >= 1, got 0"),
    ([1.0], 2.0, "global batch"),
])
def test_bad_speeds_or_batch_are_refused_naming_them(speeds, batch, needle) -> None:
    for fn in (proportional_shares, balanced_shares):
        with pytest.raises(ShareError, match=None) as e:
            fn(speeds, batch)
        assert needle in str(e.value), str(e.value)


def test_good_shares_pass_including_zero() -> None:
    check_shares({"pi5": 0, "n100": 6, "opi": 2}, ["n100", "pi5", "opi"], 8)


@pytest.mark.parametrize("shares,needle", [
    ({"a": 3, "b": 4}, "shares: sum to 7 rows, but the global batch is 8"),
    ({"a": 10, "b": -2}, "shares['b']: -2 rows is negative (limit: >= 0)"),
    ({"a": 4, "b": 4, "zz": 0}, "shares: unknown node 'zz' (the mesh's nodes: a, b)"),
    ({"a": 8}, "shares: no share for node 'b'"),
    ({"a": 4.0, "b": 4}, "shares['a']: must be an integer number of rows, got 4.0"),
    ({"a": True, "b": 7}, "shares['a']: must be an integer"),
    ({"a": 9, "b": 0}, "shares['a']: 9 rows exceeds the global batch of 8"),
])
def test_bad_shares_are_refused_naming_the_value_and_the_limit(shares, needle) -> None:
    with pytest.raises(ShareError) as e:
        check_shares(shares, ["a", "b"], 8)
    assert needle in str(e.value), str(e.value)
    assert isinstance(e.value, ValueError)


def test_shares_are_checked_against_a_valid_batch() -> None:
    with pytest.raises(ShareError, match="global batch"):
        check_shares({"a": 0}, ["a"], 0)
