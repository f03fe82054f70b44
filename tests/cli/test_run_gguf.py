"""`xronos run --export-gguf` on two local ranks: the run writes the GGUF file and the Modelfile
beside its Hugging Face export, ends by saying how to use them, and llama.cpp's logits of the file
agree with transformers' of the export (a LoRA run: of the merged model)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))
import ggufkit  # noqa: E402
import runkit  # noqa: E402

from xronos.cli.main import main  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_lora_run_exports_the_merged_model_as_gguf(tmp_path, capsys) -> None:
    from transformers import AutoTokenizer

    model = ggufkit.make_chat_model(tmp_path / "smollm", "smollm")
    data = runkit.write_rows(tmp_path / "data.jsonl", [{"text": t} for t in runkit.texts(16, 3)])
    out = tmp_path / "out"
    argv = runkit.run_argv(model, data, "causal-lm", (1, 1), out, steps=3, lr=1e-2,
                           extra=("--lora-r", "4", "--export-merged", "--export-gguf", "f16"))
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"xronos run: Ollama: cd {out} && ollama create out -f Modelfile && ollama run out" in err
    assert f"xronos run: llama.cpp: llama-cli -m {out / 'model-f16.gguf'} -cnv" in err
    assert (out / "Modelfile").read_text().splitlines()[1] == "FROM ./model-f16.gguf"

    merged, base = ggufkit.hf_model(out / "merged"), ggufkit.hf_model(model)
    llm = ggufkit.llama_cpp(out / "model-f16.gguf")
    tok = AutoTokenizer.from_pretrained(str(out))
    for prompt in ggufkit.PROMPTS:
        ids = tok(prompt)["input_ids"]
        ref = ggufkit.hf_logits(merged, ids)
        scale = float(np.abs(ref).max())
        err = float(np.abs(ggufkit.llama_logits(llm, ids) - ref).max()) / scale
        moved = float(np.abs(ggufkit.hf_logits(base, ids) - ref).max()) / scale
        assert err <= 5e-3 and moved > 10 * err and moved > 1e-2, (prompt, err, moved)  # f16; the adapters trained
