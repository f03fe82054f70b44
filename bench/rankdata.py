"""Data for the baselines' ranks: rank 0 reads the file with the trainer's own BatchSource (so every
strategy trains on the very batches the TP runs see) and broadcasts each batch as tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field


class BaselineRankConfig(BaseModel):
    """What every baseline rank (pipeline, transformers' TP) is told: the TP runs' model, data and
    training settings, and where to meet. Each baseline adds its own fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_dir: str
    data_path: str
    text_column: str = "text"
    label_column: str = "label"
    batch_size: int = Field(gt=0)
    seq_len: int = Field(gt=0)
    lr: float = Field(gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    max_steps: int = Field(gt=0)
    seed: int = 0
    shuffle: bool = True
    threads: int = 1
    rank: int = 0
    rendezvous_host: str = "127.0.0.1"
    rendezvous_port: int = 29500
    metrics_path: str | None = None


def batch_source(cfg):
    from xronos.node.data import BatchSource
    from xronos.node.runconfig import RunConfig
    from xronos.protocol.layout import Layout

    run = RunConfig(model_dir=cfg.model_dir, data_path=cfg.data_path, task="classify",
                    layout=Layout(attn=(1,), mlp=(1,), vocab=(1,)),  # one rank; only the data is used
                    batch_size=cfg.batch_size, seq_len=cfg.seq_len, lr=cfg.lr, max_steps=cfg.max_steps,
                    seed=cfg.seed, shuffle=cfg.shuffle, text_column=cfg.text_column,
                    label_column=cfg.label_column, eval_fraction=getattr(cfg, "eval_fraction", 0.0))
    config = json.loads((Path(cfg.model_dir) / "config.json").read_text())
    num_labels = len(config["id2label"]) if config.get("id2label") else int(config.get("num_labels", 2))
    return BatchSource(run, num_labels)


def broadcast_batch(cfg, batches, pad_types: bool) -> dict[str, torch.Tensor]:
    B, S = cfg.batch_size, cfg.seq_len
    if batches is not None:
        _, b = next(batches)
        t = {"input_ids": b.input_ids, "attention_mask": b.attention_mask, "labels": b.labels}
        if pad_types:
            t["token_type_ids"] = b.token_type_ids
    else:
        t = {"input_ids": torch.empty(B, S, dtype=torch.long),
             "attention_mask": torch.empty(B, S, dtype=torch.long), "labels": torch.empty(B, dtype=torch.long)}
        if pad_types:
            t["token_type_ids"] = torch.empty(B, S, dtype=torch.long)
    for v in t.values():
        dist.broadcast(v, src=0)
    return t
