"""`xronos bench` refuses bad input up front (nothing written), and the result maths is right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xronos.bench.results import atomic_write, summarize
from xronos.bench.cellreport import markdown
from xronos.cli.main import main

GOOD = ["bench", "--scenario", "set-a", "--model", "gpt2-medium", "--blocks", "1", "--iters", "3"]


@pytest.mark.parametrize("change, message", [
    ({"--scenario": "set-z"}, "unknown scenario 'set-z'"),
    ({"--model": "gpt5"}, "unknown model 'gpt5'"),
    ({"--strategies": "xronos,magic"}, "unknown strategies ['magic']"),
    ({"--iters": "2", "--warmup": "2"}, "must exceed the 2 warm-up"),
    ({"--seq-len": "5000"}, "exceeds what gpt2-medium can take"),
    ({"--blocks": "99"}, "--blocks must be an integer in [1, 24]"),
    # 1.5 cores for the MiniPC + 2 Pis = 3.5: more than a quota can give; a virtual box may be any speed
    ({"--unit-share": "1.0", "--cpu-mode": "quota"}, "exceeds the 2 cores"),
    ({"--unit-share": "nan"}, "unit share must be > 0"),
    ({"--bandwidth-mbit": "0"}, "means nothing on the virtual clock, which models the link"),
    ({"--estimator": "q200"}, "estimator must be one of min, med, mean, raw or qNN"),
    ({"--mem-scale": "2"}, "--mem-scale must be a number in (0, 1]"),
    ({"--bandwidth-mbit": "-5"}, "--bandwidth-mbit must be a number >= 0 (0 = loopback)"),
    ({"--bandwidth-mbit": "nan"}, "--bandwidth-mbit must be a number >= 0 (0 = loopback)"),
    ({"--bandwidth-mbit": "0.5"}, "network rate 0.5 Mbit/s is outside 1 .. 100000"),
])
def test_bad_input_refused_before_anything_is_written(tmp_path: Path, capsys, change, message) -> None:
    args = list(GOOD)
    for k, v in change.items():
        if k in args:
            args[args.index(k) + 1] = v
        else:
            args += [k, v]
    assert main(args + ["--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_cell_nothing_fits_is_reported_infeasible_without_running(tmp_path: Path, capsys) -> None:
    # 1.3 B parameters (21 GiB of weights, grads and AdamW state) against 1/8 of Set-A's RAM.
    args = ["bench", "--scenario", "set-a", "--model", "mobilellama-1.4b", "--blocks", "24", "--iters", "3",
            "--mem-scale", "1/8", "--no-plots", "--out", str(tmp_path)]
    assert main(args) == 0  # a result, not an error
    doc = json.loads((tmp_path / "set-a_mobilellama-1.4b_s32_b24.json").read_text())
    assert doc["environment"]["clock"] == "virtual" and doc["environment"]["estimator"] == "min"
    assert set(doc["strategies"]) == {"xronos", "uniform", "pp", "hf-tp"}
    assert all("needs at least" in e["infeasible"] for e in doc["strategies"].values())
    assert "| xronos | INFEASIBLE: mobilellama-1.4b with 24 blocks needs at least" in capsys.readouterr().out


def _doc() -> dict:
    def tp(units, its, idle):
        return [{"device": d, "units": u, "iterations": [
            {"iteration_s": t, "compute_s": t - i - 0.1, "comm_s": 0.1, "idle_s": i, "data_s": 0.0,
             "voluntary_ctx_switches": 10, "involuntary_ctx_switches": 5, "peak_rss": 2**30}] * 3}
            for d, (u, t, i) in enumerate(zip(units, its, idle))]

    def plan(units, pred):
        return {"rows": [{"units": u, "predicted_compute_s": p} for u, p in zip(units, pred)],
                "predicted_iteration_s": max(pred) + 0.1, "ideal_compute_s": 1.5}

    return {
        "spec": {"cell_name": "c", "warmup": 1, "batch_size": 8, "seq_len": 32, "lr": 2e-5, "iters": 3,
                 "micro_batches": 8},
        "environment": {"cpu_model": "x", "cores": 2, "torch": "t", "cgroup_version": 1,
                        "loadavg_start": [0, 0, 0], "loadavg_end": [0, 0, 0]},
        "scenario": {"name": "set-a", "devices": [{"name": n, "speed": s} for n, s in
                                                  [("MiniPC", 1.5), ("Pi", 1), ("Pi", 1)]],
                     "shares": [0.45, 0.3, 0.3], "memory_caps": [None] * 3,
                     "ideal_ratio_to_uniform_from_speeds": 0.857},
        "model": {"name": "m", "blocks": 1, "paper_blocks": 24, "parameters": 1e6},
        "strategies": {
            "xronos": {"plan": plan([8, 4, 4], [1.6, 1.6, 1.6]), "raw": {"ranks": tp([8, 4, 4], [1.8] * 3, [0.0, 0.05, 0.05])}},
            "uniform": {"plan": plan([6, 5, 5], [1.2, 2.0, 2.0]), "raw": {"ranks": tp([6, 5, 5], [2.2] * 3, [0.8, 0.0, 0.0])}},
            "hf-tp": {"not_run": "hf-tp is run for the LLaMA architecture only"},
        },
    }


def test_summary_ratios_and_table() -> None:
    doc = summarize(_doc())
    x, u = doc["summary"]["xronos"], doc["summary"]["uniform"]
    assert x["iteration_s"] == pytest.approx(1.8) and u["max_idle_ratio"] == pytest.approx(0.8 / 2.2)
    assert doc["ratios"]["xronos/uniform"] == pytest.approx(1.8 / 2.2)
    assert doc["ratios"]["xronos/ideal (profile)"] == pytest.approx(1.8 / 1.6)  # ideal 1.5 + comm 0.1 + data 0
    # Measured fits on the share w = units / 16 (no per-kind metrics here): MiniPC 1.7 s @ 8/16,
    # 1.3 s @ 6/16 -> a = 0.1, b = 3.2 (kappa = a/b = 1/32); Pis 1.65 @ 4/16, 2.1 @ 5/16 give a < 0,
    # so b = mean t / (kappa + mean w), a = kappa b. Balance: sum (T - a)/b = 1, T >= every a.
    bp = 1.875 / (1 / 32 + 4.5 / 16)
    T = (1 + 0.1 / 3.2 + 2 * (bp / 32) / bp) / (1 / 3.2 + 2 / bp)
    assert doc["summary"]["xronos"]["ideal_measured_s"] == pytest.approx(T + 0.1)
    assert doc["ratios"]["xronos gain captured"] == pytest.approx((2.2 - 1.8) / (2.2 - 1.6))
    assert x["mape_pct"] == pytest.approx(100 * (0.1 / 1.7 + 2 * 0.05 / 1.65) / 3)  # measured 1.7/1.65/1.65
    md = markdown(doc)
    assert "| hf-tp | not run: hf-tp is run for the LLaMA architecture only" in md
    assert "1 of 24 transformer blocks" in md and "units 8/4/4" in md
    assert "- Network: **loopback (unlimited)**" in md  # a result from before the network emulator
    doc["spec"]["bandwidth_mbit"] = 1000.0
    assert "- Network: **1 Gbit/s per rank link, both directions" in markdown(doc)
    json.dumps(doc)  # the result document is plain JSON


def test_atomic_write_leaves_nothing_on_failure(tmp_path: Path) -> None:
    atomic_write(tmp_path / "a.json", b"{}")
    with pytest.raises(TypeError):
        atomic_write(tmp_path / "b.json", "not bytes")  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]
