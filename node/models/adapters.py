"""A LoRA job's exports: the PEFT adapter directory and, on request, the merged full model.

The consolidated state (`gather_full`, HF names) of a LoRA model holds the frozen base, each
adapted module's `<module>.lora_A.weight` [r, in] / `<module>.lora_B.weight` [out, r] and, for
classification, the trained head. peft saves an adapter as `base_model.model.<module>.lora_A.weight`
and a `modules_to_save` head as `base_model.model.<head>.<param>` (its adapter name stripped), with
the LoraConfig in adapter_config.json; `peft.PeftModel.from_pretrained(base, dir)` loads that.
The merged model is the base with W <- W + scale * B A (transposed for GPT-2's [in, out] Conv1D),
the adapters dropped: a plain HF directory.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from xronos.node.tp.lora import TRAINED_HEADS, LoraSettings

from .export import copy_tokenizer, save_hf_dir
from .exportfiles import ADAPTER_FILE, MERGED_SUBDIR
from .stage import staged
from .registry import family_for

PEFT_PREFIX = "base_model.model."


def is_lora_key(name: str) -> bool:
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


def is_trained_head(name: str) -> bool:
    return name.split(".", 1)[0] in TRAINED_HEADS


def exported(hf_name: str, task: str) -> bool:
    """A tensor an adapter-only export writes (`adapter_state`): the adapters, and the trained
    classification head."""
    return is_lora_key(hf_name) or (task == "classify" and is_trained_head(hf_name))


def adapter_state(state: Mapping[str, torch.Tensor], task: str) -> dict[str, torch.Tensor]:
    """peft's adapter tensors out of a consolidated state."""
    out = {PEFT_PREFIX + k: v for k, v in state.items() if is_lora_key(k)}
    if task == "classify":
        out.update((PEFT_PREFIX + k, v) for k, v in state.items() if is_trained_head(k))
    return out


def peft_config(config: dict[str, Any], task: str, settings: LoraSettings, modules: list[str],
                base_path: str | None) -> Any:
    """peft's LoraConfig for this job: target_modules the exact adapted modules (so nothing beyond
    them, e.g. BERT's pooler dense, is matched by name)."""
    from peft import LoraConfig

    return LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=list(modules), fan_in_fan_out=family_for(config).fan_in_fan_out,
                      bias="none", task_type="SEQ_CLS" if task == "classify" else "CAUSAL_LM",
                      base_model_name_or_path=base_path, inference_mode=True)


def save_adapter_dir(out_dir: str | Path, config: dict[str, Any], task: str, state: Mapping[str, torch.Tensor],
                     settings: LoraSettings, modules: list[str], model_dir: str | Path | None = None) -> Path:
    """adapter_config.json + adapter_model.safetensors (+ the tokenizer files), as peft writes them."""
    out = Path(out_dir)
    tensors = adapter_state(state, task)
    if not any(is_lora_key(k) for k in tensors):
        raise ValueError("no LoRA tensors in the state to export")
    with staged(out) as stage:  # never through a link left in the export directory (stage.py)
        peft_config(config, task, settings, modules, str(model_dir) if model_dir else None).save_pretrained(str(stage))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(stage / ADAPTER_FILE),
                  metadata={"format": "pt"})
        if model_dir is not None:
            copy_tokenizer(Path(model_dir), stage)
    return out


@torch.no_grad()
def merged_state(state: Mapping[str, torch.Tensor], config: dict[str, Any],
                 settings: LoraSettings) -> dict[str, torch.Tensor]:
    """The base weights with every adapter merged in (W + scale * B A), adapters dropped."""
    fan_in_fan_out = family_for(config).fan_in_fan_out
    out = {k: v for k, v in state.items() if not is_lora_key(k)}
    for key in (k for k in state if k.endswith(".lora_A.weight")):
        module = key.removesuffix(".lora_A.weight")
        a, b = state[key], state[f"{module}.lora_B.weight"]  # [r, in], [out, r]
        delta = (b @ a) * settings.scale  # [out, in]
        w = out[f"{module}.weight"]
        out[f"{module}.weight"] = w + (delta.t() if fan_in_fan_out else delta).to(w.dtype)
    return out


def save_lora_exports(out_dir: str | Path, config: dict[str, Any], task: str, state: Mapping[str, torch.Tensor],
                      settings: LoraSettings, modules: list[str], model_dir: str | Path | None,
                      merged: bool) -> Path:
    """The adapter directory at out_dir and, with `merged`, the merged model in out_dir/merged."""
    out = save_adapter_dir(out_dir, config, task, state, settings, modules, model_dir)
    if merged:
        save_hf_dir(out / MERGED_SUBDIR, config, task, merged_state(state, config, settings), model_dir)
    return out
