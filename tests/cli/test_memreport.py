"""Predicted vs measured peak memory per rank (`xronos run --strategy`'s memory judgement)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from xronos.cli.memreport import format_memory, judge_memory

MiB = 1 << 20


def test_judge_memory_per_rank_and_mape() -> None:
    rows = [SimpleNamespace(rank=0, predicted_memory=1100 * MiB, memory_cap=1 << 50),
            SimpleNamespace(rank=1, predicted_memory=450 * MiB, memory_cap=600 * MiB)]
    doc = {"memory": {"peak_rss_bytes": [1000 * MiB, 500 * MiB]},
           "ranks": [{"summary": {"peak_rss": 900 * MiB}}, {"summary": {"peak_rss": 500 * MiB}}]}
    j = judge_memory(rows, doc)
    assert [r["error_pct"] for r in j["ranks"]] == pytest.approx([10.0, -10.0])
    assert j["mape_pct"] == pytest.approx(10.0)
    assert j["ranks"][0]["train_peak_rss_bytes"] == 900 * MiB
    text = format_memory(j)
    assert "peak-memory prediction MAPE 10.00%" in text and "+10.0%" in text and "600" in text


def test_judge_memory_without_peaks_is_none() -> None:
    assert judge_memory([], {"ranks": []}) is None
