"""LoRA options and their refusals: every bad LoRA setting is named before any process starts
(`preflight` for `xronos run`, `inspect_job` for a job), and the wire message bounds its fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

import runkit
from xronos.cli.main import main
from xronos.node.runconfig import RunConfig
from xronos.node.tp.lora import LoraSettings, check_targets
from xronos.node.rank.validate import check_lora, model_sizes, preflight, read_config
from xronos.protocol.layout import Layout
from xronos.protocol.messages import JobSpec, LoraSpec


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("lora-options")
    rows = [{"text": t, "label": i % 3} for i, t in enumerate(runkit.texts(10))]
    data = runkit.write_rows(root / "data.jsonl", rows)
    return {f: (runkit.make_model(root / f, f, "classify", num_labels=3, gqa=f == "llama"), data)
            for f in ("gpt2", "bert", "llama")}


def _cfg(model: Path, data: Path, **kw) -> RunConfig:
    sizes = model_sizes(model)
    return runkit.run_config(model_dir=str(model), data_path=str(data), task="classify", batch_size=4, seq_len=16,
                             lr=1e-4, max_steps=3, layout=Layout.tied([2, sizes.attn - 2], sizes), **kw)


def test_a_good_lora_run_passes_and_defaults_to_peft_targets(models) -> None:
    for family, default in (("gpt2", ("c_attn",)), ("bert", ("query", "value")), ("llama", ("q_proj", "v_proj"))):
        model, data = models[family]
        preflight(_cfg(model, data, lora_r=4), nodes=2)
        settings = check_lora(read_config(model), "classify", LoraSpec(r=4))
        assert settings == LoraSettings(4, 16.0, 0.0, default) and settings.scale == 4.0


def test_targets_the_family_lacks_are_refused_naming_those_it_has(models) -> None:
    model, data = models["llama"]
    with pytest.raises(ValueError, match=r"\['c_attn'\] not in model family 'llama' \(it has: q_proj, k_proj, "
                                         r"v_proj, o_proj, gate_proj, up_proj, down_proj\)"):
        preflight(_cfg(model, data, lora_r=4, lora_targets=["q_proj", "c_attn"]), nodes=2)
    model, data = models["gpt2"]
    with pytest.raises(ValueError, match=r"\['q_proj'\] not in model family 'gpt2' \(it has: c_attn, c_proj, c_fc\)"):
        preflight(_cfg(model, data, lora_r=4, lora_targets=["q_proj"]), nodes=2)


def test_rank_must_be_positive_and_fit_the_layer(models) -> None:
    model, data = models["llama"]  # hidden 48; GQA: k_proj/v_proj 48 -> 24 features (6 KV heads x 4)
    with pytest.raises(ValidationError, match=r"recipe\.lora\.r"):
        _cfg(model, data, lora_r=0)
    with pytest.raises(ValidationError, match="greater than 0"):
        LoraSpec(r=-1)
    preflight(_cfg(model, data, lora_r=24, lora_targets=["k_proj"]), nodes=2)  # r = min(in, out) fits
    with pytest.raises(ValueError, match=r"r=25 exceeds layer model\.layers\.0\.self_attn\.k_proj "
                                         r"\(48 -> 24 features; r must be <= 24\)"):
        preflight(_cfg(model, data, lora_r=25, lora_targets=["k_proj"]), nodes=2)
    model, data = models["gpt2"]  # c_fc: 48 -> 100, c_attn 48 -> 144: r <= 48
    with pytest.raises(ValueError, match=r"r=49 exceeds layer transformer\.h\.0\.attn\.c_attn"):
        preflight(_cfg(model, data, lora_r=49), nodes=2)


def test_a_family_without_lora_is_refused() -> None:
    with pytest.raises(ValueError, match="LoRA is not supported for model family 'other'"):
        check_targets("other", (), LoraSettings(4, 8.0, 0.0, ("q_proj",)))


def test_lora_options_need_lora_r(models) -> None:
    model, data = models["gpt2"]
    with pytest.raises(ValidationError, match="export_merged: set without lora"):
        _cfg(model, data, export_merged=True)
    with pytest.raises(ValidationError, match=r"recipe\.lora\.r\n  Field required"):
        _cfg(model, data, lora_alpha=8.0)
    with pytest.raises(ValidationError, match=r"recipe\.lora\.dropout"):
        _cfg(model, data, lora_r=4, lora_dropout=1.0)


def _spec(lora: dict | None = None, **kw) -> dict:
    recipe = {"model_dir": "/m", "data_path": "/d.csv", "task": "classify", "batch_size": 4, "seq_len": 16,
              "lr": 1e-4, "max_steps": 3, "export_dir": "/e", "lora": lora, **kw}
    return {"schema_version": 3, "name": "t", "owner": "n0", "recipe": recipe}


def test_jobspec_bounds_the_lora_fields() -> None:
    spec = JobSpec.model_validate_json(json.dumps(_spec(dict(r=8, alpha=16.0, dropout=0.05,
                                                             targets=["q_proj", "v_proj"]), export_merged=True)))
    assert (spec.recipe.lora.r, spec.recipe.lora.targets, spec.recipe.export_merged) == (8, ["q_proj", "v_proj"], True)
    run = RunConfig.for_job(spec, layout=Layout(attn=(2,), mlp=(4,), vocab=(8,)), rank=0, host="h", port=1,
                            threads=1, gloo_timeout_s=1.0)
    assert run.recipe == spec.recipe  # a rank trains the job's very recipe
    for lora in ({"r": 0}, {"r": 8, "alpha": 0}, {"r": 8, "dropout": 1.0}, {"r": 8, "targets": []},
                 {"r": 8, "targets": ["x" * 65]}, {"r": 8, "targets": ["q"] * 17}, {"targets": ["q_proj"]}, {"r": "8"}):
        with pytest.raises(ValidationError):
            JobSpec.model_validate_json(json.dumps(_spec(lora)))
    with pytest.raises(ValidationError, match="export_merged: set without lora"):
        JobSpec.model_validate_json(json.dumps(_spec(export_merged=True)))


def test_jobspec_refuses_lora_settings_without_a_rank(tmp_path: Path) -> None:
    """A spec that forgot the rank would fine-tune every weight and export a full model where the
    user asked for adapters: its LoRA table without `r` is refused naming recipe.lora.r. The
    example spec file as it is trains fully; its LoRA lines uncommented but the rank's: refused."""
    for given in ({"alpha": 8.0}, {"dropout": 0.1}, {"targets": ["c_attn"]}):
        with pytest.raises(ValidationError, match=r"recipe\.lora\.r\n  Field required"):
            JobSpec.model_validate_json(json.dumps(_spec(given)))
    full = JobSpec.model_validate_json(json.dumps(_spec()))
    assert full.recipe.lora is None and JobSpec.model_validate_json(full.model_dump_json()) == full
    from xronos.protocol.specfile import load_spec

    example = (Path(__file__).resolve().parents[2] / "examples" / "job.toml").read_text()
    assert load_spec(_write(tmp_path / "as-is.toml", example)).recipe.lora is None
    lines = [ln.removeprefix("# ") if ln.startswith(("# [recipe.lora]", "# alpha", "# dropout", "# targets"))
             else ln for ln in example.splitlines()]
    with pytest.raises(ValueError) as info:
        load_spec(_write(tmp_path / "no-rank.toml", "\n".join(lines)))
    assert "no-rank.toml: recipe.lora.r: Field required" in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_xronos_run_refuses_bad_lora_before_any_process(models, tmp_path: Path, capsys) -> None:
    model, data = models["bert"]
    argv = ["run", "--model", str(model), "--data", str(data), "--task", "classify", "--nodes", "2",
            "--units", "6,6", "--batch-size", "4", "--seq-len", "16", "--lr", "1e-4", "--max-steps", "2",
            "--seed", "0", "--export", str(tmp_path / "out")]
    assert main([*argv, "--lora-r", "4", "--lora-targets", "query,q_proj"]) != 0
    assert "['q_proj'] not in model family 'bert' (it has: query, key, value, dense)" in capsys.readouterr().err
    assert main([*argv, "--lora-r", "0"]) != 0
    assert "--lora-r" in capsys.readouterr().err
    assert main([*argv, "--export-merged"]) != 0
    assert "--export-merged: set without --lora-r" in capsys.readouterr().err  # the flag typed, not the field
    assert not (tmp_path / "out").exists()


