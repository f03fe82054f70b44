"""The background-load scenario's pure parts: the even start layout, the layouts a run went
through, the measured bound after the change, and the summary of a run."""

from __future__ import annotations

import pytest

from xronos.bench.background_load import even_layout, layout_at, measured_bound, segments, summarize, table
from xronos.protocol.layout import Layout, Sizes

KINDS = ("attn", "mlp", "vocab")
START = Layout(attn=(6, 6), mlp=(64, 64), vocab=(100, 100))
MOVED = Layout(attn=(3, 9), mlp=(32, 96), vocab=(50, 150))
PARAMS = {"attn": 1200, "mlp": 1280, "vocab": 2000}


def test_even_layout_splits_every_kind_on_its_quantum():
    sizes = Sizes(attn=16, mlp=4096, vocab=50257)
    lay = even_layout(sizes, 3)
    lay.check(sizes, world_size=3)
    assert lay.attn == (6, 5, 5) and lay.mlp == (1376, 1376, 1344) and sum(lay.vocab) == 50257


def _rec(step, per_kind, rest=0.01, comm=0.05, data=0.01):
    total = sum(per_kind.values()) + rest + comm + data
    return {"step": step, "iteration_s": total, "comm_s": comm, "data_s": data, "compute_rest_s": rest,
            **{f"compute_{k}_s": v for k, v in per_kind.items()}}


def _cost(speed, lay, d):
    """True per-kind compute of rank d: 0.01 s replicated + 0.01 s per head, 0.001 per column, 0 per row."""
    return {"attn": (0.01 + 0.01 * lay.attn[d]) / speed, "mlp": (0.01 + 0.001 * lay.mlp[d]) / speed,
            "vocab": 0.002 / speed}


def _doc(steps, change_at, move_at=None):
    """Rank 0 halves its speed at change_at; a live run moves to MOVED at move_at."""
    ranks = []
    for d in range(2):
        its = []
        for s in range(steps):
            lay = MOVED if move_at is not None and s >= move_at else START
            speed = 0.5 if d == 0 and s >= change_at else 1.0
            its.append(_rec(s, _cost(speed, lay, d)))
        ranks.append({"iterations": its})
    doc = {"ranks": ranks, "reshards": []}
    if move_at is not None:
        doc["reshards"] = [{"step": move_at, "seconds": 0.5, "moved_bytes": 10, "new": MOVED.to_text()}]
        doc["rebalance"] = {"replans": [{"step": move_at}], "last_reason": "x", "boundary_s_mean": 0.001,
                            "policy_s_mean": 0.0005}
    return doc


def test_layouts_and_segments_after_the_change():
    doc = _doc(20, 5, move_at=9)
    assert layout_at(START, doc["reshards"], 8) == START and layout_at(START, doc["reshards"], 9) == MOVED
    (a, ia), (b, ib) = segments(doc, START, 5)
    assert a == START and ia == [6, 7, 8] and b == MOVED and ib == list(range(10, 20))  # transients left out


def test_the_measured_bound_fits_each_rank_over_the_layouts_after_the_change():
    static, live = _doc(20, 5), _doc(20, 5, move_at=9)
    bound = measured_bound([static, live], START, 5, PARAMS)
    # attn: rank 0 (0.02 + 0.02 h), rank 1 (0.01 + 0.01 h), 12 heads: balance T = 0.02 + 0.02 h0 =
    # 0.01 + 0.01 (12 - h0) -> h0 = 3.67 -> T = 0.0933; in whole heads h0 = 4: 0.1, h0 = 3: 0.1 -> 0.1.
    assert bound["per_kind_s"]["attn"] == pytest.approx(0.02 + 0.02 * 11 / 3, rel=1e-6)
    assert bound["attn_whole_units_s"] == pytest.approx(0.1, rel=1e-6)
    # mlp: 0.02 + 0.002 c0 = 0.01 + 0.001 (128 - c0) -> c0 = 39.33 -> T = 0.0987
    assert bound["per_kind_s"]["mlp"] == pytest.approx(0.02 + 0.002 * 118 / 3, rel=1e-6)
    assert bound["compute_whole_heads_s"] == pytest.approx(
        bound["compute_s"] - bound["per_kind_s"]["attn"] + 0.1, rel=1e-9)


def test_summary_against_the_bound_recovery_and_moves():
    static, live = _doc(30, 10), _doc(30, 10, move_at=13)
    bound = measured_bound([static, live], START, 10, PARAMS)["compute_whole_heads_s"]
    s, x = summarize(static, 10, bound), summarize(live, 10, bound)
    assert s["ideal_after_s"] == pytest.approx(bound + 0.06) and s["comm_data_after_s"] == pytest.approx(0.06)
    assert s["after_over_ideal"] > 1.10 and s["iterations_to_recover"] is None
    assert x["after_s"] < s["after_s"] and x["iterations_to_recover"] == 3
    assert x["reshards"][0]["over_iteration"] == pytest.approx(0.5 / x["after_s"])
    text = table({"quota/static": s, "quota/live": x})
    assert f"| quota | live | {x['before_s']:.3f} | {x['after_s']:.3f} | {x['ideal_after_s']:.3f} |" in text
    per_boundary = f"{100 * 0.0005 / x['before_s']:.2f} % / {100 * 0.001 / x['before_s']:.2f} %"
    assert "| never | - | - / - |" in text and f"0.50 s ({0.5 / x['after_s']:.1f}x) at 13 | {per_boundary} |" in text
