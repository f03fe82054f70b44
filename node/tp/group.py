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
or control (the timing exchange, the pause flag, gathering records, the teardown) pass `timed=False`.

A rank's group is made and ended here too: `TPGroup.join(...)` sets up Gloo (or a traced world of
one), `leave()` tears it down together with the peers. `TPGroup.alone(n, rank)` is one rank of a
world of n run by itself (the profiler, build-only tests): every collective is skipped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from xronos.node import pacer

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
                 trace: bool | None = None, alone: bool = False, pause_s: float = 0.0) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"invalid rank {rank} for world size {world_size}")
        if pg is None and world_size != 1 and not alone:
            raise ValueError(f"a world of {world_size} ranks needs a process group")
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.alone = alone  # the peers' collectives are skipped: this rank runs by itself
        # Alone: sleep this long at every skipped timed collective, as a training rank waits in it
        # (under a CFS quota the next segment then starts with a full quota: the profiler must see
        # that too); `paused_s` sums the sleeps so that the profiler's clock can leave them out.
        if not (pause_s >= 0 and pause_s < 1):
            raise ValueError(f"pause_s must be in [0, 1) s, got {pause_s!r}")
        self.pause_s, self.paused_s = pause_s, 0.0
        self.timings: list[tuple[str, float]] = []
        self.spans: list[Span] = []
        # Marks (and a world of one's would-be collectives) are recorded only when tracing: on by
        # default where collectives are timed anyway, off for TPGroup.single() (profiler, PP).
        self.trace = (world_size > 1 and not alone) if trace is None else trace
        self._tag: str | None = None
        self._joined = False  # this group set up the default process group (join) and ends it (leave)

    @classmethod
    def single(cls, *, trace: bool = False) -> TPGroup:
        """World of one: every collective is the identity; nothing is recorded unless `trace`."""
        return cls(None, 0, 1, trace=trace)

    @classmethod
    def alone(cls, world_size: int, rank: int = 0, pause_s: float = 0.0) -> TPGroup:
        """Rank `rank` of a world of `world_size` run by itself: the peers' collectives are skipped,
        so its time is its own compute only (the profiler), and nothing is recorded; with
        `pause_s`, each skipped collective is a sleep of that long instead (see `pause`)."""
        return cls(None, rank, world_size, trace=False, alone=True, pause_s=pause_s)

    def pause(self) -> None:
        """Alone: wait `pause_s` where a training rank would wait in a collective (summed in
        `paused_s`)."""
        if self.alone and self.pause_s > 0:
            t0 = time.perf_counter()
            time.sleep(self.pause_s)
            self.paused_s += time.perf_counter() - t0

    @classmethod
    def from_default(cls) -> TPGroup:
        """The default group set up by `dist.init_process_group`."""
        return cls(dist.group.WORLD, dist.get_rank(), dist.get_world_size())

    @classmethod
    def join(cls, rank: int, world_size: int, host: str, port: int, timeout_s: float) -> TPGroup:
        """This process's rank of a Gloo world meeting at tcp://host:port (collectives give up after
        `timeout_s`); a world of one needs no Gloo and traces its would-be collectives, so a lone
        rank still splits its compute by kind. End it with `leave()`."""
        if world_size == 1:
            return cls.single(trace=True)
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        group = cls(dist.group.WORLD, rank, world_size)
        group._joined = True
        return group

    def leave(self) -> None:
        """Tear the Gloo group down together (untimed barrier, then destroy). A rank that destroys
        its group while a peer's pair still has traffic in flight can abort that peer (SIGABRT,
        "terminate called without an active exception"), which the launcher then reports as a
        failed run. Only a group that `join` made ends the process group."""
        if self._joined and dist.is_initialized():
            self.barrier(timed=False)
            dist.destroy_process_group()
            self._joined = False

    def drain_timings(self) -> list[tuple[str, float]]:
        out, self.timings = self.timings, []
        return out

    def drain_spans(self) -> list[Span]:
        out, self.spans = self.spans, []
        return out

    @contextmanager
    def segment(self, tag: str | None) -> Iterator[None]:
        """Tag the collectives issued inside with a segment kind."""
        saved = self._tag
        self._tag = tag
        try:
            yield
        finally:
            self._tag = saved

    def mark(self, tag: str) -> None:
        """A segment ends here without a collective (zero-length span; only when tracing)."""
        if self.trace:
            self.spans.append(Span("mark", tag, time.perf_counter(), 0.0))

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        dt = time.perf_counter() - t0
        self.timings.append((name, dt))
        self.spans.append(Span(name, self._tag, t0, dt))

    @staticmethod
    @contextmanager
    def _paced() -> Iterator[None]:
        """Under the emulator's paced CPU (`xronos.node.pacer`), the rank first waits out what a
        core of its share would still be computing, then meets its peers; the wait for them is not
        compute. Elsewhere nothing."""
        p = pacer.current()
        if p is not None:
            p.pace()
        try:
            yield
        finally:
            if p is not None:
                p.restart()

    def settle(self) -> None:
        """Where an iteration ends without a collective: a paced rank pays for its last compute
        (the optimizer step) within the iteration that did it."""
        p = pacer.current()
        if p is not None:
            p.pace()

    @contextmanager
    def _call(self, name: str, timed: bool) -> Iterator[bool]:
        """Yields whether to communicate; times it (or, in a traced world of one, marks it)."""
        with self._paced(), self._call_unpaced(name, timed) as go:
            yield go

    @contextmanager
    def _call_unpaced(self, name: str, timed: bool) -> Iterator[bool]:
        if self.world_size == 1 or self.alone:
            if timed:
                self.pause()
            if timed and self.trace and self._tag is not None:
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
        """Every rank's `t` (same shape and dtype everywhere), in rank order (alone: `t` for all)."""
        if self.world_size == 1 or self.alone:
            return [t] * self.world_size
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        with self._call("all_gather", timed):
            dist.all_gather(parts, t.contiguous(), group=self.pg)
        return parts

    def _p2p(self, t: torch.Tensor) -> bool:
        return self.world_size > 1 and not self.alone and t.numel() > 0

    def send(self, t: torch.Tensor, dst: int) -> None:
        if self._p2p(t):
            with self._paced(), self._timed("send"):
                dist.send(t.contiguous(), dst=self._global(dst), group=self.pg)

    def isend(self, t: torch.Tensor, dst: int) -> dist.Work | None:
        """A send that returns at once (`wait()` the result before reusing `t`); untimed: its
        wall time says nothing (the pipeline baseline times the wait itself)."""
        if self._p2p(t):
            return dist.isend(t.contiguous(), dst=self._global(dst), group=self.pg)
        return None

    def wait_all(self, works: list[dist.Work]) -> None:
        """Wait for `isend`s: a wait for peers like any other (paced; untimed, as `isend`)."""
        with self._paced():
            for w in works:
                w.wait()

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        if self._p2p(t):
            with self._paced(), self._timed("recv"):
                dist.recv(t, src=self._global(src), group=self.pg)
        return t

    def exchange(self, sends: dict[int, list[torch.Tensor]], recvs: dict[int, list[torch.Tensor]]) -> None:
        """Point to point with many peers at once (a live re-shard): `sends[peer]` go to `peer`,
        `recvs[peer]` are filled from it, in list order on both sides; returns when all are done.
        Every send is posted with its receives, so no order of peers can deadlock. Untimed: the
        re-shard is timed as a whole by its caller, between two iterations."""
        if self.world_size == 1 or self.alone:
            return
        with self._paced():
            self._exchange(sends, recvs)

    def _exchange(self, sends: dict[int, list[torch.Tensor]], recvs: dict[int, list[torch.Tensor]]) -> None:
        works = [dist.irecv(t, src=self._global(peer), group=self.pg)
                 for peer, ts in sorted(recvs.items()) for t in ts if t.numel()]
        works += [dist.isend(t.contiguous(), dst=self._global(peer), group=self.pg)
                  for peer, ts in sorted(sends.items()) for t in ts if t.numel()]
        for w in works:
            w.wait()

    def barrier(self, *, timed: bool = True) -> None:
        with self._call("barrier", timed) as go:
            if go:
                dist.barrier(group=self.pg)
