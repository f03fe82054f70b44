"""Tiny checkpoints, data and the single-device reference shared by the baseline tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

TINY = {
    "llama": dict(model_type="llama", hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, vocab_size=100, max_position_embeddings=64,
                  pad_token_id=0, tie_word_embeddings=False),
    "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=4, n_head=4, vocab_size=100, n_positions=64,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0),
    "roberta": dict(model_type="roberta", hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                    intermediate_size=64, vocab_size=100, max_position_embeddings=80, pad_token_id=0,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0),
    "bert": dict(model_type="bert", hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                 intermediate_size=64, vocab_size=100, max_position_embeddings=64, pad_token_id=0,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "qwen2": dict(model_type="qwen2", hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
                  tie_word_embeddings=False, vocab_size=300),  # a qwen2 checkpoint gets a byte-level tokenizer (261 ids)
}


def _data(path: Path, rows: int = 24) -> Path:
    rng = random.Random(1)
    with open(path, "w") as f:
        for _ in range(rows):  # uneven lengths: padding and masks matter
            words = " ".join(f"w{rng.randrange(4, 100)}" for _ in range(rng.randrange(3, 14)))
            f.write(json.dumps({"text": words, "label": rng.randrange(2)}) + "\n")
    return path


def _reference(model_dir: Path, data: Path) -> tuple[float, dict[str, torch.Tensor]]:
    from transformers import AutoModelForSequenceClassification

    from xronos.node.data.batches import BatchSource
    from xronos.node.runconfig import RunConfig
    from xronos.protocol.layout import Layout

    run = RunConfig(recipe=dict(model_dir=str(model_dir), data_path=str(data), task="classify", batch_size=8,
                                seq_len=16, lr=1e-3, max_steps=1, seed=0, eval_fraction=0.0, max_grad_norm=None),
                    layout=Layout(attn=(1,), mlp=(1,), vocab=(1,)))
    _, b = next(BatchSource(run.recipe, 2).train_batches())
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir))
    model.train()
    kw = {"token_type_ids": b.token_type_ids} if b.token_type_ids is not None else {}
    loss = model(input_ids=b.input_ids, attention_mask=b.attention_mask, labels=b.labels, **kw).loss
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
