"""A tokenizer whose ids reach past the model's vocabulary (here: a special token added without
resizing the embeddings) is refused by `xronos run` before any rank starts, and by the owner's
inspection of a job, naming both sizes. It used to train at loss nan, exit 0 and export unchanged
weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runkit  # noqa: E402

from xronos.cli.main import main  # noqa: E402
from xronos.node.agent.jobcheck import inspect_job  # noqa: E402
from xronos.protocol.messages import JobSpec  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path, int]:
    """A GPT-2 checkpoint of V rows whose tokenizer has V + 1 tokens, and data that uses the extra one."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("vocab")
    model = runkit.make_model(root / "gpt2", "gpt2", "causal-lm")
    tok = AutoTokenizer.from_pretrained(str(model))
    V = len(tok)
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    tok.save_pretrained(str(model))
    rows = [{"text": f"<|tool|> {t}"} for t in runkit.texts(16)]
    return model, runkit.write_rows(root / "data.jsonl", rows), V


@pytest.fixture
def no_spawn(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("a rank was spawned for a run that should have been refused")

    monkeypatch.setattr("xronos.node.rank.local.subprocess.Popen", refuse)


def test_xronos_run_refuses_the_pair_naming_both_sizes(pair, tmp_path, capsys, no_spawn):
    model, data, V = pair
    assert main(runkit.run_argv(model, data, "causal-lm", (4, 8), tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert f"the tokenizer has {V + 1} tokens (ids up to {V}" in err
    assert f"config.json vocab_size is {V}" in err
    assert not (tmp_path / "out").exists()


def test_the_owners_inspection_refuses_the_pair(pair, tmp_path):
    model, data, V = pair
    spec = JobSpec(name="x", owner="n1",
                   recipe=dict(model_dir=str(model), data_path=str(data), task="causal-lm", batch_size=2,
                               seq_len=16, lr=1e-3, max_steps=2, export_dir=str(tmp_path / "out")))
    with pytest.raises(ValueError, match=rf"tokenizer has {V + 1} tokens .* vocab_size is {V}:"):
        inspect_job(spec, [model.parent, tmp_path])


def test_a_padded_vocabulary_is_fine(tmp_path, no_spawn):
    """Embeddings with more rows than the tokenizer has tokens (Qwen's are padded) are no problem."""
    model = runkit.make_model(tmp_path / "gpt2", "gpt2", "causal-lm", vocab_size=96)
    data = runkit.write_rows(tmp_path / "data.jsonl", [{"text": t} for t in runkit.texts(16)])
    spec = JobSpec(name="x", owner="n1",
                   recipe=dict(model_dir=str(model), data_path=str(data), task="causal-lm", batch_size=2,
                               seq_len=16, lr=1e-3, max_steps=2, export_dir=str(tmp_path / "out")))
    assert inspect_job(spec, [tmp_path])["total_steps"] == 2
