"""The wall-vs-virtual overlap check's arithmetic and table (its timed runs are the bench's), and
one tiny run of it through a real netns link, both clocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xronos.bench import overlap_wall
from xronos.bench.overlap import iteration_of
from xronos.bench.overlap_wall import fitted_mbit, gain_points, markdown, pair_rows, summarise


def _run(medians: dict[str, float], share: float = 0.4, n: int = 10) -> dict:
    return {"modes": list(medians), **{m: {"median_s": s, "min_s": s * 0.9, "max_s": s * 1.1, "n": n,
                                          "exposed_comm_share": share, "compute_s": s / 2, "thread_cpu_s": s / 2,
                                          "others_cpu_s": s / 10} for m, s in medians.items()}}


def test_gain_difference_is_wall_gain_minus_virtual_gain_in_points():
    assert gain_points(0.80, 0.85) == pytest.approx(5.0)  # wall gains 20 %, virtual 15 %
    assert gain_points(0.95, 0.85) == pytest.approx(-10.0)
    assert gain_points(1.0, 1.0) == 0.0


def test_the_fitted_rate_is_what_makes_the_models_all_reduce_take_the_measured_time():
    from xronos.node.emulate.link import Link

    rate = fitted_mbit(786432, 9.0e-3, 0.4e-3)
    assert rate == pytest.approx(786432 * 8 / 8.6e-3 / 1e6)  # two ranks: each link carries the bytes once
    assert Link.mbit(rate, 0.4e-3).seconds("all_reduce_sum", 786432, 2) == pytest.approx(9.0e-3)
    assert Link.mbit(fitted_mbit(1000, 2e-3, 1e-3, world=3), 1e-3).seconds("all_reduce_sum", 1000, 3) \
        == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="took 0.000300 s, not more than the per-call latency 0.000400 s"):
        fitted_mbit(4, 0.3e-3, 0.4e-3)


def test_pair_rows_ratio_each_clock_to_its_own_off():
    rows = pair_rows(_run({"off": 0.60, "bwd": 0.57, "c2": 0.48}), _run({"off": 0.40, "bwd": 0.38, "c2": 0.34}, n=8))
    assert [r["mode"] for r in rows] == ["off", "bwd", "c2"]
    off, bwd, c2 = rows
    assert (off["wall_ratio"], off["virtual_ratio"], off["gain_diff_points"]) == (1.0, 1.0, 0.0)
    assert bwd["wall_ratio"] == pytest.approx(0.95) and bwd["virtual_ratio"] == pytest.approx(0.95)
    assert bwd["gain_diff_points"] == pytest.approx(0.0)
    assert c2["wall_ratio"] == pytest.approx(0.80) and c2["virtual_ratio"] == pytest.approx(0.85)
    assert c2["gain_diff_points"] == pytest.approx(5.0)
    assert c2["wall_s"] == 0.48 and c2["virtual_s"] == 0.34 and c2["n"] == 8  # the fewer of the two runs


def test_pair_rows_refuses_runs_of_different_modes():
    with pytest.raises(ValueError, match=r"modes differ: wall \['off', 'bwd'\], virtual \['off', 'c2'\]"):
        pair_rows(_run({"off": 1.0, "bwd": 0.9}), _run({"off": 1.0, "c2": 0.9}))


def test_summary_over_repeats_means_spreads_and_the_five_point_bound():
    reps = [pair_rows(_run({"off": 1.0, "c2": w}), _run({"off": 1.0, "c2": v}))
            for w, v in ((0.80, 0.86), (0.90, 0.86), (0.85, 0.86))]
    (s,) = summarise(reps)
    assert s["mode"] == "c2" and s["runs"] == 3
    assert s["wall_ratio"] == pytest.approx(0.85) and s["wall_spread"] == pytest.approx(0.10 / 0.85)
    assert s["virtual_ratio"] == pytest.approx(0.86) and s["virtual_spread"] == pytest.approx(0.0)
    assert s["gain_diff_points"] == pytest.approx(1.0)
    assert (s["gain_diff_min"], s["gain_diff_max"]) == (pytest.approx(-4.0), pytest.approx(6.0))
    assert s["within"] is True
    (far,) = summarise([pair_rows(_run({"off": 1.0, "c2": 0.99}), _run({"off": 1.0, "c2": 0.86}))])
    assert far["gain_diff_points"] == pytest.approx(-13.0) and far["within"] is False


def test_wall_iteration_runs_from_the_first_rank_out_of_the_barrier_to_the_last_end():
    rows = [{"iteration_s": 0.50, "w0": 10.000, "w1": 10.500}, {"iteration_s": 0.49, "w0": 10.002, "w1": 10.492}]
    assert iteration_of(rows, wall=True) == pytest.approx(0.500)
    rows[1]["w1"] = 10.520
    assert iteration_of(rows, wall=True) == pytest.approx(0.520)
    assert iteration_of(rows, wall=False) == 0.50  # virtual: every rank starts at the same base


def test_the_table_names_both_clocks_the_link_the_load_and_the_gain_difference():
    reps = [pair_rows(_run({"off": 0.6, "c2": 0.51}), _run({"off": 0.4, "c2": 0.36}))]
    doc = {"argv": ["--cells", "pair-s64"], "rate_mbit": 1000.0, "order": "back to back in pairs",
           "load_start": "load average: 0.31, 0.5, 0.6", "load_end": "load average: 1.02, 0.7, 0.6",
           "quota": "-1 / 100000", "seconds": 90.0,
           "link": {"latency_s": 150e-6, "calls": 200, "loops": 7, "single_s": 140e-6, "big_bytes": 786432,
                    "big_s": 7.1e-3, "big_calls": 30, "big_model_s": 6.44e-3},
           "cells": [{"cell": "pair-s64", "repeats": reps, "summary": summarise(reps)}]}
    text = markdown(doc)
    assert "**wall**" in text and "**virtual**" in text and "150 us a call" in text
    assert "took 7.10 ms on the real link" in text and "the model says 6.44 ms" in text
    assert "load average: 0.31" in text and "load average: 1.02" in text and "-1 / 100000" in text
    assert "| pair-s64 | 1 | c2 | 0.5100 (0.4590, 0.5610) | 0.850 | 0.3600 (0.3240, 0.3960) | 0.900 | +5.0 | 40% / 40% | 0.255 / 0.180 | 0.255 / 0.051 | 0.180 / 0.036 | 10 |" in text
    assert "| pair-s64 | c2 | **0.850** | 0.0% | **0.900** | 0.0% | **+5.0** (+5.0 .. +5.0) | yes |" in text
    assert "fitted link" not in text
    assert "charges no network-stack CPU beyond the calls' measured CPU." in text
    assert "raises Gloo's threads to SCHED_FIFO 1" in markdown(dict(doc, comm_threads="fifo"))
    assert "(XRONOS_COMM_THREADS=off)" in markdown(dict(doc, comm_threads="off"))
    stack = {"sizes": {"393216": {"real_steal_s": 1.1e-3, "loop_charge_s": 0.3e-3}}, "stack_s_per_byte": 2.03e-9}
    assert ("charges each end 2.03 ns of CPU a byte carried" in markdown(dict(doc, stack=stack, stack_s_per_byte=2.03e-9))
            and "393 kB 0.80 ms" in markdown(dict(doc, stack=stack, stack_s_per_byte=2.03e-9)))
    probed = dict(stack, progress_s=5.5e-3)
    assert "completes 5.50 ms late while its rank computes" in markdown(dict(doc, stack=probed, stack_s_per_byte=2.03e-9,
                                                                             progress_s=5.5e-3))
    assert "No progress delay is modelled (the probe measured 5.50 ms)" in markdown(
        dict(doc, stack=probed, stack_s_per_byte=2.03e-9, progress_s=0.0))
    fits = [pair_rows(_run({"off": 0.6, "c2": 0.51}), _run({"off": 0.5, "c2": 0.41}))]
    doc["cells"][0].update(repeats_fitted=fits, summary_fitted=summarise(fits))
    text = markdown(dict(doc, fit_mbit=712.4))
    assert "**virtual on the fitted link**: the measured latency and 712 Mbit/s" in text
    assert text.endswith("| pair-s64 | c2 | **0.850** | 0.0% | **0.820** | 0.0% | **-3.0** (-3.0 .. -3.0) | yes |\n")


def test_refuses_cells_of_more_than_two_ranks_and_a_baseline_other_than_off(capsys):
    with pytest.raises(SystemExit):
        overlap_wall.main(["--cells", "n100x3-s64"])
    assert "need two-rank cells of pair-s64" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        overlap_wall.main(["--modes", "bwd,off"])
    assert "--modes must start with off" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        overlap_wall.main(["--stack", "off", "--progress", "probe"])
    assert "--progress probe takes the stack probe's figure" in capsys.readouterr().err


@pytest.fixture
def netns() -> None:
    from xronos.bench import netem
    from xronos.node.emulate.confinement import EmulatorError

    try:
        netem.check_available()
    except EmulatorError as exc:
        pytest.skip(f"network namespaces unavailable here: {exc}")


@pytest.mark.slow
def test_a_tiny_check_runs_both_clocks_and_they_train_the_same_numbers(netns, tmp_path: Path, monkeypatch):
    # Nothing timed is asserted: only that both runs happened as described, on their clocks, and
    # that the clock and the link under the ranks change no number the model computes.
    monkeypatch.setitem(overlap_wall.CELLS, "pair-tiny",
                        dict(speeds=[1.0, 1.0], shape="minilm", blocks=None, batch=2, seq=8, task="classify"))
    monkeypatch.setenv("XRONOS_BENCH_KEEP", "")
    assert overlap_wall.main(["--cells", "pair-tiny", "--modes", "off,c2", "--iters", "1", "--warmup", "1",
                              "--repeats", "1", "--stack-reps", "5", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "overlap-wall.json").read_text())
    # the stack probe ran on the real link and on loopback, and its slope went to the virtual runs
    assert sorted(doc["stack"]["sizes"]) == sorted(str(n) for n in (6144, 12288, 24576, 49152))
    assert doc["stack_s_per_byte"] == doc["stack"]["stack_s_per_byte"] >= 0
    # the probe's progress delay is measured and reported, and modelled only with --progress probe
    assert doc["stack"]["progress_s"] >= 0 and doc["progress_s"] == 0.0
    assert doc["network"]["rate_mbit"] == 1000.0 and doc["network"]["kind"] == "netns"
    assert 0 < doc["link"]["latency_s"] < 0.1 and doc["link"]["big_bytes"] == 2 * 8 * 384 * 4
    (cell,) = doc["cells"]
    (run,) = cell["runs"]
    for mode in ("off", "c2"):
        assert run["wall"][mode]["n"] == run["virtual"][mode]["n"] == 1
    assert [r["mode"] for r in cell["repeats"][0]] == ["off", "c2"]
    assert "| pair-tiny | c2 |" in (tmp_path / "overlap-wall.md").read_text()
    assert "losses" in run["wall"] and run["wall"]["losses"] == pytest.approx(run["virtual"]["losses"], abs=1e-6)
