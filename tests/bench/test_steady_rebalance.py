"""The steady-cell bench's pure parts: the proportional and the calibrated start layout, and the
side-by-side figures of the two runs."""

from __future__ import annotations

import pytest

from xronos.bench.steady_rebalance import WARMUP, calibrated_layout, compare, per_kind, proportional_layout
from xronos.protocol.layout import KINDS, Sizes

SIZES = Sizes(attn=16, mlp=4096, vocab=50257)


def test_proportional_layout_follows_the_shares_on_every_quantum():
    lay = proportional_layout(SIZES, [0.6, 0.4, 0.4])
    lay.check(SIZES, world_size=3)
    assert lay.attn == (7, 5, 4) and abs(lay.mlp[0] - 4096 * 0.6 / 1.4) <= 32 and lay.vocab[1] - lay.vocab[2] <= 16


def _doc(rows, iteration_s, rebalance=None):
    ranks = [{"iterations": [{"iteration_s": t * (1 - 0.1 * d), **{f"compute_{k}_s": row[d][k] for k in KINDS}}
                             for row, t in zip(rows, iteration_s)]} for d in range(len(rows[0]))]
    return {"ranks": ranks, **({"rebalance": rebalance} if rebalance else {})}


def test_calibrated_layout_balances_the_measured_speeds():
    start = proportional_layout(SIZES, [1.0, 1.0])  # even: but rank 1 is twice as slow
    rows = [[{k: 1.0 * start.share(k, 0) for k in KINDS}, {k: 2.0 * start.share(k, 1) for k in KINDS}]] * 6
    lay = calibrated_layout(rows, start, SIZES)
    assert lay.mlp[0] == pytest.approx(2 * lay.mlp[1], rel=0.05) and lay.attn in ((11, 5), (10, 6))
    with pytest.raises(ValueError, match="calibration: 1 iterations measured nothing"):
        calibrated_layout(rows[:1], start, SIZES)


def test_compare_reads_replans_medians_and_the_policy_cost():
    rows = [[dict.fromkeys(KINDS, 0.1), dict.fromkeys(KINDS, 0.1)]] * 10
    static = _doc(rows, [5.0] * WARMUP + [1.0] * 7)
    live = _doc(rows, [5.0] * WARMUP + [1.02] * 7,
                {"replans": [], "last_reason": "kept: predicted gain 1.0% <= 9.0%", "policy_s_mean": 0.002,
                 "boundary_s_mean": 0.004, "decisions": 9, "setup_s": 0.1})
    assert per_kind(static)[0][1] == dict.fromkeys(KINDS, 0.1)
    r = compare(static, live)
    assert r["replans"] == [] and r["median_off_s"] == 1.0 and r["on_over_off"] == pytest.approx(1.02)
    assert r["policy_over_iteration"] == pytest.approx(0.002 / 1.02) and r["boundary_over_iteration"] == pytest.approx(0.004 / 1.02)
