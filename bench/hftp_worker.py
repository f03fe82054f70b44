"""One rank of the `hf-tp` baseline: transformers' own tensor parallelism (`tp_plan="auto"`, the
model's `base_model_tp_plan`, DTensor over a Gloo device mesh), an implementation we did not write.
`python -m xronos.bench.hftp_worker CONFIG.json`.

It shards evenly only: every head count and the MLP width must divide the world size
(`supported` says why not otherwise). Same batches as every strategy (rank 0 reads, broadcasts),
same AdamW. transformers gives no per-collective timings, so idle time is not split from compute;
the harness derives a CPU-utilisation idle estimate from the recorded CPU time instead.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from pydantic import Field

from xronos.bench.rankdata import BaselineRankConfig, batch_source, broadcast_batch
from xronos.node.metrics import Rusage
from xronos.node.optim import adamw
from xronos.node.worker import leave

FIELDS = ("iteration_s", "cpu_s", "data_s", "loss", "voluntary_ctx_switches", "involuntary_ctx_switches",
          "peak_rss")


class HFTPRankConfig(BaselineRankConfig):
    world_size: int = Field(gt=1)


def supported(config: dict, n: int) -> str | None:
    """None when transformers' even TP can shard this model over n ranks, else the reason."""
    if config.get("model_type") != "llama":
        return f"hf-tp is run for the LLaMA architecture only (this is {config.get('model_type')})"
    sizes = {"attention heads": config["num_attention_heads"],
             "KV heads": config.get("num_key_value_heads") or config["num_attention_heads"],
             "MLP width": config["intermediate_size"], "vocabulary": config["vocab_size"]}
    bad = [f"{k} {v}" for k, v in sizes.items() if v % n]
    return f"even TP over {n} ranks impossible: {', '.join(bad)} not divisible by {n}" if bad else None


def run(cfg: HFTPRankConfig) -> None:
    from transformers import AutoModelForSequenceClassification
    from transformers.distributed import DistributedConfig

    os.environ.update(RANK=str(cfg.rank), WORLD_SIZE=str(cfg.world_size), LOCAL_RANK=str(cfg.rank),
                      LOCAL_WORLD_SIZE=str(cfg.world_size))
    dist.init_process_group("gloo", init_method=f"tcp://{cfg.rendezvous_host}:{cfg.rendezvous_port}",
                            rank=cfg.rank, world_size=cfg.world_size)
    source = batch_source(cfg) if cfg.rank == 0 else None
    header = torch.tensor([source.pad_token_id, int(source.has_token_types)] if source else [0, 0])
    dist.broadcast(header, src=0)
    torch.manual_seed(cfg.seed)
    model = AutoModelForSequenceClassification.from_pretrained(
        cfg.model_dir, distributed_config=DistributedConfig(tp_size=cfg.world_size), dtype=torch.float32,
        pad_token_id=int(header[0]))
    model.train()
    opt = adamw(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    batches = source.train_batches() if source is not None else None
    rusage = Rusage()
    rows = []
    for _ in range(cfg.max_steps):
        t0, c0 = time.perf_counter(), time.process_time()
        b = broadcast_batch(cfg, batches, bool(header[1]))
        data_s = time.perf_counter() - t0
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_v = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
        vol, inv = rusage.delta()
        rows.append([time.perf_counter() - t0, time.process_time() - c0, data_s, loss_v, vol, inv,
                     Rusage.peak_rss()])
    mine = torch.tensor(rows, dtype=torch.float64)
    parts = [torch.empty_like(mine) for _ in range(cfg.world_size)]
    dist.all_gather(parts, mine)
    if cfg.rank == 0 and cfg.metrics_path is not None:
        doc = {"ranks": [{"iterations": [dict(zip(FIELDS, r)) for r in p.tolist()]} for p in parts]}
        Path(cfg.metrics_path).write_text(json.dumps(doc, indent=1))
    leave()


def main(argv: list[str]) -> int:
    cfg = HFTPRankConfig.model_validate_json(Path(argv[1]).read_text())
    torch.set_num_threads(cfg.threads)
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
