"""The Ollama Modelfile: a chat template measured into role prefixes/suffixes, rebuilt as a Go
template, checked against the Jinja rendering, refused (no TEMPLATE) when it does not fit."""

from __future__ import annotations

import sys
from pathlib import Path

import jinja2
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ggufkit  # noqa: E402
import runkit  # noqa: E402

from xronos.node.models.modelfile import measure, modelfile_text, verified  # noqa: E402


def renderer(template: str, bos: str = ""):
    """Jinja as transformers renders chat templates (trim_blocks, lstrip_blocks)."""
    tmpl = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(template)
    return lambda msgs, gen: tmpl.render(messages=msgs, add_generation_prompt=gen, bos_token=bos)


def test_chatml_is_measured_into_its_pieces() -> None:
    render = renderer(runkit.CHAT_TEMPLATE)
    shape = measure(render)
    assert shape is not None and verified(shape, render)
    assert shape.begin == "" and shape.default_system is None and shape.gen == "<|im_start|>assistant\n"
    assert shape.pre == {r: f"<|im_start|>{r}\n" for r in ("system", "user", "assistant")}
    assert shape.post == {r: "<|im_end|>\n" for r in ("system", "user", "assistant")}


def test_a_default_system_prompt_becomes_ollamas_system() -> None:
    render = renderer(ggufkit.QWEN25_TEMPLATE)
    shape = measure(render)
    assert shape is not None and verified(shape, render)
    assert shape.default_system == "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    msgs = [{"role": "user", "content": "hi"}]
    assert shape.render(msgs, True) == render(msgs, True)  # Ollama's SYSTEM first, as the template's default


def test_llama3_begins_with_bos() -> None:
    render = renderer(ggufkit.LLAMA3_TEMPLATE, bos="<|begin_of_text|>")
    shape = measure(render, "<|begin_of_text|>")
    assert shape is not None and verified(shape, render)
    assert shape.begin == "<|begin_of_text|>"
    assert shape.pre["user"] == "<|start_header_id|>user<|end_header_id|>\n\n" and shape.post["user"] == "<|eot_id|>"


@pytest.mark.parametrize("template", [
    # Messages in reverse: not role-wise concatenation.
    "{% for m in messages|reverse %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
    # A turn counter: the prefix changes with the position.
    "{% for m in messages %}[{{ loop.index }}] {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}",
])
def test_a_template_of_another_shape_is_not_translated(template) -> None:
    render = renderer(template)
    shape = measure(render)
    assert shape is None or not verified(shape, render)


def test_the_modelfile_of_each_kind(tmp_path) -> None:
    qwen = ggufkit.make_bpe_tokenizer(tmp_path / "q", "qwen2")
    text = modelfile_text("model-f16.gguf", qwen, 32768, add_bos=False)
    assert text.splitlines()[1] == "FROM ./model-f16.gguf"
    assert 'SYSTEM """You are Qwen, created by Alibaba Cloud. You are a helpful assistant."""' in text
    assert ('{{ else if eq .Role "assistant" }}<|im_start|>assistant\n{{ .Content }}{{ if not $last }}<|im_end|>\n'
            '{{ end }}{{ end }}{{ if and $last (ne .Role "assistant") }}<|im_start|>assistant\n{{ end }}{{ end }}"""'
            in text)
    assert 'PARAMETER stop "<|im_end|>"' in text and 'PARAMETER stop "<|im_start|>"' in text
    assert "PARAMETER num_ctx 4096" in text

    llama = ggufkit.make_bpe_tokenizer(tmp_path / "l", "llama")
    text = modelfile_text("model-q8_0.gguf", llama, 128, add_bos=True)
    assert 'TEMPLATE """{{ range' in text  # llama.cpp adds BOS itself: not in the template too
    assert 'PARAMETER stop "<|eot_id|>"' in text and "PARAMETER num_ctx 128" in text

    gpt2 = ggufkit.make_bpe_tokenizer(tmp_path / "g", "gpt2", chat=False)
    text = modelfile_text("model-f32.gguf", gpt2, 1024, add_bos=False)
    assert 'TEMPLATE """{{ .Prompt }}"""' in text and 'PARAMETER stop "<|endoftext|>"' in text

    llama.chat_template = "{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}"
    text = modelfile_text("model-f16.gguf", llama, 128, add_bos=True)
    assert "TEMPLATE" not in text.replace("# TEMPLATE:", "") and "tokenizer.chat_template" in text
