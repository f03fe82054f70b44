"""Cost model against hand-computed Eq. 6-10 cases, the affine fit and the communication term."""

import math
import subprocess
from dataclasses import astuple
import sys

import pytest

from xronos.gateway.costmodel import (
    CommVolume, LayerCost, NodeProfile, comm_time, fit_affine, fit_error, kind_time,
    memory_at, node_cost, predict_memory, predict_time, segment_times, time_at, tp_comm_volume,
)


def layer(name, kind, part, t, mw, ma, mt, samples=(), segment=None):
    return LayerCost(name, kind, part, t, tuple(samples), mw, ma, mt, segment)


# B = 2; embedding partitioned (vocab), one attention and one MLP layer per block, a replicated
# norm in the block and a replicated classification head. Attention's samples are exactly
# 0.025 + 0.3 s, the MLP's 0.05 + 0.5 s.
PROFILE = NodeProfile("n0", 2, (
    layer("emb", "emb", True, 0.4, 100, 10, 50, [(0.5, 0.2), (1.0, 0.4)], "vocab"),
    layer("attn", "blk", True, 0.325, 200, 40, 80, [(0.25, 0.1), (0.5, 0.175), (1.0, 0.325)], "attn"),
    layer("mlp", "blk", True, 0.55, 400, 60, 90, [(0.25, 0.175), (0.5, 0.3), (1.0, 0.55)], "mlp"),
    layer("ln", "blk", False, 0.05, 8, 4, 30),
    layer("head", "out", False, 0.2, 60, 6, 70),
))
SH = {"attn": 0.25, "mlp": 0.5, "vocab": 0.75}


def test_segments_by_hand():
    node = node_cost(PROFILE, fit="affine")
    # The block remainder (2 x 0.05) splits between the attention and the MLP segment.
    assert astuple(node.attn) == pytest.approx((0.05, 2 * 0.025, 2 * 0.3, 2 * 240, 80))
    assert node.mlp.fixed_s == pytest.approx(0.05) and node.mlp.icpt_s == pytest.approx(0.1)
    assert node.mlp.slope_s == pytest.approx(1.0) and node.mlp.mem_slope == 2 * 460
    assert astuple(node.vocab) == pytest.approx((0.0, 0.0, 0.4, 110, 50))  # exactly linear: intercept 0
    assert (node.const_s, node.mem_repl, node.temp_repl) == (0.2, 2 * 12 + 66, 70)
    seg = segment_times(node, SH)
    assert seg["attn"] == pytest.approx(0.05 + 0.05 + 0.6 * 0.25)
    assert seg["mlp"] == pytest.approx(0.05 + 0.1 + 1.0 * 0.5)
    assert seg["vocab"] == pytest.approx(0.4 * 0.75)
    assert seg["out"] == 0.2
    assert predict_time(node, SH) == pytest.approx(sum(seg.values()))
    # A node with none of a kind still runs the replicated part of that kind's segment.
    none = segment_times(node, {"attn": 0.0, "mlp": 0.5, "vocab": 0.75})
    assert none["attn"] == pytest.approx(0.05)


def test_eq6_7_linear_time_by_hand():
    node = node_cost(PROFILE, fit="linear")
    # p = 1/4 on every kind (the paper's tied unit): 0.25*0.4 + 0.2 + 2*(0.25*(0.325+0.55) + 0.05)
    assert time_at(node, 0.25) == pytest.approx(0.1 + 0.2 + 2 * (0.25 * 0.875 + 0.05))
    assert time_at(node, 1.0) == pytest.approx(0.4 + 0.2 + 2 * (0.875 + 0.05))
    assert time_at(node, 0.0) == pytest.approx(0.2 + 2 * 0.05)


def test_eq8_9_10_memory_by_hand():
    node = node_cost(PROFILE, fit="linear")
    # Per kind: M_w + M_a scale with the kind's own share; M_t is the largest buffer, not a sum.
    # attn 0.25: 2*240*0.25 = 120; mlp 0.5: 2*460*0.5 = 460; vocab 0.75: 110*0.75 = 82.5;
    # replicated: 2*(8+4) + 66 = 90; M_t = max(70, 30, 80*0.25, 90*0.5, 50*0.75) = 70.
    assert predict_memory(node, SH) == pytest.approx(120 + 460 + 82.5 + 90 + 70)
    # Whole model: M_t = max(70, 80, 90, 50) = 90.
    assert memory_at(node, 1.0) == pytest.approx(480 + 920 + 110 + 90 + 90)
    assert memory_at(node, 0.0) == pytest.approx(90 + 70)


