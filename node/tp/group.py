"""The one door to the network for the TP engine: every collective goes through a TPGroup.

Gloo collectives on CPU block until every rank has joined, so the wall time of a call is this
rank's compute imbalance (waiting for the slowest rank) plus the transfer itself. The trainer drains
`timings` every iteration and compares them across ranks to split idle time from communication.

Each timed collective is also a `Span` (name, tag, start, seconds) on a timeline: the engine's
layers say which segment kind they belong to (`with group.segment("mlp"): ...`), so the time
*before* a collective tagged k — since the previous span ended — is this rank's compute of
segment k. `mark(tag)` adds a zero-length span where a segment ends without a collective (the
embedding's backward, the replicated head), and a world of one that traces records its would-be
collectives as marks, so even N = 1 splits its compute by kind. Collectives that are measurement
or control (the timing exchange, the pause flag, gathering records) pass `timed=False`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class Span(NamedTuple):
    """One event of a rank's timeline: a collective, or a mark (seconds 0)."""

    name: str  # all_reduce_sum|all_reduce_max|broadcast|send|recv|barrier|all_gather|mark
    tag: str | None  # the segment kind ("attn", "mlp", "vocab"), "data", "rest", or None
    start: float  # time.perf_counter() when it began
    seconds: float


class TPGroup:
    """A torch.distributed ProcessGroup (or None for a world of one) plus per-collective timings."""

    def __init__(self, pg: dist.ProcessGroup | None, rank: int, world_size: int, *,
                 trace: bool | None = None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"invalid rank {rank} for world size {world_size}")
        if pg is None and world_size != 1:
            raise ValueError(f"a world of {world_size} ranks needs a process group")
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.timings: list[tuple[str, float]] = []
        self.spans: list[Span] = []
        # Marks (and a world of one's would-be collectives) are recorded only when tracing: on by
        # default where collectives are timed anyway, off for TPGroup.single() (profiler, PP).
        self.trace = world_size > 1 if trace is None else trace
        self._tag: str | None = None

    @classmethod
    def single(cls, *, trace: bool = False) -> TPGroup:
        """World of one: every collective is the identity; nothing is recorded unless `trace`."""
        return cls(None, 0, 1, trace=trace)

    @classmethod
    def from_default(cls) -> TPGroup:
        """The default group set up by `dist.init_process_group`."""
        return cls(dist.group.WORLD, dist.get_rank(), dist.get_world_size())

    def drain_timings(self) -> list[tuple[str, float]]:
        out, self.timings = self.timings, []
        return out

    def drain_spans(self) -> list[Span]:
        out, self.spans = getattr(self, "spans", []), []
        return out

    # Subclasses that skip __init__ (the profiler's lone rank, load-only test groups) still work:
    # the tag and trace state are read with defaults.
    @contextmanager
    def segment(self, tag: str | None) -> Iterator[None]:
        """Tag the collectives issued inside with a segment kind."""
        saved = getattr(self, "_tag", None)
        self._tag = tag
        try:
            yield
        finally:
            self._tag = saved

    def mark(self, tag: str) -> None:
        """A segment ends here without a collective (zero-length span; only when tracing)."""
        if getattr(self, "trace", False):
            self.spans.append(Span("mark", tag, time.perf_counter(), 0.0))

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        dt = time.perf_counter() - t0
        self.timings.append((name, dt))
        self.spans.append(Span(name, getattr(self, "_tag", None), t0, dt))

    @contextmanager
    def _call(self, name: str, timed: bool) -> Iterator[bool]:
        """Yields whether to communicate; times it (or, in a traced world of one, marks it)."""
        if self.world_size == 1:
            if timed and getattr(self, "trace", False) and getattr(self, "_tag", None) is not None:
                self.spans.append(Span("mark", self._tag, time.perf_counter(), 0.0))
            yield False
        elif timed:
            with self._timed(name):
                yield True
        else:
            yield True

    def _global(self, r: int) -> int:
        return r if self.pg in (None, dist.group.WORLD) else dist.get_global_rank(self.pg, r)

    def all_reduce(self, t: torch.Tensor, op: str = "sum", *, timed: bool = True) -> torch.Tensor:
        """In place; returns `t`. `t` must be contiguous."""
        with self._call(f"all_reduce_{op}", timed) as go:
            if go:
                dist.all_reduce(t, op=_OPS[op], group=self.pg)
        return t

    def broadcast(self, t: torch.Tensor, src: int, *, timed: bool = True) -> torch.Tensor:
        with self._call("broadcast", timed) as go:
            if go:
                dist.broadcast(t, src=self._global(src), group=self.pg)
        return t

    def all_gather(self, t: torch.Tensor, *, timed: bool = True) -> list[torch.Tensor]:
        """Every rank's `t` (same shape and dtype everywhere), in rank order."""
        if self.world_size == 1:
            return [t]
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        with self._call("all_gather", timed):
            dist.all_gather(parts, t.contiguous(), group=self.pg)
        return parts

    def send(self, t: torch.Tensor, dst: int) -> None:
        if self.world_size > 1 and t.numel() > 0:
            with self._timed("send"):
                dist.send(t.contiguous(), dst=self._global(dst), group=self.pg)

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        if self.world_size > 1 and t.numel() > 0:
            with self._timed("recv"):
                dist.recv(t, src=self._global(src), group=self.pg)
        return t

    def barrier(self, *, timed: bool = True) -> None:
        with self._call("barrier", timed) as go:
            if go:
                dist.barrier(group=self.pg)
