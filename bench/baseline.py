"""What the baselines' engines share (transformers' TP, the pipeline): the runtime's batches and
one row of measurements per step — wall time, CPU time, the batch's wall time, loss, context
switches, peak RSS, and whatever the engine adds — named by the engine's `FIELDS`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from xronos.node.data.batches import Batch
from xronos.node.rank.metrics import Rusage
from xronos.node.rank.lifecycle import Engine, Rank, RankResult


@dataclass(frozen=True)
class Row:
    """One step's record: its values in the engine's FIELDS order."""

    step: int
    epoch: int
    loss: float
    values: tuple[float, ...]

    def as_row(self) -> list[float]:
        return list(self.values)


class Baseline(Engine):
    FIELDS: tuple[str, ...] = ()

    def begin(self, rank: Rank, start: int) -> None:
        self.rusage = Rusage()

    def train(self, rank: Rank, batch: Batch, step: int) -> tuple[float, dict[str, float]]:
        """Forward, backward and optimizer step on `batch`: the loss and the engine's own fields."""
        raise NotImplementedError

    def step(self, rank: Rank, batches: Iterator[tuple[int, Batch]], step: int) -> Row:
        rank.group.drain_timings()  # the engine times what it needs itself (e.g. the batch's wall time)
        rank.group.drain_spans()
        # the group's clock: virtual on an emulated box (the pipeline's point to point goes through it;
        # transformers' TP does not, and runs on the wall clock only); wall beside it
        t0, c0, w0 = rank.group.now(), time.process_time(), time.perf_counter()
        epoch, batch = next(batches)
        data_s = rank.group.now() - t0
        loss, extra = self.train(rank, batch, step)
        rank.group.settle()
        vol, inv = self.rusage.delta()
        values = dict(iteration_s=rank.group.now() - t0, cpu_s=time.process_time() - c0, data_s=data_s, loss=loss,
                      wall_s=time.perf_counter() - w0,
                      voluntary_ctx_switches=vol, involuntary_ctx_switches=inv, peak_rss=Rusage.peak_rss(), **extra)
        return Row(step, epoch, loss, tuple(values[f] for f in self.FIELDS))

    def iterations(self, p: torch.Tensor) -> list[dict[str, Any]]:
        return [dict(zip(self.FIELDS, row)) for row in p.tolist()]

    def report(self, rank: Rank, per_rank: list[torch.Tensor], result: RankResult) -> dict:
        return {"ranks": [{"iterations": self.iterations(p)} for p in per_rank]}
