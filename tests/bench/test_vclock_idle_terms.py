"""The validation's idle accounting (bench/vclock_bench.idle_terms) on iterations made up by hand:
the systematic part is what the ranks' mean segments make a rank wait, the jitter what their
variation adds, the exit what the collectives' own wall time adds on top."""

from __future__ import annotations

import pytest

from xronos.bench.vclock_bench import idle_terms


def rank(segs, idle_wall, coll_wall, idle_virtual=0.0, virtual_s=1.0, iters=4):
    wall_s = sum(segs) + coll_wall
    return {"rows": [dict(seg_walls=list(segs), idle_wall=idle_wall, coll_wall=coll_wall, wall_s=wall_s,
                          idle_virtual=idle_virtual, coll_virtual=idle_virtual, virtual_s=virtual_s)] * iters}


def test_a_steadily_shorter_rank_waits_systematically_and_nothing_else():
    # rank 1's segments are 1 ms shorter every time: 2 ms of systematic idle per iteration, no jitter
    fast = rank([0.001, 0.001], idle_wall=0.002, coll_wall=0.0025, idle_virtual=0.25, virtual_s=1.0)
    slow = rank([0.002, 0.002], idle_wall=0.0, coll_wall=0.0005)
    t = idle_terms([slow, fast])
    assert t[1]["systematic_s"] == pytest.approx(0.002) and t[1]["jitter_s"] == pytest.approx(0.0)
    assert t[1]["exit_s"] == pytest.approx(0.0) and t[0]["systematic_s"] == pytest.approx(0.0)
    # the iteration the virtual clock models: 4.5 ms of wall less 0.5 ms of loopback transfer
    assert t[1]["transfer_excess_s"] == pytest.approx(0.0005)
    assert t[1]["systematic_pct"] == pytest.approx(50.0) and t[1]["left_points"] == pytest.approx(-25.0)


def test_ranks_equal_on_average_wait_only_for_each_others_jitter():
    a = rank([0.0005, 0.0015], idle_wall=0.001, coll_wall=0.0011)
    b = rank([0.0015, 0.0005], idle_wall=0.0012, coll_wall=0.0013)  # 0.2 ms more: leaving later
    t = idle_terms([a, b])
    for r in t:
        assert r["systematic_s"] == pytest.approx(0.0) and r["jitter_s"] == pytest.approx(0.001)
    assert t[0]["exit_s"] == pytest.approx(0.0) and t[1]["exit_s"] == pytest.approx(0.0002)
    assert t[0]["left_points"] == pytest.approx(0.0)  # no virtual idle, no systematic idle
