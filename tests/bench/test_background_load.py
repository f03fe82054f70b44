"""The background-load scenario's pure parts: the even start layout and the summary of a run."""

from __future__ import annotations

import pytest

from xronos.bench.background_load import even_layout, summarize, table
from xronos.protocol.layout import Sizes


def test_even_layout_splits_every_kind_on_its_quantum():
    sizes = Sizes(attn=16, mlp=4096, vocab=50257)
    lay = even_layout(sizes, 3)
    lay.check(sizes, world_size=3)
    assert lay.attn == (6, 5, 5) and lay.mlp == (1376, 1376, 1344) and sum(lay.vocab) == 50257


def _doc(times, replan_at=None):
    its = [{"iteration_s": t} for t in times]
    doc = {"ranks": [{"iterations": its}, {"iterations": [{"iteration_s": t * 0.9} for t in times]}],
           "reshards": []}
    if replan_at is not None:
        doc["rebalance"] = {"replans": [{"step": replan_at}], "last_reason": "x", "boundary_s_mean": 0.001}
        doc["reshards"] = [{"step": replan_at, "seconds": 0.5, "moved_bytes": 10, "new": "attn=1"}]
    return doc


def test_summary_reads_before_after_recovery_and_moves():
    # 1.0 s before the change at 10, 1.5 s after; the live run re-plans at 13 and runs at 1.2 s.
    static = summarize(_doc([1.0] * 10 + [1.5] * 20), 10)
    live = summarize(_doc([1.0] * 10 + [1.5] * 3 + [1.2] * 17, 13), 10)
    assert static["before_s"] == 1.0 and static["after_s"] == 1.5 and static["iterations_to_recover"] is None
    assert static["ideal_after_s"] == pytest.approx(1.2) and static["after_over_ideal"] == pytest.approx(1.25)
    assert live["after_s"] == 1.2 and live["iterations_to_recover"] == 3
    assert live["reshards"][0]["over_iteration"] == 0.5
    text = table({"quota/static": static, "quota/live": live})
    assert "| quota | live | 1.000 | 1.200 | 1.00 | 3 | 0.50 s (0.5x) at 13 | 0.10 % |" in text
    assert "| quota | static | 1.000 | 1.500 | 1.25 | never | - | - |" in text
