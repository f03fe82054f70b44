"""The one door to the network for the TP engine: every collective goes through a TPGroup.

Gloo collectives on CPU block until every rank has joined, so the wall time of a call is this
rank's compute imbalance (waiting for the slowest rank) plus the transfer itself. The trainer drains
`timings` every iteration and compares them across ranks to split idle time from communication.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from collections.abc import Iterator

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class TPGroup:
    """A torch.distributed ProcessGroup (or None for a world of one) plus per-collective timings."""

    def __init__(self, pg: dist.ProcessGroup | None, rank: int, world_size: int) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"invalid rank {rank} for world size {world_size}")
        if pg is None and world_size != 1:
            raise ValueError(f"a world of {world_size} ranks needs a process group")
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.timings: list[tuple[str, float]] = []

    @classmethod
    def single(cls) -> TPGroup:
        """World of one: every collective is the identity and nothing is recorded."""
        return cls(None, 0, 1)

    @classmethod
    def from_default(cls) -> TPGroup:
        """The default group set up by `dist.init_process_group`."""
        return cls(dist.group.WORLD, dist.get_rank(), dist.get_world_size())

    def drain_timings(self) -> list[tuple[str, float]]:
        out, self.timings = self.timings, []
        return out

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.timings.append((name, time.perf_counter() - t0))

    def _global(self, r: int) -> int:
        return r if self.pg in (None, dist.group.WORLD) else dist.get_global_rank(self.pg, r)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place; returns `t`. `t` must be contiguous."""
        if self.world_size > 1:
            with self._timed(f"all_reduce_{op}"):
                dist.all_reduce(t, op=_OPS[op], group=self.pg)
        return t

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        if self.world_size > 1:
            with self._timed("broadcast"):
                dist.broadcast(t, src=self._global(src), group=self.pg)
        return t

    def send(self, t: torch.Tensor, dst: int) -> None:
        if self.world_size > 1 and t.numel() > 0:
            with self._timed("send"):
                dist.send(t.contiguous(), dst=self._global(dst), group=self.pg)

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        if self.world_size > 1 and t.numel() > 0:
            with self._timed("recv"):
                dist.recv(t, src=self._global(src), group=self.pg)
        return t

    def barrier(self) -> None:
        if self.world_size > 1:
            with self._timed("barrier"):
                dist.barrier(group=self.pg)
