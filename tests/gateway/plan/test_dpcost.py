"""The cost of data parallelism (`gateway.plan.dpcost`) against hand-computed cases: a row's time,
DDP's buckets, the all-reduce's overlap with backward, a replica's memory at its rows, the split."""

from __future__ import annotations

from dataclasses import replace

import pytest

from xronos.gateway.plan.commmodel import NodeComm
from xronos.gateway.plan.costmodel import (LayerCost, NodeProfile, node_cost, rows_factor, rows_fixed_fraction,
                                           time_at)
from xronos.gateway.plan.memorymodel import memory_at
from xronos.gateway.plan.dpcost import (DPInfeasible, allreduce_s, bucket_sizes, predict_dp, replica_memory,
                                        require_fit, row_time, rows_time)
from xronos.gateway.plan.refit import refit
from xronos.gateway.plan.shares import ShareError

MiB = 1 << 20


def layer(name, kind, part, t, mw, ma, mt, samples=(), segment=None):
    return LayerCost(name, kind, part, t, tuple(samples), mw, ma, mt, segment)


# test_costmodel's profile (B = 2 blocks), taken at 4 rows: the whole model takes
# 0.4 + 0.2 + 2 * (0.325 + 0.55 + 0.05) = 2.45 s.
PROFILE = NodeProfile("fast", 2, (
    layer("emb", "emb", True, 0.4, 100, 10, 50, [(0.5, 0.2), (1.0, 0.4)], "vocab"),
    layer("attn", "blk", True, 0.325, 200, 40, 80, [(0.25, 0.1), (0.5, 0.175), (1.0, 0.325)], "attn"),
    layer("mlp", "blk", True, 0.55, 400, 60, 90, [(0.25, 0.175), (0.5, 0.3), (1.0, 0.55)], "mlp"),
    layer("ln", "blk", False, 0.05, 8, 4, 30),
    layer("head", "out", False, 0.2, 60, 6, 70),
))
ROWS = 4
FAST = node_cost(PROFILE)
SLOW = replace(refit(FAST, {"attn": 3.0, "mlp": 3.0, "vocab": 3.0}), node_id="slow",
               const_s=3 * FAST.const_s)  # three times slower everywhere


def test_a_rows_time_is_the_whole_model_at_the_profiles_rows_per_row():
    assert time_at(FAST, 1.0) == pytest.approx(2.45)
    assert row_time(FAST, ROWS) == pytest.approx(2.45 / 4)
    assert row_time(SLOW, ROWS) == pytest.approx(3 * 2.45 / 4)
    with pytest.raises(ValueError, match="profile batch size must be an integer >= 1, got 0"):
        row_time(FAST, 0)


def test_ddp_buckets_a_small_first_then_25_mib():
    assert bucket_sizes(0) == []
    assert bucket_sizes(0.5 * MiB) == [0.5 * MiB]
    assert bucket_sizes(60 * MiB) == [1 * MiB, 25 * MiB, 25 * MiB, 9 * MiB]
    with pytest.raises(ValueError, match="gradient bytes must be finite and >= 0"):
        bucket_sizes(-1)


def test_a_buckets_all_reduce_is_the_slower_of_link_and_cpu():
    # 3 nodes, 1 MB/s, 1 ms: 1e-3 + 2 * 2/3 * 3e6 / 1e6 = 4.001 s over the link
    assert allreduce_s(3e6, 3, 1e6, 1e-3) == pytest.approx(4.001)
    slow_cpu = NodeComm(fixed_s=0.1, per_byte_s=1e-6)  # 0.1 * 2 + 1e-6 * 4/3 * 3e6 = 4.2 s
    assert allreduce_s(3e6, 3, 1e6, 1e-3, [NodeComm(0.0, 0.0), slow_cpu]) == pytest.approx(4.2)
    assert allreduce_s(3e6, 1, 1e6, 1e-3, [slow_cpu]) == 0.0


