"""Cost model against hand-computed Eq. 6-10 cases, the affine fit and the communication term."""

import math
import subprocess
import sys

import pytest

from xronos.gateway.costmodel import (
    CommVolume, LayerCost, NodeProfile, comm_time, fit_affine, fit_error, node_cost,
    predict_memory, predict_time, tp_comm_volume,
)


def layer(name, kind, part, t, mw, ma, mt, samples=()):
    return LayerCost(name, kind, part, t, tuple(samples), mw, ma, mt)


# B = 2; the paper's layout: embedding partitioned, output replicated, one partitioned and one
# replicated layer per block. Attention's samples are exactly 0.025 + 0.3 p.
PROFILE = NodeProfile("n0", 2, (
    layer("emb", "emb", True, 0.4, 100, 10, 50, [(0.5, 0.2), (1.0, 0.4)]),
    layer("attn", "blk", True, 0.3, 200, 40, 80, [(0.25, 0.1), (0.5, 0.175), (1.0, 0.325)]),
    layer("ln", "blk", False, 0.05, 8, 4, 30),
    layer("head", "out", False, 0.2, 60, 6, 70),
))


def test_eq6_7_linear_time_by_hand():
    node = node_cost(PROFILE, fit="linear")
    # p = 1/4: 0.25*0.4 + 0.2 + 2*(0.25*0.3 + 0.05) = 0.55
    assert predict_time(node, 1, 4) == pytest.approx(0.55)
    assert predict_time(node, 4, 4) == pytest.approx(0.4 + 0.2 + 2 * (0.3 + 0.05))
    assert predict_time(node, 0, 4) == pytest.approx(0.2 + 2 * 0.05)


def test_eq8_9_10_memory_by_hand():
    node = node_cost(PROFILE, fit="linear")
    # p = 1/4: M_w = 25 + 60 + 2*(50 + 8) = 201; M_a = 2.5 + 6 + 2*(10 + 4) = 36.5;
    # M_t = max(12.5, 70, 20, 30) = 70 (a max over layers, not a sum, not times B).
    assert predict_memory(node, 1, 4) == pytest.approx(201 + 36.5 + 70)
    # p = 1: M_w = 100 + 60 + 2*208 = 576; M_a = 10 + 6 + 2*44 = 104; M_t = max(50, 70, 80, 30) = 80
    assert predict_memory(node, 4, 4) == pytest.approx(576 + 104 + 80)
    assert predict_memory(node, 0, 4) == pytest.approx(60 + 16 + 6 + 8 + 70)


def test_affine_time_pays_intercept_only_with_units():
    node = node_cost(PROFILE, fit="affine")
    assert node.t_icpt == pytest.approx(2 * 0.025)
    assert predict_time(node, 1, 4) == pytest.approx(0.1 + 0.2 + 2 * (0.025 + 0.075 + 0.05))
    assert predict_time(node, 0, 4) == pytest.approx(0.3)  # 0 units: no partitioned cost at all
    # Memory does not depend on the time fit.
    assert predict_memory(node, 3, 4) == predict_memory(node_cost(PROFILE, "linear"), 3, 4)


def test_time_and_memory_monotone_in_units():
    for fit in ("affine", "linear"):
        node = node_cost(PROFILE, fit)
        t = [predict_time(node, h, 16) for h in range(17)]
        m = [predict_memory(node, h, 16) for h in range(17)]
        assert t == sorted(t) and m == sorted(m)


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
    bad = NodeProfile("nX", 1, (layer("attn", "blk", True, 0.3, 1, 1, 1, [(1.0, 0.3)]),))
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


def test_bad_units():
    node = node_cost(PROFILE)
    with pytest.raises(ValueError, match="units"):
        predict_time(node, 5, 4)
    with pytest.raises(ValueError, match="H"):
        predict_memory(node, 0, 0)
    with pytest.raises(ValueError, match="fit"):
        node_cost(PROFILE, "quadratic")


def test_gateway_modules_do_not_import_torch():
    code = ("import sys; import xronos.gateway.costmodel, xronos.gateway.planner, "
            "xronos.gateway.profiles; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
