"""`xronos run --strategy`: profile each rank, plan, train, judge the prediction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xronos.bench.plan_speed import synthetic_report
from xronos.cli import strategy
from xronos.cli.main import main


@pytest.mark.parametrize("strat", ["segment", "paper", "uniform"])
def test_judge_and_mape(strat: str) -> None:
    reports = [synthetic_report("fast", slowness=1.0), synthetic_report("slow", slowness=2.0)]
    result = strategy.plan_units(reports, strat, reserve_mb=0, batch_size=8, seq_len=32)
    if strat != "uniform":
        assert result.units[0] > result.units[1]  # the fast node takes more units
    pred = strategy.predictions(reports, result.layout)
    # Both fits, each rank at its own per-kind shares; the affine one is the plan's prediction.
    assert pred["affine"] == pytest.approx([r.predicted_compute_s for r in result.rows])
    assert pred["linear"] != pred["affine"]
    measured = [pred["affine"][0] * 1.1, pred["affine"][1] * 0.8]  # 10% and 20% off
    verdict = strategy.judge(result, reports, measured)
    assert verdict["mape_pct"] == pytest.approx((100 / 11 + 25) / 2)
    assert verdict["strategy"] == strat
    for kind in ("attn", "mlp", "vocab"):
        assert [r[kind] for r in verdict["ranks"]] == list(result.layout.counts(kind))
        assert verdict["layout"][kind] == list(result.layout.counts(kind))
    assert verdict["ranks"][0]["error_pct"] == pytest.approx(100 * (1 / 1.1 - 1))
    assert verdict["mape_linear_pct"] >= 0 and set(verdict["segment_s"]) == {"attn", "mlp", "vocab", "out"}
    text = strategy.format_judgement(verdict)
    assert "MAPE" in text and "attn" in text and "vocab" in text
    assert strategy.mape([1.0, 3.0], [2.0, 2.0]) == pytest.approx(50.0)
    # Communication: the plan's all-reduce time against each rank's measured comm_s.
    c = result.comm_s
    both = strategy.judge(result, reports, measured, [c / 2, c * 2])
    assert [r["predicted_comm_s"] for r in both["ranks"]] == [c, c]
    assert both["ranks"][0]["comm_error_pct"] == pytest.approx(100.0)
    assert both["comm_mape_pct"] == pytest.approx((100 + 50) / 2)
    assert both["quantities"]["comm"]["mape_pct"] == both["comm_mape_pct"]
    assert both["quantities"]["compute"]["mape_pct"] == both["mape_pct"]
    assert "communication-time prediction MAPE 75.00%" in strategy.format_judgement(both)
    assert verdict["comm_mape_pct"] is None  # nothing measured, nothing claimed


def test_profiles_of_another_batch_refused() -> None:
    reports = [synthetic_report("a", batch_size=4)]
    with pytest.raises(ValueError, match="field batch_size: node a was profiled at batch_size 4, but the job runs 8"):
        strategy.plan_units(reports, "segment", reserve_mb=0, batch_size=8, seq_len=32)


def test_rank_profiles_of_other_job_settings_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """`xronos run --strategy` plans only with rank profiles that record the run's settings (a
    profile cache could hold another run's): a full fine-tune's profile for a LoRA run is refused,
    naming the rank and the field; LoRA's own plans."""
    from argparse import Namespace

    from xronos.protocol.messages import ProfileSettings

    from xronos.protocol.messages import LoraShape, LoraSpec, Recipe

    args = Namespace(nodes=2, profile_cache=None, strategy="segment", reserve_mb=0)
    recipe = Recipe(model_dir=".", data_path="d.jsonl", task="classify", batch_size=8, seq_len=32, lr=1e-3,
                    max_steps=1, lora=LoraSpec(r=8, targets=["c_proj", "c_attn"], dropout=0.05))
    lora = ProfileSettings(weight_decay=0.0, clip=True, lora=LoraShape(r=8, targets=["c_attn", "c_proj"], dropout=0.05))
    assert ProfileSettings.of_key(recipe.profile_key()) == lora  # targets sorted: their order trains the same
    full = ProfileSettings(weight_decay=0.0, clip=True, lora=None)
    given = {"rank0": lora, "rank1": full}
    monkeypatch.setattr(strategy, "profile_ranks", lambda *a, **k: [
        synthetic_report(f"rank{r}").model_copy(update={"settings": given[f"rank{r}"]}) for r in range(2)])
    with pytest.raises(ValueError, match="profile of rank1: field settings.lora: node rank1 was profiled at "
                                         r"lora None \(full fine-tuning\), but the job runs LoRA rank 8"):
        strategy.plan_run(args, recipe, 1, None)
    given["rank1"] = lora
    result, _ = strategy.plan_run(args, recipe, 1, None)
    assert len(result.rows) == 2


def test_parse_shares() -> None:
    assert strategy.parse_shares("1,0.45", 2) == [1.0, 0.45]
    with pytest.raises(ValueError, match="2 entries for --nodes 3"):
        strategy.parse_shares("1,0.45", 3)
    with pytest.raises(ValueError, match="comma-separated"):
        strategy.parse_shares("1;2", 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from xronos.bench.workloads import write_checkpoint, write_dataset

    root = tmp_path_factory.mktemp("strategy")
    cfg = dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=120, n_positions=32,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, bos_token_id=1,
               eos_token_id=1)
    return write_checkpoint(root / "m", cfg), write_dataset(root / "d.jsonl", 32, 8, 120)