def test_rows_follow_speed_and_every_bucket_but_the_last_hides_behind_backward():
    nodes = [replace(FAST, trained_full=51 * MiB), replace(SLOW, trained_full=51 * MiB)]
    # 8 rows over speeds 3:1 (row times 0.6125 / 1.8375 s): 6 / 2, both 3.675 s
    pred = predict_dp(nodes, [1e12, 1e12], ROWS, 8, bandwidth_Bps=100 * MiB, latency_s=0.0)
    assert [n.rows for n in pred.nodes] == [6, 2]
    assert pred.compute_s == pytest.approx(6 * 2.45 / 4)
    # buckets 1, 25, 25 MiB; a two-node ring moves each once: 0.01, 0.25, 0.25 s
    assert pred.buckets == 3 and pred.allreduce_s == pytest.approx(0.51)
    # 0.26 s of the first two hide behind 2/3 of 3.675 s; the last (the embedding's) never does
    assert pred.exposed_s == pytest.approx(0.25)
    assert pred.iteration_s == pytest.approx(3.675 + 0.25)
    assert pred.ideal_s == pytest.approx(8 / (4 / 2.45 + 4 / (3 * 2.45)) + 0.25)
    # A slow link: what backward cannot hide shows; with no overlap at all, everything does.
    slow = predict_dp(nodes, [1e12, 1e12], ROWS, 8, bandwidth_Bps=1 * MiB, latency_s=0.0)
    assert slow.exposed_s == pytest.approx(25 + (26 - 2 / 3 * 3.675))
    bare = predict_dp(nodes, [1e12, 1e12], ROWS, 8, bandwidth_Bps=1 * MiB, latency_s=0.0, backward_fraction=0.0)
    assert bare.exposed_s == pytest.approx(bare.allreduce_s) == pytest.approx(51)


def test_one_node_has_no_all_reduce():
    pred = predict_dp([FAST], [1e12], ROWS, 5)
    assert pred.nodes[0].rows == 5 and pred.allreduce_s == 0.0 and pred.exposed_s == 0.0
    assert pred.iteration_s == pytest.approx(5 * 2.45 / 4)


def test_forced_shares_are_checked_and_used():
    pred = predict_dp([FAST, SLOW], [1e12, 1e12], ROWS, 8, shares={"fast": 8, "slow": 0})
    assert [n.rows for n in pred.nodes] == [8, 0] and pred.compute_s == pytest.approx(2 * 2.45)
    with pytest.raises(ShareError, match="sum to 7 rows, but the global batch is 8"):
        predict_dp([FAST, SLOW], [1e12, 1e12], ROWS, 8, shares={"fast": 7, "slow": 0})
    with pytest.raises(ShareError, match="unknown node 'pi'"):
        predict_dp([FAST, SLOW], [1e12, 1e12], ROWS, 8, shares={"fast": 8, "slow": 0, "pi": 0})


def test_a_replicas_memory_scales_its_activations_with_its_rows():
    # At the profile's rows: the whole model, as costmodel predicts it (1466 bytes by hand there).
    assert replica_memory(FAST, ROWS, ROWS) == pytest.approx(memory_at(FAST, 1.0)) == pytest.approx(1466)
    # Three times the rows: A = 3 * 224 = 672 now exceeds G = 344 (the peak holds A, not G), and
    # the temporaries triple: 1600 - 224 + 672 - 344 + 3 * 90
    assert replica_memory(FAST, 3 * ROWS, ROWS) == pytest.approx(1600 - 224 + 672 - 344 + 270)
    # No rows: no activations, but the weights, the (zero) gradients and the optimizer state stay:
    # A = 0 < G, so min(A, G) = 0 and the peak is the same as with A < G.
    assert replica_memory(FAST, 0, ROWS) == pytest.approx(1600 - 224 + 90)


def test_a_replica_that_does_not_fit_is_refused_naming_every_nodes_need_and_cap():
    pred = predict_dp([FAST, SLOW], [10 * MiB, 1000.0], ROWS, 8)
    assert not pred.feasible and [n.fits for n in pred.nodes] == [True, False]
    with pytest.raises(DPInfeasible) as e:
        require_fit(pred)
    msg = str(e.value)
    assert "every node holds a whole replica" in msg
    assert "fast needs 0 MiB with 6 rows, cap 10 MiB;" in msg and "slow needs 0 MiB with 2 rows, cap 0 MiB (over)" in msg
    assert require_fit(predict_dp([FAST], [1e12], ROWS, 8)).feasible


