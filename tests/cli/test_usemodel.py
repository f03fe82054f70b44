"""The closing lines of `xronos run`, `xronos job submit --follow` and `xronos demo`: the path, the
one line that loads the export, and with a GGUF export the Ollama and llama.cpp lines."""

from __future__ import annotations

from xronos.cli.usemodel import using_lines


def test_a_classifier_gets_the_transformers_line_only() -> None:
    assert using_lines("/srv/x/export", "classify") == [
        "model: /srv/x/export",
        "load it: from transformers import AutoModelForSequenceClassification; "
        "model = AutoModelForSequenceClassification.from_pretrained('/srv/x/export')"]


def test_a_causal_lm_with_gguf_gets_the_ollama_and_llama_cpp_lines() -> None:
    lines = using_lines("/srv/x/My Chat", "causal-lm", lora=True, gguf="q8_0", merged=True)
    assert lines[1] == ("load it: from peft import AutoPeftModelForCausalLM; "
                        "model = AutoPeftModelForCausalLM.from_pretrained('/srv/x/My Chat')")
    assert lines[2] == ("merged: from transformers import AutoModelForCausalLM; "
                        "model = AutoModelForCausalLM.from_pretrained('/srv/x/My Chat/merged')")
    assert lines[3] == "Ollama: cd '/srv/x/My Chat' && ollama create my-chat -f Modelfile && ollama run my-chat"
    assert lines[4] == "llama.cpp: llama-cli -m '/srv/x/My Chat/model-q8_0.gguf' -cnv"


def test_a_lora_classifier_line_passes_the_labels() -> None:
    """peft builds the base from its own config.json (2 labels): the job's labels travel in the line."""
    lines = using_lines("/srv/x/out", "classify", lora=True, labels=["a", "b", "c"])
    assert lines[1] == ("load it: from peft import AutoPeftModelForSequenceClassification; model = "
                        "AutoPeftModelForSequenceClassification.from_pretrained('/srv/x/out', "
                        "id2label={0: 'a', 1: 'b', 2: 'c'})")
    unknown = using_lines("/srv/x/out", "classify", lora=True, merged=True)  # xronos job submit --follow
    assert unknown[1].endswith("from_pretrained('/srv/x/out', id2label=ID2LABEL)")
    assert "where ID2LABEL is the job's labels" in unknown[2] and "merged/ directory's config.json" in unknown[2]
