"""The GGUF export, judged by llama.cpp itself (llama-cpp-python): for each family it loads the
file, splits text into the same tokens as the Hugging Face tokenizer, computes the logits
transformers computes (f32 and f16 within the tolerances below, Q8_0 with the same next token),
and continues a chat prompt that the chat template rendered as transformers does.

Tolerances, as the largest difference over every position's logits divided by the largest logit
(~9.5 on these models), measured on the five families here: f32 differs from transformers by at
most 4e-7 (summation order; TOL_F32 = 1e-5), except GPT-2 by 1.2e-4 because llama.cpp computes GELU
from a table of 16-bit values (TOL_F32_GPT2 = 1e-3); f16 rounds every weight to 11 significant bits
(2^-11 = 4.9e-4 relative) and differs by at most 5.1e-4 (TOL_F16 = 5e-3); Q8_0 by at most 1.0e-2,
against a top-1 margin of at least 0.63 on the NEXT prompts. A wrong layout is far outside these:
LLaMA's q/k not permuted for llama.cpp's RoPE gives 0.57, Qwen2 without its q/k/v biases 0.21, and
GPT-2 with untransposed weights or Qwen3 without its q/k norms does not load at all.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ggufkit  # noqa: E402

from xronos.node.models.gguf import save_gguf_export  # noqa: E402

TOL_F32 = 1e-5
TOL_F32_GPT2 = 1e-3
TOL_F16 = 5e-3
FAMILIES = ("llama", "qwen2", "qwen3", "gpt2", "smollm")  # smollm: a LLaMA with SmolLM2's tokenizer


@pytest.fixture(scope="module", params=FAMILIES)
def exported(request, tmp_path_factory):
    """(family, model dir, {type: gguf path}) with every export type written from the checkpoint."""
    from safetensors.torch import load_file

    family = request.param
    root = tmp_path_factory.mktemp(f"gguf-{family}")
    model = ggufkit.make_chat_model(root / "model", family, chat=family != "gpt2")
    config = json.loads((model / "config.json").read_text())
    state = load_file(str(model / "model.safetensors"))
    paths = {t: save_gguf_export(root / t, config, state, model, t) for t in ("f32", "f16", "q8_0")}
    return family, model, paths, ggufkit.hf_model(model)


def _tokenizer(model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def test_llama_cpp_tokenizes_as_transformers(exported) -> None:
    family, model, paths, hf = exported
    tok, llm = _tokenizer(model), ggufkit.llama_cpp(paths["f32"])
    texts = ggufkit.PROMPTS + ["Numbers 12345 and punctuation, here!", "  two  spaces\nand a newline"]
    for text in texts:
        assert llm.tokenize(text.encode(), add_bos=True, special=True) == tok(text)["input_ids"], (family, text)


@pytest.mark.parametrize("out_type", ["f32", "f16"])
def test_logits_agree_with_transformers(exported, out_type) -> None:
    family, model, paths, hf = exported
    tol = TOL_F16 if out_type == "f16" else TOL_F32_GPT2 if family == "gpt2" else TOL_F32
    tok, llm = _tokenizer(model), ggufkit.llama_cpp(paths[out_type])
    for prompt in ggufkit.PROMPTS:
        ids = tok(prompt)["input_ids"]
        ref, got = ggufkit.hf_logits(hf, ids), ggufkit.llama_logits(llm, ids)
        assert got.shape == ref.shape
        err = float(np.abs(got - ref).max() / np.abs(ref).max())
        assert err <= tol, (family, out_type, prompt, err)


def test_q8_0_picks_the_same_next_token(exported) -> None:
    family, model, paths, hf = exported
    tok, llm = _tokenizer(model), ggufkit.llama_cpp(paths["q8_0"])
    f32 = ggufkit.llama_cpp(paths["f32"])
    assert paths["q8_0"].stat().st_size < 0.6 * paths["f32"].stat().st_size  # it did quantise
    for prompt in ggufkit.NEXT:
        ids = tok(prompt)["input_ids"]
        ref = ggufkit.hf_logits(hf, ids)[-1]
        assert int(np.argmax(ggufkit.llama_logits(llm, ids)[-1])) == int(np.argmax(ref)), (family, prompt)
        assert not np.allclose(ggufkit.llama_logits(llm, ids), ggufkit.llama_logits(f32, ids))


def test_a_chat_prompt_rendered_by_the_template_generates_as_transformers(exported) -> None:
    """The chat template travels in the GGUF metadata; llama.cpp continues the prompt it renders
    greedily with the same tokens as transformers (f32)."""
    import torch
    from gguf import GGUFReader

    family, model, paths, hf = exported
    tok = _tokenizer(model)
    meta = GGUFReader(str(paths["f32"])).fields
    if family == "gpt2":
        assert "tokenizer.chat_template" not in meta
        prompt = "the cat sat on"
    else:
        stored = bytes(meta["tokenizer.chat_template"].parts[-1]).decode()
        assert stored == tok.chat_template
        prompt = tok.apply_chat_template([{"role": "user", "content": "the cat sat"}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]  # Llama 3's template writes BOS itself
    llm = ggufkit.llama_cpp(paths["f32"])
    assert llm.tokenize(prompt.encode(), add_bos=False, special=True) == ids
    want = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                       pad_token_id=tok.pad_token_id or tok.eos_token_id)[0, len(ids):].tolist()
    got: list[int] = []
    for t in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        got.append(t)
        if len(got) == 6 or t == tok.eos_token_id:
            break
    assert got == want, (family, got, want)
    modelfile = (paths["f32"].parent / "Modelfile").read_text()
    assert modelfile.splitlines()[1] == f"FROM ./{paths['f32'].name}"
    assert ("TEMPLATE" in modelfile) and ("PARAMETER stop" in modelfile)