def test_xronos_run_with_lora_exports_a_peft_adapter_and_the_merged_model(tmp_path: Path) -> None:
    """`xronos run --lora-r` end to end (real ranks, Gloo): OUT is a PEFT adapter directory that
    peft loads onto the base, OUT/merged a plain transformers model; both compute alike."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = runkit.make_model(tmp_path / "m", "llama", "causal-lm", gqa=True)
    data = runkit.write_rows(tmp_path / "d.jsonl", [{"text": t} for t in runkit.texts(20)])
    out = tmp_path / "out"
    assert main(["run", "--model", str(model), "--data", str(data), "--task", "causal-lm", "--nodes", "2",
                 "--layout", "attn=2,4;mlp=32,68;vocab=0,38", "--batch-size", "4", "--seq-len", "16",
                 "--lr", "1e-2", "--max-steps", "5", "--seed", "0", "--export", str(out), "--lora-r", "4",
                 "--lora-targets", "q_proj,v_proj,down_proj", "--export-merged"]) == 0
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["task_type"]) == (4, 16.0, "CAUSAL_LM")
    assert len(cfg["target_modules"]) == 3 * 2 and not (out / "model.safetensors").exists()
    ids = torch.randint(3, 30, (1, 10), generator=torch.Generator().manual_seed(1))
    base = AutoModelForCausalLM.from_pretrained(str(model)).eval()
    with torch.no_grad():
        before = base(ids).logits
        adapted = PeftModel.from_pretrained(base, str(out)).eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(str(out / "merged")).eval()(ids).logits
    assert float((adapted - merged).abs().max()) <= 1e-5 * float(adapted.abs().max())
    assert float((adapted - before).abs().max()) > 1e-3  # the adapters were trained


def test_the_printed_line_loads_a_lora_classifier_of_three_named_labels(tmp_path: Path, capsys) -> None:
    """A base without a head (as MiniLM's: config.json says 2 labels) fine-tuned with LoRA on three
    named labels: the line `xronos run` prints loads the adapter with the job's head and labels,
    and it computes what the merged export computes."""
    import shutil

    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification

    src = runkit.make_model(tmp_path / "src", "bert", "classify")
    base = tmp_path / "base"
    AutoModel.from_pretrained(str(src)).save_pretrained(str(base))  # the encoder alone, no head
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab")):
            shutil.copy(f, base / f.name)
    assert "num_labels" not in json.loads((base / "config.json").read_text())
    rows = [{"text": t, "label": "abc"[i % 3]} for i, t in enumerate(runkit.texts(12))]
    data = runkit.write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["run", "--model", str(base), "--data", str(data), "--task", "classify", "--nodes", "2", "--units", "4,8",
                 "--batch-size", "4", "--seq-len", "16", "--lr", "1e-2", "--max-steps", "3", "--seed", "0",
                 "--export", str(out), "--lora-r", "4", "--export-merged"]) == 0
    line, = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("xronos run: load it: ")]
    assert "id2label={0: 'a', 1: 'b', 2: 'c'}" in line
    scope: dict = {}
    exec(line.removeprefix("xronos run: load it: "), scope)  # the user's line, as printed
    model = scope["model"].eval()
    merged = AutoModelForSequenceClassification.from_pretrained(str(out / "merged")).eval()
    assert model.config.id2label == merged.config.id2label == {0: "a", 1: "b", 2: "c"}
    ids = torch.randint(5, 30, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, merged(input_ids=ids).logits
    assert a.shape == (2, 3) and float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
