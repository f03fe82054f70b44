"""One rank of the pipeline-parallel baseline: `python -m xronos.bench.pp_worker CONFIG.json`.

A thin caller of the rank runtime (`xronos.node.rank.lifecycle`), with a pipeline stage as its engine.
Rank 0 reads the data (the trainer's own BatchSource, so the batches are the TP runs' batches)
and broadcasts each global batch; it is split into micro-batches that flow through the stages in
a 1F1B schedule: activations forward and gradients backward over Gloo point-to-point through the
rank's `TPGroup` (sends are asynchronous, receives block, which is what makes the schedule
deadlock-free). Gradients accumulate over the micro-batches, then every stage takes its own AdamW
step. With the recipe's `lora` every stage trains LoRA adapters on its frozen share of the base
(`Stage.add_lora`); a gradient then flows back only as far as the first stage that trains
something (a first stage holding the frozen embedding alone gets none, and runs forward only).

Per iteration and rank we record the time on the group's clock (virtual on the virtual clock, whose
point-to-point model is eager: a send goes on at once, a receive waits for the bytes), the time
blocked in receives (pipeline bubbles plus transfers: PP cannot separate the two), the time waiting
for sends to drain, context switches, peak RSS and the wall time; rank 0 gathers them (as tensors) and writes the metrics JSON.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
from pydantic import Field

from xronos.bench.baseline import Baseline
from xronos.bench.pp_model import Stage, StageSpan, num_blocks
from xronos.node.data.batches import Batch
from xronos.node.models.registry import family_for
from xronos.node.rank.optim import adamw
from xronos.node.runconfig import RankConfig
from xronos.node.rank.lifecycle import (
    LocalFiles, MetricsFile, Rank, RankResult, WeightSource, read_settings, run,
)
from xronos.node.rank.spawn import main_process
from xronos.node.tp.group import TPGroup


class PPRankConfig(RankConfig):
    # The recipe's eval_fraction: the held-out tail, so that the batches match the TP runs'; its
    # dropout overrides all dropout probabilities; its task is classify (`_classify`).
    micro_batches: int = Field(default=8, gt=0)
    spans: list[tuple[int, int]] = Field(min_length=1)  # layer range per pipeline rank
    grads_dir: str | None = None  # tests: write this stage's gradients after step `grads_step`
    grads_step: int = Field(default=0, ge=0)

    @property
    def world_size(self) -> int:
        return len(self.spans)


FIELDS = ("iteration_s", "cpu_s", "recv_wait_s", "send_wait_s", "data_s", "loss",
          "voluntary_ctx_switches", "involuntary_ctx_switches", "peak_rss", "wall_s")


class Pipe:
    """1F1B over one stage; `prev`/`next` are neighbouring ranks or None. `trains[r]`: does stage r
    train anything; a stage runs backward only if it or a stage before it does, and sends its input's
    gradient back only if a stage before it does."""

    def __init__(self, stage: Stage, group: TPGroup, M: int, hidden: int, trains: list[bool]) -> None:
        self.stage, self.group, self.M, self.hidden = stage, group, M, hidden
        self.rank, self.world = group.rank, group.world_size
        self.prev = self.rank - 1 if self.rank > 0 else None
        self.next = self.rank + 1 if self.rank < self.world - 1 else None
        self.grad_back = any(trains[:self.rank])  # the input's gradient is wanted upstream
        self.backward_here = self.grad_back or trains[self.rank]
        self.recv_wait = self.send_wait = 0.0
        self.pending: list[dist.Work] = []

    def _recv(self, shape: tuple[int, ...], src: int) -> torch.Tensor:
        buf = torch.empty(shape)
        t0 = self.group.now()
        self.group.recv(buf, src)
        self.recv_wait += self.group.now() - t0
        return buf

    def _send(self, t: torch.Tensor, dst: int) -> None:
        work = self.group.isend(t, dst)
        if work is not None:
            self.pending.append(work)

    def step(self, micro: list[dict[str, torch.Tensor]], total_rows: int) -> float:
        """Forward and backward of all micro-batches; returns the summed loss (last stage)."""
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        loss_sum = 0.0

        def forward(i: int) -> None:
            nonlocal loss_sum
            mb = micro[i]
            if self.prev is None:
                x_in, x = None, mb["input_ids"]
            else:
                b, s = mb["input_ids"].shape
                x_in = self._recv((b, s, self.hidden), self.prev).requires_grad_(self.grad_back)
                x = x_in
            out = self.stage(x, mb)
            if self.next is None:
                out = out / total_rows  # micro-batch sums / global rows = the batch mean
                loss_sum += float(out)
            else:
                self._send(out.detach(), self.next)
            saved[i] = (x_in, out)

        def backward(i: int) -> None:
            x_in, out = saved.pop(i)
            if not self.backward_here:
                return
            if self.next is None:
                out.backward()
            else:
                out.backward(self._recv(tuple(out.shape), self.next))
            if self.grad_back:
                self._send(x_in.grad, self.prev)

        warmup = min(self.world - self.rank - 1, self.M)
        for i in range(warmup):
            forward(i)
        for j in range(self.M - warmup):
            forward(warmup + j)
            backward(j)
        for j in range(self.M - warmup, self.M):
            backward(j)
        t0 = self.group.now()
        self.group.wait_all(self.pending)
        self.send_wait += self.group.now() - t0
        self.pending.clear()
        return loss_sum


def _save_grads(stage: Stage, out_dir: str, rank: int) -> None:
    from safetensors.torch import save_file

    grads = {stage.hf_name(n): p.grad.detach().clone() for n, p in stage.owned_parameters() if p.grad is not None}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    save_file(grads, str(Path(out_dir) / f"grads-rank{rank}.safetensors"))


class PP(Baseline):
    """This rank's pipeline stage (layers spans[rank]) with its own AdamW."""

    FIELDS = FIELDS

    def build(self, rank: Rank, weights: WeightSource, start: int) -> None:
        cfg = rank.cfg
        if cfg.world_size < 2:
            raise ValueError("the pipeline baseline needs at least two stages")
        assert isinstance(weights, LocalFiles), "a stage reads its layers from the checkpoint itself"
        B = num_blocks(rank.facts.config)
        start_l, stop_l = cfg.spans[cfg.rank]
        self.stage = Stage(weights.model_dir, StageSpan(start_l, stop_l, B), rank.facts.pad_token_id,
                           dropout=cfg.recipe.dropout)
        self.stage.train()
        trains = [True] * cfg.world_size
        # the TP engine's settings of the recipe's adapters on this family (its default targets too)
        lora = family_for(rank.facts.config).lora_settings(cfg.recipe.lora) if cfg.recipe.lora else None
        if lora is not None:
            self.stage.add_lora(lora.r, lora.alpha, lora.targets, lora.dropout)
            # under LoRA a stage trains iff it holds a block (its adapters) or the head
            trains = [span.owns_head or len(span.blocks) > 0 for span in (StageSpan(a, b, B) for a, b in cfg.spans)]
        owned = [p for _, p in self.stage.owned_parameters()]
        self.opt = adamw(owned, lr=cfg.recipe.lr, weight_decay=cfg.recipe.weight_decay) if owned else None
        self.pipe = Pipe(self.stage, rank.group, cfg.micro_batches, self.stage.config.hidden_size, trains)

    def train(self, rank: Rank, batch: Batch, step: int) -> tuple[float, dict[str, float]]:
        cfg, pipe = rank.cfg, self.pipe
        inputs = batch.inputs()
        micro = [dict(zip(inputs, parts)) for parts in zip(*(v.tensor_split(cfg.micro_batches) for v in inputs.values()))]
        pipe.recv_wait = pipe.send_wait = 0.0
        loss = pipe.step(micro, cfg.recipe.batch_size)
        if cfg.grads_dir is not None and step == cfg.grads_step:
            _save_grads(self.stage, cfg.grads_dir, cfg.rank)
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return loss, {"recv_wait_s": pipe.recv_wait, "send_wait_s": pipe.send_wait}

    def report(self, rank: Rank, per_rank: list[torch.Tensor], result: RankResult) -> dict:
        spans = rank.cfg.spans
        return {"spans": spans, "micro_batches": rank.cfg.micro_batches, "ranks": [
            {"span": list(spans[r]), "iterations": self.iterations(p)}
            for r, p in enumerate(per_rank)]}


def main(argv: list[str]) -> int:
    cfg = read_settings(argv, PPRankConfig, "xronos.bench.pp_worker")
    run(cfg, PP(), weights=LocalFiles(cfg.recipe.model_dir), sink=MetricsFile())
    return 0


if __name__ == "__main__":
    main_process(main)