def test_affine_time_pays_intercept_only_with_a_share():
    node = node_cost(PROFILE, fit="affine")
    assert node.attn.icpt_s == pytest.approx(2 * 0.025)
    assert kind_time(node.attn, 0.0) == node.attn.fixed_s  # no heads: no partitioned cost
    assert kind_time(node.attn, 0.5) == pytest.approx(0.05 + 0.05 + 0.3)
    # Memory does not depend on the time fit.
    assert predict_memory(node, SH) == predict_memory(node_cost(PROFILE, "linear"), SH)


def test_time_and_memory_monotone_in_each_share():
    for fit in ("affine", "linear"):
        node = node_cost(PROFILE, fit)
        for k in ("attn", "mlp", "vocab"):
            t = [predict_time(node, {**SH, k: s / 16}) for s in range(17)]
            m = [predict_memory(node, {**SH, k: s / 16}) for s in range(17)]
            assert t == sorted(t) and m == sorted(m)


def test_segment_labels_are_checked():
    bad = NodeProfile("nX", 1, (layer("attn", "blk", True, 0.3, 1, 1, 1, [(0.5, 0.2), (1, 0.3)], "vocab"),))
    with pytest.raises(ValueError, match="nX: partitioned layer 'attn': segment 'vocab' cannot be in a block"):
        node_cost(bad)
    unlabelled = NodeProfile("nY", 1, (layer("attn", "blk", True, 0.3, 1, 1, 1, [(0.5, 0.2), (1, 0.3)]),))
    with pytest.raises(ValueError, match="nY: partitioned layer 'attn' has no segment kind"):
        node_cost(unlabelled)
    # The embedding and the head follow the vocabulary when unlabelled.
    ok = NodeProfile("nZ", 1, (layer("emb", "emb", True, 0.3, 1, 1, 1, [(0.5, 0.2), (1, 0.3)]),))
    assert node_cost(ok).vocab.slope_s > 0


def test_single_width_kind_uses_the_one_time():
    # A kind of one unit (a single KV head) can only be held whole: samples all at share 1.
    one = NodeProfile("n1", 1, (layer("attn", "blk", True, 0.3, 1, 1, 1, [(1.0, 0.3), (1.0, 0.32)], "attn"),))
    node = node_cost(one)
    assert kind_time(node.attn, 1.0) == pytest.approx(0.31)


@pytest.mark.parametrize("samples, expected", [
    ([(0.25, 0.1), (0.5, 0.175), (1.0, 0.325)], (0.025, 0.3)),  # exact affine
    ([(0.5, 1.0), (1.0, 0.8)], (0.9, 0.0)),  # decreasing: slope clamped, flat at the mean
    ([(0.5, 0.1), (1.0, 0.5)], (0.0, 0.44)),  # negative intercept: refit through the origin
])
def test_fit_affine_nonnegative_least_squares(samples, expected):
    alpha, beta = fit_affine(samples)
    assert (alpha, beta) == pytest.approx(expected)
    assert alpha >= 0 and beta >= 0


def test_fit_affine_needs_two_widths():
    with pytest.raises(ValueError, match="2 distinct widths"):
        fit_affine([(1.0, 0.3), (1.0, 0.31)])
    bad = NodeProfile("nX", 1, (layer("attn", "blk", True, 0.3, 1, 1, 1, [(0.5, 0.3), (0.5, 0.31)], "attn"),))
    with pytest.raises(ValueError, match="nX, layer attn"):
        node_cost(bad, "affine")
    node_cost(bad, "linear")  # the paper's model needs only time_s


def test_fit_error_shows_affine_gain():
    lay = layer("mlp", "blk", True, 0.3, 1, 1, 1, [(0.5, 0.2), (1.0, 0.3)])  # 0.1 + 0.2 p
    err = fit_error(lay, [(0.25, 0.15)])
    assert err.linear == pytest.approx(50.0)  # 0.25 * 0.3 = 0.075 vs 0.15
    assert err.affine == pytest.approx(0.0)


