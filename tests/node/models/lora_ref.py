"""LoRA references: a peft model on a tiny transformers checkpoint, the start checkpoint both sides
share (the base plus peft's initial adapter weights, B non-zero), and peft's own training loop."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from ckpts import WEIGHT_DECAY, task_of
from safetensors.torch import load_file, save_file

STEPS, LR, MAX_GRAD_NORM = 20, 1e-3, 1.0
R, ALPHA = 4, 8.0
# Every target each family has, and one subset per family (what peft users often pick).
TARGETS = {"gpt2": ("c_attn", "c_proj", "c_fc"), "bert": ("query", "key", "value", "dense"),
           "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
SUBSET = {"gpt2": ("c_attn",), "bert": ("query", "value"), "llama": ("q_proj", "v_proj", "down_proj")}


def family_of(kind: str) -> str:
    return "gpt2" if kind.startswith("gpt2") else "bert" if kind.startswith(("bert", "roberta")) else "llama"


def hf_model(ckpt: Path, task: str):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return (AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification).from_pretrained(ckpt)


def peft_targets(model, targets: tuple[str, ...]) -> list[str]:
    """The HF module names peft adapts for `targets`, limited to the transformer blocks (BERT's
    pooler and RoBERTa's head also hold a `dense`; Xronos adapts block layers only)."""
    blocks = (".layer.", ".h.", ".layers.")
    return sorted(n for n, _ in model.named_modules()
                  if n.rsplit(".", 1)[-1] in targets and any(b in n for b in blocks))


def peft_model(ckpt: Path, kind: str, targets: tuple[str, ...]):
    from peft import LoraConfig, get_peft_model

    task = task_of(kind)
    base = hf_model(ckpt, task)
    torch.manual_seed(sum(map(ord, kind)) + 1)
    cfg = LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=peft_targets(base, targets),
                     init_lora_weights=False,  # B random too, so A gets gradients from step 0
                     fan_in_fan_out=family_of(kind) == "gpt2",
                     task_type="SEQ_CLS" if task == "classify" else "CAUSAL_LM")
    return get_peft_model(base, cfg)


def plain_name(peft_name: str) -> str:
    """peft's parameter name -> the HF-style name Xronos' checkpoints use."""
    return peft_name.removeprefix("base_model.model.").replace(".default", "").replace(".modules_to_save", "")


def start_checkpoint(model, ckpt: Path, out: Path) -> Path:
    """The base checkpoint plus the peft model's initial adapter weights under Xronos' names."""
    out.mkdir(parents=True, exist_ok=True)
    state = load_file(str(ckpt / "model.safetensors"))
    state.update((plain_name(n), p.detach().clone()) for n, p in model.named_parameters() if ".lora_" in n)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy2(ckpt / "config.json", out / "config.json")
    return out


def batches(kind: str):
    from ckpts import make_batch

    return [make_batch(kind, seed=s) for s in range(4)]


def peft_reference(model, kind: str) -> dict[str, torch.Tensor]:
    """peft + torch over STEPS steps from the peft model's initial weights (those of the start
    checkpoint): loss/<step>, logits (before and after), grad0/ and grad/ (first and last step),
    param/ and exp_avg/ at the end, by plain name."""
    trained = {plain_name(n): p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(trained.values(), lr=LR, weight_decay=WEIGHT_DECAY)
    bs = batches(kind)
    ref: dict[str, torch.Tensor] = {}
    model.train()
    with torch.no_grad():
        ref["logits_before"] = model(**{k: v for k, v in bs[0].items() if k != "labels"}).logits
    for step in range(STEPS):
        loss = model(**bs[step % len(bs)]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained.values(), MAX_GRAD_NORM)
        ref[f"loss/{step}"] = loss.detach().reshape(1)
        if step in (0, STEPS - 1):
            tag = "grad0" if step == 0 else "grad"
            ref.update((f"{tag}/{n}", p.grad.clone()) for n, p in trained.items())
        opt.step()
        opt.zero_grad(set_to_none=True)
    ref.update((f"param/{n}", p.detach().clone()) for n, p in trained.items())
    ref.update((f"exp_avg/{n}", opt.state[p]["exp_avg"].clone()) for n, p in trained.items())
    with torch.no_grad():
        ref["logits"] = model(**{k: v for k, v in bs[0].items() if k != "labels"}).logits
    return ref


def case_json(case: dict) -> str:
    return json.dumps(case, sort_keys=True)
