"""An export directory used again: what an earlier export of ours left there that the new one does
not write (an adapter beside a full model, a full model under an adapter, a GGUF and its Modelfile)
is removed once the new export is in place, and nothing else the user keeps there is touched."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runkit  # noqa: E402

from xronos.node.models.exportfiles import EXPORT_ENTRIES, remove_leftovers, written  # noqa: E402
from xronos.protocol.recipe import Recipe  # noqa: E402


def _recipe(**kw) -> Recipe:
    return Recipe(model_dir="/m", data_path="/d.csv", task="causal-lm", batch_size=2, seq_len=8, lr=1e-3,
                  max_steps=1, **kw)


def test_each_recipe_keeps_what_its_export_writes_and_removes_the_rest_of_ours(tmp_path) -> None:
    assert written(_recipe()) == {"config.json", "model.safetensors"}
    assert written(_recipe(lora={"r": 4}, export_merged=True, export_gguf="f16")) == {
        "adapter_config.json", "adapter_model.safetensors", "merged", "model-f16.gguf", "Modelfile"}
    for name in EXPORT_ENTRIES:
        (tmp_path / name).write_text("old") if name != "merged" else (tmp_path / name).mkdir()
    (tmp_path / "merged" / "model.safetensors").write_text("old")
    (tmp_path / "notes.txt").write_text("the user's")
    (tmp_path / "tokenizer.json").write_text("{}")
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "keep").write_text("not ours")
    (tmp_path / "Modelfile").unlink()
    (tmp_path / "Modelfile").symlink_to(outside / "keep")  # a link is removed itself, never followed
    removed = remove_leftovers(tmp_path, _recipe(lora={"r": 4}))
    assert sorted(removed) == sorted(set(EXPORT_ENTRIES) - {"adapter_config.json", "adapter_model.safetensors"})
    assert sorted(os.listdir(tmp_path)) == ["adapter_config.json", "adapter_model.safetensors", "notes.txt",
                                            "tokenizer.json"]
    assert (outside / "keep").read_text() == "not ours"
    assert remove_leftovers(tmp_path / "missing", _recipe()) == []


def test_a_full_export_after_a_lora_one_loads_as_the_full_model(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from xronos.cli.main import main

    model = runkit.make_model(tmp_path / "gpt2", "gpt2", "causal-lm")
    data = runkit.write_rows(tmp_path / "d.jsonl", [{"text": t} for t in runkit.texts(8)])
    out = tmp_path / "out"
    lora = ("--lora-r", "4", "--export-merged")
    assert main(runkit.run_argv(model, data, "causal-lm", (12,), out, steps=2, extra=lora)) == 0
    assert {"adapter_config.json", "adapter_model.safetensors", "merged"} <= set(os.listdir(out))
    for name in ("model-f16.gguf", "Modelfile"):  # as an earlier --export-gguf f16 left them
        (out / name).write_text("old")
    assert main(runkit.run_argv(model, data, "causal-lm", (12,), out, steps=2)) == 0
    names = set(os.listdir(out))
    assert {"config.json", "model.safetensors"} <= names
    assert not names & {"adapter_config.json", "adapter_model.safetensors", "merged", "model-f16.gguf", "Modelfile"}
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    assert getattr(loaded, "peft_config", None) is None