def test_comm_volume_megatron_counts():
    act = 2 * 8 * 64 * 4
    v = tp_comm_volume(hidden_size=64, batch_size=2, seq_len=8, num_blocks=3, task="classify")
    assert v == CommVolume(count=1 + 4 * 3, nbytes=float(act * 13))
    lm = tp_comm_volume(hidden_size=64, batch_size=2, seq_len=8, num_blocks=3, task="causal-lm")
    assert lm == CommVolume(count=13 + 4, nbytes=float(act * 14 + 3 * 2 * 8 * 4))


def test_comm_time_ring_model():
    v = CommVolume(count=13, nbytes=53248.0)
    assert comm_time(v, 4, [1e6, 2e6], 1e-3) == pytest.approx(13e-3 + 2 * 3 / 4 * 53248 / 1e6)
    assert comm_time(v, 1, 1e6, 1e-3) == 0.0
    with pytest.raises(ValueError, match="bandwidth"):
        comm_time(v, 2, [0.0])
    with pytest.raises(ValueError, match="latency"):
        comm_time(v, 2, 1e6, math.nan)


def test_bad_shares_and_fit():
    node = node_cost(PROFILE)
    with pytest.raises(ValueError, match="share of mlp"):
        predict_time(node, {"attn": 0.5, "mlp": 1.5, "vocab": 0.1})
    with pytest.raises(ValueError, match="share of vocab"):
        predict_memory(node, {"attn": 0.5, "mlp": 0.5})
    with pytest.raises(ValueError, match="fit"):
        node_cost(PROFILE, "quadratic")


def test_gateway_modules_do_not_import_torch():
    code = ("import sys; import xronos.gateway.costmodel, xronos.gateway.planner, "
            "xronos.gateway.profiles; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_node_comm_from_the_probe_and_comm_time_takes_the_slower_of_link_and_cpu():
    from xronos.gateway.costmodel import CommVolume, NodeComm, comm_time, comm_per_node, node_comm

    c = node_comm(nbytes=1004, seconds=0.011, small_bytes=4, small_seconds=0.001)
    # The probe's two ranks took turns on one core: one rank pays half of its per-byte time...
    assert c.per_byte_s == pytest.approx(0.5e-5) and c.fixed_s == pytest.approx(0.001 - 4e-5)
    assert node_comm(1004, 0.011, 4, 0.001, parallel=2).per_byte_s == pytest.approx(1e-5)  # ...or all, side by side
    # One rank of a ring of N: 2(N-1) steps, 2(N-1)/N of the tensor sent and received.
    assert c.allreduce_s(1000, 2) == pytest.approx(c.fixed_s + 0.005)
    assert c.allreduce_s(1000, 4) == pytest.approx(3 * c.fixed_s + 0.0075)
    assert c.allreduce_s(1000, 1) == 0.0
    with pytest.raises(ValueError, match="parallel"):
        node_comm(1004, 0.011, 4, 0.001, parallel=3)
    vol = CommVolume(count=10, nbytes=10_000.0)
    link = comm_time(vol, 2, 1e9, 1e-6)
    assert comm_time(vol, 2, 1e9, 1e-6, [c]) == pytest.approx(10 * c.allreduce_s(1000, 2))
    assert comm_time(vol, 2, 1e9, 1e-6, [c]) > link
    assert comm_time(vol, 2, 1e3, 1e-6, [c]) == pytest.approx(comm_time(vol, 2, 1e3, 1e-6))  # link-bound
    assert comm_time(vol, 1, 1e9, 1e-6, [c]) == 0.0
    fast = NodeComm(fixed_s=0.0, per_byte_s=0.0)
    assert comm_per_node(vol, 2, [c, fast, None]) == [pytest.approx(10 * c.allreduce_s(1000, 2)), 0.0, None]
    with pytest.raises(ValueError, match="collectives.seconds"):
        node_comm(1004, float("nan"), 4, 0.001)
    with pytest.raises(ValueError, match="small_bytes"):
        node_comm(4, 0.01, 4, 0.001)
