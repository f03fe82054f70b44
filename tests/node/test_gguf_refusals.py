"""A GGUF export llama.cpp could not run is refused before training: at the spec's validation (a
classifier's task), at the owner's inspection of a job and at `xronos run`'s preflight (the family,
the task, the tokenizer), each naming what it refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

import ggufkit
import runkit
from xronos.cli.main import main
from xronos.node.agent.jobcheck import inspect_job
from xronos.node.models.gguf import check_gguf, gguf_refusal
from xronos.protocol.messages import JobSpec


def _spec(model: Path, data: Path, export: Path, **kw) -> JobSpec:
    recipe = dict(model_dir=str(model), data_path=str(data), task="causal-lm", batch_size=2, seq_len=16, lr=1e-3,
                  max_steps=2, export_dir=str(export), export_gguf="f16")
    return JobSpec(name="t", owner="n0", recipe={**recipe, **kw})


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-refusals")
    data = runkit.write_rows(root / "data.csv", [{"text": t, "label": i % 2} for i, t in enumerate(runkit.texts(8))])
    return {"data": data, "root": root,
            "bert": runkit.make_model(root / "bert", "bert", "classify", num_labels=2),
            "gpt2-classify": runkit.make_model(root / "gpt2c", "gpt2", "classify", num_labels=2),
            "llama-wordlevel": runkit.make_model(root / "llamaw", "llama", "causal-lm"),
            "qwen2": ggufkit.make_chat_model(root / "qwen2", "qwen2")}


def test_the_spec_refuses_a_gguf_export_of_a_classifier(models) -> None:
    with pytest.raises(ValidationError, match="export_gguf: 'f16' asked of task 'classify'.*causal-lm"):
        _spec(models["bert"], models["data"], models["root"] / "out", task="classify")
    with pytest.raises(ValidationError, match="export_gguf"):
        _spec(models["qwen2"], models["data"], models["root"] / "out", export_gguf="q4_k")
    assert _spec(models["qwen2"], models["data"], models["root"] / "out").recipe.export_gguf == "f16"


def test_the_owner_refuses_a_family_llama_cpp_does_not_run_naming_it(models) -> None:
    """BERT asked for causal-lm with a GGUF export: named as the family, before its missing head."""
    root = models["root"]
    spec = _spec(models["bert"], models["data"], root / "out")
    with pytest.raises(ValueError, match=r"export_gguf: the bert family \(BertForSequenceClassification\) is not a "
                                         r"language model llama.cpp runs.*llama, qwen2, qwen3, gpt2"):
        inspect_job(spec, [root])


def test_the_owner_refuses_a_tokenizer_llama_cpp_would_split_differently(models) -> None:
    root = models["root"]
    spec = _spec(models["llama-wordlevel"], models["data"], root / "out")
    with pytest.raises(ValueError, match="export_gguf: the tokenizer in .* is a WordLevel model; GGUF export carries "
                                         "byte-level BPE tokenizers"):
        inspect_job(spec, [root])
    # The same inspection passes for a byte-level BPE chat model of the same kind of family.
    report = inspect_job(_spec(models["qwen2"], models["data"], root / "out"), [root])
    assert report["arch"]["family"] == "qwen2"


def test_refusals_of_pure_config() -> None:
    assert "task 'classify' of the gpt2 family makes a classifier" in gguf_refusal(
        {"architectures": ["GPT2ForSequenceClassification"]}, "classify")
    assert "the roberta family (RobertaForSequenceClassification)" in gguf_refusal(
        {"architectures": ["RobertaForSequenceClassification"]}, "classify")
    assert "rope_type 'yarn'" in gguf_refusal(
        {"architectures": ["LlamaForCausalLM"], "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "causal-lm")
    assert gguf_refusal({"architectures": ["Qwen3ForCausalLM"]}, "causal-lm") is None


def test_a_missing_fast_tokenizer_is_named(models, tmp_path) -> None:
    config = json.loads((models["qwen2"] / "config.json").read_text())
    with pytest.raises(ValueError, match=f"export_gguf: {tmp_path} has no tokenizer.json"):
        check_gguf(tmp_path, config, "causal-lm")


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("xronos "), err
    return err[0]


@pytest.fixture
def nothing_starts(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("a rank process was spawned for a run that should have been refused")

    monkeypatch.setattr("xronos.node.rank.local.subprocess.Popen", refuse)


def test_xronos_run_refuses_before_any_process(models, tmp_path, capsys, nothing_starts) -> None:
    argv = runkit.run_argv(models["gpt2-classify"], models["data"], "classify", (6, 6), tmp_path / "out")
    assert main(argv + ["--export-gguf", "q8_0"]) == 2
    assert "--export-gguf: 'q8_0' asked of --task 'classify'" in _error(capsys)
    argv = runkit.run_argv(models["llama-wordlevel"], models["data"], "causal-lm", (4, 4), tmp_path / "out")
    assert main(argv + ["--export-gguf", "f16"]) == 2
    assert "--export-gguf f16: the tokenizer in" in _error(capsys)
    assert not (tmp_path / "out").exists()
