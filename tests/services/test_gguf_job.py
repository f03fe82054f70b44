"""From a job over MQTT to a model llama.cpp runs: a Qwen2.5-shaped and a LLaMA-shaped chat model
fine-tuned with LoRA, and a GPT-2-shaped model fine-tuned in full, each submitted with
`export_gguf` over a real broker to a real gateway and two node services. Each job leaves a GGUF
file and an Ollama Modelfile beside its Hugging Face export; llama.cpp (llama-cpp-python) loads the
file and its logits agree with transformers' on the trained model (the tolerances of
tests/node/models/test_gguf_export.py), while the untrained base is far from them."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from jobkit import job_spec, runkit
from stack import Stack
from xronos.protocol import messages as m

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "node"))
import ggufkit  # noqa: E402

pytestmark = pytest.mark.slow

SEQ_LEN = 64
TOL = {"f32": 1e-3, "f16": 5e-3}  # f32: GPT-2's (llama.cpp's 16-bit GELU table); test_gguf_export.py


def _chats(n: int) -> list[dict]:
    short = [" ".join(t.split()[:4]) for t in runkit.texts(2 * n, 11)]
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in zip(short[:n], short[n:])]


def _run_job(stack: Stack, **kw) -> None:
    spec = job_spec(owner="n0", task="causal-lm", seq_len=SEQ_LEN, batch_size=4, lr=1e-2, max_steps=6,
                    checkpoint_interval=100, nodes=["n0", "n1"], eval_fraction=0.0, **kw)
    spec.pop("schema_version")
    accepted = stack.client.request("job/submit", 300.0, spec=m.JobSpec(**spec))
    final = stack.client.follow(accepted["job_id"], lambda s: None, timeout=300)
    assert final.phase == "completed", (final, stack.logs())


def _reference(export: Path, base: Path, lora: bool, merged: bool):
    """transformers' trained model: the export itself, the merged directory, or peft's merge."""
    import torch
    from transformers import AutoModelForCausalLM

    if not lora:
        return AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
    if merged:
        return AutoModelForCausalLM.from_pretrained(str(export / "merged"), dtype=torch.float32)
    from peft import PeftModel

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32),
                                     str(export)).merge_and_unload()


def _logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _check(export: Path, base: Path, out_type: str, lora: bool, merged: bool = False) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = export / f"model-{out_type}.gguf"
    assert gguf.is_file() and (export / "Modelfile").is_file(), sorted(p.name for p in export.iterdir())
    assert (export / "Modelfile").read_text().splitlines()[1] == f"FROM ./{gguf.name}"
    assert (export / ("adapter_model.safetensors" if lora else "model.safetensors")).is_file()
    tok = AutoTokenizer.from_pretrained(str(export))
    trained, start = _reference(export, base, lora, merged), AutoModelForCausalLM.from_pretrained(str(base))
    llm = ggufkit.llama_cpp(gguf)
    for prompt in ggufkit.PROMPTS:
        ids = tok(prompt)["input_ids"]
        ref, got = _logits(trained, ids), ggufkit.llama_logits(llm, ids)
        scale = float(np.abs(ref).max())
        moved = float(np.abs(_logits(start, ids) - ref).max()) / scale
        if out_type != "q8_0":
            err = float(np.abs(got - ref).max()) / scale
            assert err <= TOL[out_type] and moved > 10 * TOL[out_type], (prompt, err, moved)
        else:
            assert moved > 1e-2, moved  # it trained: the base's logits are not the trained ones
    for prompt in ggufkit.NEXT if out_type == "q8_0" else ():
        ids = tok(prompt)["input_ids"]
        got = ggufkit.llama_logits(llm, ids)[-1]
        assert int(np.argmax(got)) == int(np.argmax(_logits(trained, ids)[-1])), prompt
    if tok.chat_template:  # llama.cpp continues the chat prompt the template renders
        prompt = tok.apply_chat_template([{"role": "user", "content": "the cat sat"}], tokenize=False,
                                         add_generation_prompt=True)
        ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
        assert ids == tok(prompt, add_special_tokens=False)["input_ids"]
        out = []
        for t in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(t)
            if len(out) == 4:
                break
        assert len(out) == 4 and max(out) < trained.config.vocab_size


def test_lora_and_full_fine_tunes_over_mqtt_leave_a_gguf_llama_cpp_runs(stack):
    qwen = ggufkit.make_chat_model(stack.allowed / "qwen25", "qwen2")
    llama = ggufkit.make_chat_model(stack.allowed / "llama", "llama")
    gpt2 = ggufkit.make_chat_model(stack.allowed / "gpt2", "gpt2", chat=False)
    chats = runkit.write_rows(stack.allowed / "chats.jsonl", _chats(24))
    texts = runkit.write_rows(stack.allowed / "texts.jsonl", [{"text": t} for t in runkit.texts(24, 5)])
    stack.gateway()
    for n in ("n0", "n1"):
        stack.node(n)
    stack.wait_nodes(2)

    _run_job(stack, model=qwen, data=chats, export=stack.allowed / "out-qwen", data_format="chat", lora_r=4,
             export_gguf="f16")
    _check(stack.allowed / "out-qwen", qwen, "f16", lora=True)
    _run_job(stack, model=llama, data=chats, export=stack.allowed / "out-llama", data_format="chat", lora_r=4,
             export_merged=True, export_gguf="q8_0")
    _check(stack.allowed / "out-llama", llama, "q8_0", lora=True, merged=True)
    _run_job(stack, model=gpt2, data=texts, export=stack.allowed / "out-gpt2", export_gguf="f32")
    _check(stack.allowed / "out-gpt2", gpt2, "f32", lora=False)
