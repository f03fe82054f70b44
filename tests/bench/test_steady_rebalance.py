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
    ranks = [{"iterations": [{"iteration_s": t * (1 - 0.1 * d), **{f"compute_{k}_s": row[d][k] for k in KINDS},
                              "compute_rest_s": 0.05}
                             for row, t in zip(rows, iteration_s)]} for d in range(len(rows[0]))]
    return {"ranks": ranks, **({"rebalance": rebalance} if rebalance else {})}


def _rows(layout, slow, icpt=0.0, n=6):
    """Rank d's kind k: (icpt + share) x slow[d] seconds (icpt only where it holds some)."""
    return [[{k: (icpt + layout.share(k, d)) * slow[d] if layout.share(k, d) else 0.0 for k in KINDS}
             for d in range(len(slow))]] * n


def test_calibrated_layout_balances_the_measured_speeds():
    start = proportional_layout(SIZES, [1.0, 1.0])  # even: but rank 1 is twice as slow
    lay = calibrated_layout([(start, _rows(start, [1.0, 2.0]))], SIZES)
    assert lay.mlp[0] == pytest.approx(2 * lay.mlp[1], rel=0.05) and lay.attn in ((11, 5), (10, 6))
    with pytest.raises(ValueError, match="calibration: 1 iterations at the last stage measured nothing"):
        calibrated_layout([(start, _rows(start, [1.0, 2.0], n=1))], SIZES)


def test_a_second_calibration_stage_learns_the_intercepts():
    """With a replicated part (0.2 of a kind per node), the first stage's proportional estimate
    under-gives the fast rank; the second, at another share, corrects it."""
    start = proportional_layout(SIZES, [1.0, 1.0])
    first = calibrated_layout([(start, _rows(start, [1.0, 2.0], icpt=0.2))], SIZES)
    second = calibrated_layout([(start, _rows(start, [1.0, 2.0], icpt=0.2)),
                                (first, _rows(first, [1.0, 2.0], icpt=0.2))], SIZES)
    # the truth: (0.2 + x) = 2 (0.2 + 1 - x) -> x = 2.2 / 3 = 0.733 of each kind on rank 0
    assert second.mlp[0] / 4096 == pytest.approx(2.2 / 3, abs=0.02)
    assert abs(second.mlp[0] / 4096 - 2.2 / 3) < abs(first.mlp[0] / 4096 - 2.2 / 3)


def test_compare_reads_replans_medians_and_the_policy_cost():
    rows = [[dict.fromkeys(KINDS, 0.1), dict.fromkeys(KINDS, 0.1)]] * 10
    static = _doc(rows, [5.0] * WARMUP + [1.0] * 7)
    live = _doc(rows, [5.0] * WARMUP + [1.02] * 7,
                {"replans": [], "last_reason": "kept: predicted gain 1.0% <= 9.0%", "policy_s_mean": 0.002,
                 "boundary_s_mean": 0.004, "decisions": 9, "setup_s": 0.1})
    assert per_kind(static)[0][1] == {**dict.fromkeys(KINDS, 0.1), "rest": 0.05}
    r = compare(static, live)
    assert r["replans"] == [] and r["median_off_s"] == 1.0 and r["on_over_off"] == pytest.approx(1.02)
    assert r["policy_over_iteration"] == pytest.approx(0.002 / 1.02)
    assert r["boundary_over_iteration"] == pytest.approx(0.004 / 1.02)


def test_calibration_books_the_rest_by_the_parameters_held():
    """Rank 1 is twice as slow in its optimizer step only (the rest): booked to the kinds by the
    parameters held, it makes rank 1 slower there too."""
    start = proportional_layout(SIZES, [1.0, 1.0])
    rows = [[{**{k: start.share(k, d) for k in KINDS}, "rest": (1.0 + d) * 2.0} for d in range(2)]] * 6
    plain = calibrated_layout([(start, [[{k: r[k] for k in KINDS} for r in row] for row in rows])], SIZES)
    booked = calibrated_layout([(start, rows)], SIZES, {"attn": 1.0, "mlp": 1.0, "vocab": 1.0})
    assert plain.mlp[0] == plain.mlp[1] and booked.mlp[0] > booked.mlp[1]
