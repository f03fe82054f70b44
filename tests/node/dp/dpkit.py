"""Test kit of the data-parallel runs: data rows, a LoRA start checkpoint both sides share, and the
single-device references (transformers, + peft under LoRA) the runs must reproduce."""

from __future__ import annotations

import random
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runkit (tests/node)
import runkit  # noqa: E402
from lora_ref import peft_targets, plain_name  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

LR, BATCH = 1e-4, 4
R, ALPHA = 4, 8.0
MAX_ABS, MAX_REL = 5e-4, 1e-5  # the bar (test_contract's), not loosened
FLAGS = ("--no-shuffle", "--dropout", "0", "--weight-decay", "0")


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"text": t, "label": rng.randrange(3)} for t in runkit.texts(n, seed)]


def lora_model(model_dir: Path, task: str, family: str, targets: tuple[str, ...], seed: int):
    """peft over the checkpoint with random A and B (B non-zero: A trains from the first step)."""
    from peft import LoraConfig, get_peft_model

    tok = runkit._tokenizer(model_dir)
    base = runkit.load_reference_model(model_dir, task, tok.pad_token_id)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=peft_targets(base, targets),
                     init_lora_weights=False, fan_in_fan_out=family == "gpt2",
                     task_type="SEQ_CLS" if task == "classify" else "CAUSAL_LM")
    return get_peft_model(base, cfg)


def lora_start(model, model_dir: Path, out: Path) -> Path:
    """The base checkpoint (and its tokenizer) plus peft's initial adapters under Xronos' names:
    where `xronos run --lora-r` starts, as the reference does."""
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, out / f.name)
    state = load_file(str(model_dir / "model.safetensors"))
    state.update((plain_name(n), p.detach().clone()) for n, p in model.named_parameters() if ".lora_" in n)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def lora_train(model, model_dir: Path, data: list[dict], task: str, steps: int, lr: float = LR,
               max_grad_norm: float | None = None, n_train: int | None = None):
    """peft + torch AdamW on one device, the run's batches; returns the merged transformers model."""
    tok = runkit._tokenizer(model_dir)
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
    for idx in runkit.batch_rows(len(data) if n_train is None else n_train, BATCH, steps, False, 0):
        model(**runkit._encode(tok, data, idx, task, runkit.SEQ_LEN)).loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(trained, max_grad_norm)
        opt.step()
        opt.zero_grad()
    return model.merge_and_unload()


def full_train(model_dir: Path, data: list[dict], task: str, steps: int, n_train: int | None = None):
    return runkit.reference_train(model_dir, data, task, steps=steps, batch_size=BATCH, lr=LR, n_train=n_train)[0]


def check(exported, reference, initial) -> tuple[float, float]:
    """The run's model == the reference within the bar, and it moved far beyond it (it trained)."""
    max_abs, rel = runkit.compare(exported, reference)
    assert max_abs <= MAX_ABS and rel <= MAX_REL, (max_abs, rel)
    moved_abs, moved_rel = runkit.compare(initial, reference)
    assert moved_rel > 100 * MAX_REL and moved_abs > MAX_ABS, (moved_abs, moved_rel)
    return max_abs, rel