def _args(tiny: tuple[Path, Path], tmp: Path) -> list[str]:
    model, data = tiny
    return ["run", "--model", str(model), "--data", str(data), "--task", "classify", "--nodes", "2",
            "--batch-size", "4", "--seq-len", "8", "--lr", "1e-3", "--max-steps", "4", "--seed", "0",
            "--max-grad-norm", "1.0", "--export", str(tmp / "out")]


def test_units_and_strategy_exclusive(tiny: tuple[Path, Path], tmp_path: Path,
                                      capsys: pytest.CaptureFixture) -> None:
    assert main([*_args(tiny, tmp_path), "--units", "2,2", "--strategy", "paper"]) == 2
    assert "either --layout/--units or --strategy" in capsys.readouterr().err
    assert main([*_args(tiny, tmp_path)]) == 2
    assert main([*_args(tiny, tmp_path), "--strategy", "segment", "--cpu-shares", "0.5"]) == 2
    assert "1 entries for --nodes 2" in capsys.readouterr().err


def test_an_over_cap_plan_is_refused_before_any_rank_starts(tiny: tuple[Path, Path], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture) -> None:
    """uniform ignores memory: a plan over a rank's cap is refused with each rank's need, cap and
    counts per kind, as the gateway refuses it, instead of starting ranks the kernel would kill."""
    from xronos.cli import run
    from xronos.gateway.plan.planner import MiB

    monkeypatch.setattr(strategy, "profile_ranks", lambda *a, **k: [
        synthetic_report("rank0", units=8, num_blocks=2, memory_available=300 * MiB, batch_size=4, seq_len=8),
        synthetic_report("rank1", units=8, num_blocks=2, memory_available=8192 * MiB, batch_size=4, seq_len=8)])
    monkeypatch.setattr(run, "_launch", lambda *a, **k: pytest.fail("launched an over-cap plan"))
    assert main([*_args(tiny, tmp_path), "--strategy", "uniform", "--reserve-mb", "0"]) == 2
    err = capsys.readouterr().err
    assert "the uniform plan exceeds memory caps: rank0 needs " in err, err
    assert "MiB of its 300 MiB cap holding 4 attention units, 2048 MLP columns, " in err and "rank1" not in err


@pytest.mark.slow
def test_run_with_strategy_reports_prediction(tiny: tuple[Path, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    metrics = tmp_path / "m.json"
    cache = tmp_path / "cache"
    rc = main([*_args(tiny, tmp_path), "--strategy", "segment", "--metrics", str(metrics),
               "--profile-cache", str(cache)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "compute-time prediction MAPE" in out
    doc = json.loads(metrics.read_text())
    pred = doc["prediction"]
    assert pred["strategy"] == "segment" and sum(pred["units"]) == 4
    for kind in ("attn", "mlp", "vocab"):
        assert list(doc["config"]["layout"][kind]) == pred["layout"][kind]
    assert [r["rank"] for r in pred["ranks"]] == [0, 1]
    for r in pred["ranks"]:
        assert r["predicted_compute_s"] > 0 and r["measured_compute_s"] > 0
    assert pred["mape_pct"] >= 0 and pred["mape_linear_pct"] >= 0
    assert pred["comm_mape_pct"] >= 0 and all(r["measured_comm_s"] > 0 and r["comm_cpu_s"] > 0 for r in pred["ranks"])
    # Peak memory: the planner's prediction (rank 0 the owner) against each rank's whole-life peak.
    assert "peak-memory prediction MAPE" in out
    peaks = doc["memory"]["peak_rss_bytes"]
    mem = doc["prediction_memory"]
    assert len(peaks) == 2 and all(p > 100 << 20 for p in peaks)
    assert [r["peak_rss_bytes"] for r in mem["ranks"]] == peaks
    for r in mem["ranks"]:
        assert r["predicted_peak_bytes"] > 100 << 20 and 0 < r["train_peak_rss_bytes"] <= r["peak_rss_bytes"]
    assert mem["mape_pct"] >= 0
    # Both ranks share this machine unconfined: one hardware fingerprint, one cached profile.
    assert len(list(cache.glob("profile-*.json"))) == 1
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_confinement_prioritizes_groups() -> None:
    from xronos.node.emulate.confinement import EmulatorError

    try:
        ctx = strategy.confinement("0.2,0.1", 2)
        wrap = ctx.__enter__()
    except EmulatorError as exc:
        pytest.skip(f"no writable cgroup cpu controller here: {exc}")
    try:
        assert callable(wrap)
        conf = wrap.__self__
        run = conf.cpu.base / conf.name
        name = "cpu.shares" if conf.cpu.version == 1 else "cpu.weight"
        for group in (run, run / "rank0", run / "rank1"):
            assert int((group / name).read_text()) == (262144 if conf.cpu.version == 1 else 10000)
    finally:
        ctx.__exit__(None, None, None)
    assert strategy.confinement(None, 3).__enter__() is None


def test_a_rank_profile_that_fails_is_named_with_its_error(tmp_path: Path) -> None:
    """A rank's `xronos profile` child (started as the node starts every child) that fails ends
    the run's planning with the rank, its exit status and its own error line."""
    from xronos.protocol.messages import ProfileKey

    with pytest.raises(RuntimeError, match=r"profiling rank 0 failed \(exit 2\):\n.*no config\.json"):
        strategy.profile_ranks(str(tmp_path / "none"), ProfileKey(task="classify", batch_size=2, seq_len=8), 1, 1)
