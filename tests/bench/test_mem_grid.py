"""bench/mem_grid: a grid cell's per-rank peak recomputed from its own profiles."""

import json

import pytest

from xronos.bench.mem_grid import RESULTS, cell_rows, remeasured

CELL = RESULTS / "set-b_gpt2-medium_s32_b6.json"
FRESH = RESULTS / "mem-profiles"


def test_every_rank_of_every_tp_strategy_against_its_measured_peak():
    doc = json.loads(CELL.read_text())
    rows = cell_rows(doc)
    assert {r["strategy"] for r in rows} == {"xronos", "xronos-paper", "uniform"} and len(rows) == 12
    for row in rows:
        raw = doc["strategies"][row["strategy"]]["raw"]
        assert row["measured"] == raw["memory"][row["rank"]]["peak_rss_bytes"]
        assert row["layout"]["vocab"] == raw["ranks"][row["rank"]]["vocab"]
        assert row["error"] == pytest.approx(100 * (row["predicted"] - row["measured"]) / row["measured"])
        assert (row["terms"]["O"] > 0) == (row["rank"] == 0)  # the owner's data stack, no export


def test_remeasured_takes_the_version_8_fields_only_and_refuses_another_shape():
    doc = json.loads(CELL.read_text())
    report = doc["profiles"]["Raspberry Pi 5"]["tp"]
    fresh = json.loads((FRESH / "gpt2-medium_s32.json").read_text())
    mixed = remeasured(report, fresh)
    assert [lay["temp_bytes"] for lay in mixed["layers"]] == [lay["temp_bytes"] for lay in fresh["layers"]]
    assert [lay["weight_bytes"] for lay in mixed["layers"]] == [lay["weight_bytes"] for lay in report["layers"]]
    assert mixed["runtime_bytes"] == report["runtime_bytes"] and mixed["heap_slack_bytes"] == fresh["heap_slack_bytes"]
    # the fresh profiles fixed the per-layer M_t artifact: below the parameters' bytes
    assert all(lay["temp_bytes"] < lay["param_bytes"] for lay in mixed["layers"] if lay["param_bytes"] > 64 << 20)
    other = json.loads((FRESH / "roberta-base_s64.json").read_text())
    with pytest.raises(ValueError, match="differs"):
        remeasured(report, other)


def test_the_re_measured_peaks_replace_the_recorded_ones_per_strategy_and_rank():
    """`--measured`: the peaks of a `--rerun` (bench/results/mem-rerun-v10.json), the prediction
    the same."""
    from xronos.bench.mem_grid import tp_layouts

    doc = json.loads(CELL.read_text())
    peaks = json.loads((RESULTS / "mem-rerun-v10.json").read_text())[CELL.stem]
    layouts = tp_layouts(doc)
    assert set(layouts) == set(peaks) == {"xronos", "xronos-paper", "uniform"}
    assert layouts["uniform"].startswith("attn=") and layouts["uniform"].count(";") == 2
    recorded, rerun = cell_rows(doc), cell_rows(doc, peaks=peaks)
    for old, new in zip(recorded, rerun):
        assert (old["strategy"], old["rank"], old["predicted"]) == (new["strategy"], new["rank"], new["predicted"])
        assert new["measured"] == peaks[new["strategy"]][new["rank"]]
    # the loader's file maps are gone from the re-measured peaks: every rank lower, none higher
    assert all(new["measured"] < old["measured"] for old, new in zip(recorded, rerun))
