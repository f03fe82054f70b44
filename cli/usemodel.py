"""What to do with a finished model: the lines `xronos run`, `xronos job submit --follow` and
`xronos demo` print at the end (pure: paths and flags in, text out)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path


def using_lines(export_dir: str | Path, task: str, lora: bool = False, gguf: str | None = None,
                merged: bool = False, labels: Sequence[str] | None = None) -> list[str]:
    """The export path, the one transformers (or peft) line that loads it, and with a GGUF export
    the Ollama and llama.cpp lines. `labels`: a classifier's label names in id order.

    A LoRA classifier's adapter directory holds the trained head but not the label config: peft
    builds the base model from its own directory's config.json, whose head (2 labels, LABEL_i)
    is not the job's, so the line passes the job's labels (`id2label`; transformers derives
    num_labels and label2id from it). Without them known here it says so."""
    out = Path(export_dir)
    cls = "AutoModelForCausalLM" if task == "causal-lm" else "AutoModelForSequenceClassification"
    lines = [f"model: {out}"]
    if lora:
        peft_cls = "AutoPeftModelForCausalLM" if task == "causal-lm" else "AutoPeftModelForSequenceClassification"
        head = ""
        if task == "classify":
            head = ", id2label=" + (repr(dict(enumerate(labels))) if labels else "ID2LABEL")
        lines.append(f"load it: from peft import {peft_cls}; model = {peft_cls}.from_pretrained('{out}'{head})")
        if task == "classify" and not labels:
            lines.append("  where ID2LABEL is the job's labels, id -> name ({0: 'neg', 1: 'pos'}): "
                         + ("the merged/ directory's config.json has them" if merged else
                            "label names take ids in sorted order, unless the model's config.json names "
                            "them (docs/models.md)"))
        if merged:
            lines.append(f"merged: from transformers import {cls}; model = {cls}.from_pretrained('{out / 'merged'}')")
    else:
        lines.append(f"load it: from transformers import {cls}; model = {cls}.from_pretrained('{out}')")
    if gguf is not None:
        lines.append(f"Ollama: cd {shlex.quote(str(out))} && ollama create {_name(out)} -f Modelfile && "
                     f"ollama run {_name(out)}")
        lines.append(f"llama.cpp: llama-cli -m {shlex.quote(str(out / f'model-{gguf}.gguf'))} -cnv")
    return lines


def _name(out: Path) -> str:
    """An Ollama model name from the export directory's name (lower case, [a-z0-9._-])."""
    name = "".join(c if c.isalnum() or c in "._-" else "-" for c in out.name.lower()).strip("-.")
    return name or "xronos-model"
