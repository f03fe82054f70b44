"""One rank of the `hf-tp` baseline: transformers' own tensor parallelism (`tp_plan="auto"`, the
model's `base_model_tp_plan`, DTensor over a Gloo device mesh), an implementation we did not write.
`python -m xronos.bench.hftp_worker CONFIG.json`.

It shards evenly only: every head count and the MLP width must divide the world size
(`supported` says why not otherwise). A thin caller of the rank runtime (`xronos.node.rank.lifecycle`):
same join, same batches (rank 0 reads, broadcasts), same AdamW, same records gathering and
teardown as every strategy; only the engine is transformers'. transformers gives no per-collective
timings (its DTensor collectives are its own), so idle time is not split from compute; the harness
derives a CPU-utilisation idle estimate from the recorded CPU time instead.
"""

from __future__ import annotations

import os

import torch
from pydantic import Field

from xronos.bench.baseline import Baseline
from xronos.node.data.batches import Batch
from xronos.node.rank.optim import adamw
from xronos.node.runconfig import RankConfig
from xronos.node.rank.lifecycle import LocalFiles, MetricsFile, Rank, WeightSource, read_settings, run
from xronos.node.rank.spawn import main_process

FIELDS = ("iteration_s", "cpu_s", "data_s", "loss", "voluntary_ctx_switches", "involuntary_ctx_switches",
          "peak_rss")


class HFTPRankConfig(RankConfig):
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


class HFTP(Baseline):
    FIELDS = FIELDS

    def build(self, rank: Rank, weights: WeightSource, start: int) -> None:
        from transformers import AutoModelForSequenceClassification
        from transformers.distributed import DistributedConfig

        assert isinstance(weights, LocalFiles), "transformers reads its checkpoint itself"
        cfg = rank.cfg
        os.environ.update(RANK=str(cfg.rank), WORLD_SIZE=str(cfg.world_size), LOCAL_RANK=str(cfg.rank),
                          LOCAL_WORLD_SIZE=str(cfg.world_size))
        self.model = AutoModelForSequenceClassification.from_pretrained(
            weights.model_dir, distributed_config=DistributedConfig(tp_size=cfg.world_size), dtype=torch.float32,
            pad_token_id=rank.facts.pad_token_id, use_safetensors=True)
        self.model.train()
        self.opt = adamw(self.model.parameters(), lr=cfg.recipe.lr, weight_decay=cfg.recipe.weight_decay)

    def train(self, rank: Rank, batch: Batch, step: int) -> tuple[float, dict[str, float]]:
        loss = self.model(**batch.inputs()).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss), {}


def main(argv: list[str]) -> int:
    cfg = read_settings(argv, HFTPRankConfig, "xronos.bench.hftp_worker")
    run(cfg, HFTP(), weights=LocalFiles(cfg.recipe.model_dir), sink=MetricsFile())
    return 0


if __name__ == "__main__":
    main_process(main)