@pytest.mark.parametrize("kw,needle", [
    (dict(bandwidth_Bps=0.0), "bandwidth must be finite and > 0"),
    (dict(latency_s=-1.0), "latency must be finite and >= 0"),
    (dict(backward_fraction=1.5), "backward_fraction must be in [0, 1]"),
])
def test_bad_link_numbers_are_refused(kw, needle):
    with pytest.raises(ValueError) as e:
        predict_dp([FAST], [1e12], ROWS, 4, **kw)
    assert needle in str(e.value)


def test_the_share_paid_whatever_the_rows_comes_from_the_profiles_probe():
    # a quarter of 16 rows took 0.4 of the batch's time: a + (1 - a) / 4 = 0.4, a = 0.2
    assert rows_fixed_fraction(4, 16, 0.4, 1.0) == pytest.approx(0.2)
    assert rows_fixed_fraction(4, 16, 0.25, 1.0) == 0.0  # in proportion: nothing fixed
    assert rows_fixed_fraction(4, 16, 0.1, 1.0) == 0.0  # faster than in proportion: noise, clamped
    assert rows_fixed_fraction(4, 16, 1.5, 1.0) == 0.9  # slower than the batch: noise, bounded
    with pytest.raises(ValueError, match=r"probe rows must be in \(0, 16\), got 16"):
        rows_fixed_fraction(16, 16, 1.0, 1.0)
    node = replace(FAST, rows_fixed=0.2)
    assert rows_factor(node, 0) == 0.0 and rows_factor(node, 1.0) == 1.0
    assert rows_factor(node, 0.25) == pytest.approx(0.4)
    assert rows_time(node, 1, ROWS) == pytest.approx(2.45 * (0.2 + 0.8 / 4))


def test_a_fixed_share_moves_rows_to_the_fast_node_and_into_the_prediction():
    # fast: 2.45 * (0.2 + 0.8 r / 4), slow three times that. 8 rows: d'Hondt's 6 / 2 ends at
    # 3.43 / 4.41 s, 7 / 1 at 3.92 / 2.94, 8 / 0 at 4.41: the greedy split takes 7 / 1.
    nodes = [replace(FAST, rows_fixed=0.2), replace(SLOW, rows_fixed=0.2)]
    pred = predict_dp(nodes, [1e12, 1e12], ROWS, 8, bandwidth_Bps=1e15, latency_s=0.0)
    assert [n.rows for n in pred.nodes] == [7, 1]
    assert pred.compute_s == pytest.approx(2.45 * (0.2 + 0.8 * 7 / 4))
    # fluid: both busy T: 5 (T / 2.45 - 0.2) + 5 (T / 7.35 - 0.2) = 8 rows, T = 3.675 s
    assert pred.ideal_s == pytest.approx(3.675)
    # a slow node whose fixed share alone is longer than the fast one's whole batch gets no rows
    heavy = [replace(FAST, rows_fixed=0.5), replace(SLOW, rows_fixed=0.5)]
    assert [n.rows for n in predict_dp(heavy, [1e12, 1e12], ROWS, 8, bandwidth_Bps=1e15, latency_s=0.0).nodes] == [8, 0]
    # a rank with no rows costs nothing; without a fixed share the split is d'Hondt's
    assert predict_dp(nodes, [1e12, 1e12], ROWS, 8, shares={"fast": 8, "slow": 0}, bandwidth_Bps=1e15,
                      latency_s=0.0).nodes[1].compute_s == 0.0
    plain = predict_dp([FAST, SLOW], [1e12, 1e12], ROWS, 8, bandwidth_Bps=1e15, latency_s=0.0)
    assert [n.rows for n in plain.nodes] == [6, 2]
