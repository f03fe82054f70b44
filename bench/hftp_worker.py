"""One rank of the `hf-tp` baseline: transformers' own tensor parallelism (`tp_plan="auto"`, the
model's `base_model_tp_plan`, DTensor over a Gloo device mesh), an implementation we did not write.
`python -m xronos.bench.hftp_worker CONFIG.json`.

It shards evenly only: every head count and the MLP width must divide the world size
(`supported` says why not otherwise). A thin caller of the rank runtime (`xronos.node.runtime`):
same join, same batches (rank 0 reads, broadcasts), same AdamW, same records gathering and
teardown as every strategy; only the engine is transformers'. transformers gives no per-collective
timings (its DTensor collectives are its own), so idle time is not split from compute; the harness
derives a CPU-utilisation idle estimate from the recorded CPU time instead.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from dataclasses import astuple, dataclass
from typing import Literal

import torch
from pydantic import Field

from xronos.node.data import Batch
from xronos.node.metrics import Rusage
from xronos.node.optim import adamw
from xronos.node.runconfig import RankConfig
from xronos.node.runtime import Engine, LocalFiles, MetricsFile, Rank, RankResult, WeightSource, read_settings, run

FIELDS = ("iteration_s", "cpu_s", "data_s", "loss", "voluntary_ctx_switches", "involuntary_ctx_switches",
          "peak_rss")


class HFTPRankConfig(RankConfig):
    task: Literal["classify"] = "classify"
    world_size: int = Field(gt=1)
    gloo_timeout_s: float = Field(default=1800.0, gt=0)  # torch's default: transformers' collectives wait there


def supported(config: dict, n: int) -> str | None:
    """None when transformers' even TP can shard this model over n ranks, else the reason."""
    if config.get("model_type") != "llama":
        return f"hf-tp is run for the LLaMA architecture only (this is {config.get('model_type')})"
    sizes = {"attention heads": config["num_attention_heads"],
             "KV heads": config.get("num_key_value_heads") or config["num_attention_heads"],
             "MLP width": config["intermediate_size"], "vocabulary": config["vocab_size"]}
    bad = [f"{k} {v}" for k, v in sizes.items() if v % n]
    return f"even TP over {n} ranks impossible: {', '.join(bad)} not divisible by {n}" if bad else None


@dataclass(frozen=True)
class HFTPRecord:
    step: int
    epoch: int
    iteration_s: float
    cpu_s: float
    data_s: float
    loss: float
    voluntary_ctx_switches: int
    involuntary_ctx_switches: int
    peak_rss: int

    def as_row(self) -> list[float]:
        return list(astuple(self)[2:])  # FIELDS


class HFTP(Engine):
    def build(self, rank: Rank, weights: WeightSource, start: int) -> None:
        from transformers import AutoModelForSequenceClassification
        from transformers.distributed import DistributedConfig

        assert isinstance(weights, LocalFiles), "transformers reads its checkpoint itself"
        cfg = rank.cfg
        os.environ.update(RANK=str(cfg.rank), WORLD_SIZE=str(cfg.world_size), LOCAL_RANK=str(cfg.rank),
                          LOCAL_WORLD_SIZE=str(cfg.world_size))
        self.model = AutoModelForSequenceClassification.from_pretrained(
            weights.model_dir, distributed_config=DistributedConfig(tp_size=cfg.world_size), dtype=torch.float32,
            pad_token_id=rank.facts.pad_token_id)
        self.model.train()
        self.opt = adamw(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.rusage = Rusage()

    def step(self, rank: Rank, batches: Iterator[tuple[int, Batch]], step: int) -> HFTPRecord:
        rank.group.drain_timings()  # the batch broadcasts: data_s below is their wall time
        rank.group.drain_spans()
        t0, c0 = time.perf_counter(), time.process_time()
        epoch, b = next(batches)
        data_s = time.perf_counter() - t0
        loss = self.model(**b.inputs()).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss_v = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
        vol, inv = self.rusage.delta()
        return HFTPRecord(step, epoch, time.perf_counter() - t0, time.process_time() - c0, data_s, loss_v, vol, inv,
                          Rusage.peak_rss())

    def report(self, rank: Rank, per_rank: list[torch.Tensor], result: RankResult) -> dict:
        return {"ranks": [{"iterations": [dict(zip(FIELDS, r)) for r in p.tolist()]} for p in per_rank]}


def main(argv: list[str]) -> int:
    cfg = read_settings(argv, HFTPRankConfig, "xronos.bench.hftp_worker")
    run(cfg, HFTP(), weights=LocalFiles(cfg.model_dir), sink=MetricsFile())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
