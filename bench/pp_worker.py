"""One rank of the pipeline-parallel baseline: `python -m xronos.bench.pp_worker CONFIG.json`.

Rank 0 reads the data (the trainer's own BatchSource, so the batches are the TP runs' batches)
and broadcasts each global batch; it is split into micro-batches that flow through the stages in
a 1F1B schedule: activations forward and gradients backward over Gloo point-to-point (sends are
asynchronous, receives block, which is what makes the schedule deadlock-free). Gradients
accumulate over the micro-batches, then every stage takes its own AdamW step.

Per iteration and rank we record the wall time, the time blocked in receives (pipeline bubbles
plus transfers: PP cannot separate the two), the time waiting for sends to drain, context
switches and peak RSS; rank 0 gathers them (as tensors) and writes the metrics JSON.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from pydantic import Field

from xronos.bench.pp_model import Stage, StageSpan, num_blocks
from xronos.bench.rankdata import BaselineRankConfig, batch_source, broadcast_batch
from xronos.node.metrics import Rusage
from xronos.node.optim import adamw


class PPRankConfig(BaselineRankConfig):
    eval_fraction: float = Field(default=0.0, ge=0, lt=1)  # held-out tail, so batches match the TP runs'
    dropout: float | None = Field(default=None, ge=0, lt=1)  # override all dropout probabilities
    micro_batches: int = Field(default=8, gt=0)
    spans: list[tuple[int, int]] = Field(min_length=1)  # layer range per pipeline rank
    gloo_timeout_s: float = 300.0
    grads_dir: str | None = None  # tests: write this stage's gradients after the first step


FIELDS = ("iteration_s", "cpu_s", "recv_wait_s", "send_wait_s", "data_s", "loss",
          "voluntary_ctx_switches", "involuntary_ctx_switches", "peak_rss")


class Pipe:
    """1F1B over one stage; `prev`/`next` are neighbouring ranks or None."""

    def __init__(self, stage: Stage, rank: int, world: int, M: int, hidden: int) -> None:
        self.stage, self.rank, self.world, self.M, self.hidden = stage, rank, world, M, hidden
        self.prev = rank - 1 if rank > 0 else None
        self.next = rank + 1 if rank < world - 1 else None
        self.recv_wait = self.send_wait = 0.0
        self.pending: list[dist.Work] = []

    def _recv(self, shape: tuple[int, ...], src: int) -> torch.Tensor:
        buf = torch.empty(shape)
        t0 = time.perf_counter()
        dist.recv(buf, src=src)
        self.recv_wait += time.perf_counter() - t0
        return buf

    def _send(self, t: torch.Tensor, dst: int) -> None:
        self.pending.append(dist.isend(t.contiguous(), dst=dst))

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
                x_in = self._recv((b, s, self.hidden), self.prev).requires_grad_()
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
            if self.next is None:
                out.backward()
            else:
                out.backward(self._recv(tuple(out.shape), self.next))
            if self.prev is not None:
                self._send(x_in.grad, self.prev)

        warmup = min(self.world - self.rank - 1, self.M)
        for i in range(warmup):
            forward(i)
        for j in range(self.M - warmup):
            forward(warmup + j)
            backward(j)
        for j in range(self.M - warmup, self.M):
            backward(j)
        t0 = time.perf_counter()
        for w in self.pending:
            w.wait()
        self.send_wait += time.perf_counter() - t0
        self.pending.clear()
        return loss_sum


def _save_grads(stage: Stage, out_dir: str, rank: int) -> None:
    from safetensors.torch import save_file

    grads = {stage.hf_name(n): p.grad.detach().clone() for n, p in stage.owned_parameters() if p.grad is not None}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    save_file(grads, str(Path(out_dir) / f"grads-rank{rank}.safetensors"))


def run(cfg: PPRankConfig) -> None:
    world = len(cfg.spans)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://{cfg.rendezvous_host}:{cfg.rendezvous_port}",
                                rank=cfg.rank, world_size=world, timeout=timedelta(seconds=cfg.gloo_timeout_s))
    else:
        raise ValueError("the pipeline baseline needs at least two stages")
    config = json.loads((Path(cfg.model_dir) / "config.json").read_text())
    B = num_blocks(config)
    source = batch_source(cfg) if cfg.rank == 0 else None
    header = torch.tensor([source.pad_token_id, int(source.has_token_types)] if source else [0, 0])
    dist.broadcast(header, src=0)
    pad_id, has_types = int(header[0]), bool(header[1])
    torch.manual_seed(cfg.seed)  # a fresh classification head starts identical to the TP runs'
    start, stop = cfg.spans[cfg.rank]
    stage = Stage(cfg.model_dir, StageSpan(start, stop, B), pad_id, dropout=cfg.dropout)
    stage.train()
    opt = adamw([p for _, p in stage.owned_parameters()], lr=cfg.lr, weight_decay=cfg.weight_decay)
    pipe = Pipe(stage, cfg.rank, world, cfg.micro_batches, stage.config.hidden_size)
    batches = source.train_batches() if source is not None else None
    rusage = Rusage()
    rows: list[list[float]] = []
    for step in range(cfg.max_steps):
        t0, c0 = time.perf_counter(), time.process_time()
        batch = broadcast_batch(cfg, batches, has_types)
        data_s = time.perf_counter() - t0
        micro = [dict(zip(batch, parts)) for parts in zip(*(v.tensor_split(cfg.micro_batches) for v in batch.values()))]
        pipe.recv_wait = pipe.send_wait = 0.0
        loss = pipe.step(micro, cfg.batch_size)
        if cfg.grads_dir is not None and step == 0:
            _save_grads(stage, cfg.grads_dir, cfg.rank)
        opt.step()
        opt.zero_grad(set_to_none=True)
        it = time.perf_counter() - t0
        vol, inv = rusage.delta()
        rows.append([it, time.process_time() - c0, pipe.recv_wait, pipe.send_wait, data_s, loss, vol, inv, Rusage.peak_rss()])
    mine = torch.tensor(rows, dtype=torch.float64)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    if cfg.rank == 0 and cfg.metrics_path is not None:
        doc = {"spans": cfg.spans, "micro_batches": cfg.micro_batches, "ranks": [
            {"span": list(cfg.spans[r]), "iterations": [dict(zip(FIELDS, row)) for row in p.tolist()]}
            for r, p in enumerate(parts)]}
        Path(cfg.metrics_path).write_text(json.dumps(doc, indent=1))
    # Tear down together: a rank that closes its Gloo pairs while a peer still uses them can make
    # that peer's transport thread abort (seen once in CI as SIGABRT of the last stage).
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m xronos.bench.pp_worker CONFIG.json", file=sys.stderr)
        return 2
    cfg = PPRankConfig.model_validate_json(Path(argv[1]).read_text())
    torch.set_num_threads(cfg.threads)
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
