"""What to do with a finished model: the lines `xronos run`, `xronos job submit --follow` and
`xronos demo` print at the end (pure: paths and flags in, text out)."""

from __future__ import annotations

import shlex
from pathlib import Path


def using_lines(export_dir: str | Path, task: str, lora: bool = False, gguf: str | None = None,
                merged: bool = False) -> list[str]:
    """The export path, the one transformers (or peft) line that loads it, and with a GGUF export
    the Ollama and llama.cpp lines."""
    out = Path(export_dir)
    cls = "AutoModelForCausalLM" if task == "causal-lm" else "AutoModelForSequenceClassification"
    lines = [f"model: {out}"]
    if lora:
        peft_cls = "AutoPeftModelForCausalLM" if task == "causal-lm" else "AutoPeftModelForSequenceClassification"
        lines.append(f"load it: from peft import {peft_cls}; model = {peft_cls}.from_pretrained('{out}')")
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
