"""What the owner's inspection says of a model directory that cannot be trained: no weights (and
PyTorch pickles instead of safetensors), no tokenizer, an architecture no family reads — the
messages the README's "Getting a model onto the owner" quotes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import runkit
from xronos.node.agent.jobcheck import inspect_job
from xronos.protocol.messages import JobSpec


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("model-in")
    data = runkit.write_rows(root / "data.csv", [{"text": t} for t in runkit.texts(8)])
    return runkit.make_model(root / "good", "llama", "causal-lm"), data


def _inspect(base, tmp_path: Path, mutate) -> str:
    model, data = base
    d = tmp_path / "model"
    shutil.copytree(model, d)
    mutate(d)
    spec = JobSpec(name="t", owner="n0",
                   recipe=dict(model_dir=str(d), data_path=str(data), task="causal-lm", batch_size=2, seq_len=16,
                               lr=1e-3, max_steps=2, export_dir=str(tmp_path / "out")))
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        inspect_job(spec, [tmp_path, data.parent])
    return str(err.value)


def test_no_weights(base, tmp_path) -> None:
    msg = _inspect(base, tmp_path, lambda d: (d / "model.safetensors").unlink())
    assert msg == f"model dir {tmp_path / 'model'} has no model.safetensors (or model.safetensors.index.json and its shards)"


def test_pickles_instead_of_safetensors_are_named(base, tmp_path) -> None:
    msg = _inspect(base, tmp_path, lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"))
    assert msg.endswith("; it has pytorch_model.bin: PyTorch pickle files, which are never loaded (download the "
                        "model's .safetensors files instead)")


def test_no_tokenizer(base, tmp_path) -> None:
    def strip(d: Path) -> None:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (d / f).unlink()

    msg = _inspect(base, tmp_path, strip)
    assert msg.startswith(f"model dir {tmp_path / 'model'}: tokenizer could not be loaded: none of ['tokenizer.json', ")


def test_an_architecture_no_family_reads(base, tmp_path) -> None:
    def mistral(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))

    msg = _inspect(base, tmp_path, mistral)
    assert msg.startswith("unsupported architecture MistralForCausalLM (supported: BertForMaskedLM, ")
