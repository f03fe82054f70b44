"""The one door to the network for the TP engine: every collective goes through a TPGroup.

Gloo collectives on CPU block until every rank has joined, so the time of a call is this rank's
compute imbalance (waiting for the slowest rank) plus the transfer itself. The trainer drains
`timings` every iteration and compares them across ranks to split idle time from communication.
Times are read from the group's clock (`xronos.node.tp.clock`): wall time on a real box, the
emulator's virtual or paced clock on an emulated one, given when the rank process starts.

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from xronos.node.tp import progress
from xronos.node.tp.clock import WALL, Clock, Flight, Meet, Runner
from xronos.node.tp.flight import _OPS, _SLOT_DTYPES, Pending, _Flight


def _cpu(call: Callable[[], object]) -> float:
    """Process CPU seconds of `call` (every thread: Gloo's own do the copying and summing)."""
    c0 = time.process_time()
    call()
    return time.process_time() - c0


class _Works:
    """What `isend` returns: its sends (the payload, and a clock's slots where it has any)."""

    def __init__(self) -> None:
        self.items: list[dist.Work] = []

    def wait(self) -> None:
        for w in self.items:
            w.wait()


class Span(NamedTuple):
    """One event of a rank's timeline: a collective, or a mark (seconds 0)."""

    name: str  # all_reduce_sum|all_reduce_max|broadcast|send|recv|barrier|all_gather|mark
    tag: str | None  # the segment kind ("attn", "mlp", "vocab"), "data", "rest", or None
    start: float  # on the group's clock (`xronos.node.tp.clock`; wall: time.perf_counter()) when it began
    seconds: float


class TPGroup:
    """A torch.distributed ProcessGroup (or None for a world of one) plus per-collective timings."""

    def __init__(self, pg: dist.ProcessGroup | None, rank: int, world_size: int, *,
                 trace: bool | None = None, alone: bool = False, pause_s: float = 0.0,
                 clock: Clock | None = None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"invalid rank {rank} for world size {world_size}")
        if pg is None and world_size != 1 and not alone:
            raise ValueError(f"a world of {world_size} ranks needs a process group")
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.alone = alone  # the peers' collectives are skipped: this rank runs by itself
        # What the group's times are read from and its collectives are told to: wall time, or an
        # emulated box's clock given to the rank when its process starts (`xronos.node.tp.clock`).
        self.clock = WALL if clock is None else clock
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
        # Overlap communication with compute where the sums stay the same (`node/tp/overlap.py`):
        # the layers read it when they run. Off by default: the runtime sets it.
        self.overlap = False
        self.chunks = 1  # chunking: a rank's batch rows in this many chunks (1: none)
        self.launched = 0  # asynchronous collectives started (a rank's count of overlapped ones)
        self.late: list = []  # weight gradients a row layer left for the next region's window (overlap.py)
        self.late_task = -1  # the backward pass (autograd graph task) they belong to
        # Inside a chunked pass's forward: where the current cell's region entries go (overlap.py's
        # `enter_cut`); None elsewhere.
        self.entries: list | None = None

    @classmethod
    def single(cls, *, trace: bool = False, clock: Clock | None = None) -> TPGroup:
        """World of one: every collective is the identity; nothing is recorded unless `trace`."""
        return cls(None, 0, 1, trace=trace, clock=clock)

    @classmethod
    def alone(cls, world_size: int, rank: int = 0, pause_s: float = 0.0, clock: Clock | None = None) -> TPGroup:
        """Rank `rank` of a world of `world_size` run by itself: the peers' collectives are skipped,
        so its time is its own compute only (the profiler), and nothing is recorded; with
        `pause_s`, each skipped collective is a sleep of that long instead (see `pause`)."""
        return cls(None, rank, world_size, trace=False, alone=True, pause_s=pause_s, clock=clock)

    def pause(self) -> None:
        """Alone: wait `pause_s` where a training rank would wait in a collective (summed in
        `paused_s`)."""
        if self.alone and self.pause_s > 0:
            t0 = time.perf_counter()
            time.sleep(self.pause_s)
            self.paused_s += time.perf_counter() - t0

    @classmethod
    def from_default(cls, clock: Clock | None = None) -> TPGroup:
        """The default group set up by `dist.init_process_group`."""
        return cls(dist.group.WORLD, dist.get_rank(), dist.get_world_size(), clock=clock)

    @classmethod
    def join(cls, rank: int, world_size: int, host: str, port: int, timeout_s: float,
             clock: Clock | None = None) -> TPGroup:
        """This process's rank of a Gloo world meeting at tcp://host:port (collectives give up after
        `timeout_s`); a world of one needs no Gloo and traces its would-be collectives, so a lone
        rank still splits its compute by kind. End it with `leave()`. `clock`: an emulated box's
        (`xronos.node.emulate.process_clock()`), else wall time."""
        if world_size == 1:
            return cls.single(trace=True, clock=clock)
        progress.made(lambda: dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank,
                                                      world_size=world_size, timeout=timedelta(seconds=timeout_s)))
        group = cls(dist.group.WORLD, rank, world_size, clock=clock)
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
            self.spans.append(Span("mark", tag, self.clock.skipped(Meet("mark", tag, 0, True)), 0.0))

    def now(self) -> float:
        """The time on this group's clock (wall time unless an emulator gave it another)."""
        return self.clock.now()

    def _meet(self, op: str, timed: bool, nbytes: int, run: Runner, peer: int | None = None) -> None:
        """One collective through the clock; timed ones are recorded (in a traced world of one, or
        alone, the skipped ones are marks)."""
        meet = Meet(op, self._tag, nbytes, timed, peer)
        if self.world_size == 1 or self.alone:
            self._skip(meet)
            return
        self._record(meet, *self.clock.meet(meet, run, self.rank, self.world_size))

    def _skip(self, meet: Meet) -> None:
        if meet.timed:
            self.pause()
            at = self.clock.skipped(meet)
            if self.trace and meet.tag is not None:
                self.spans.append(Span("mark", meet.tag, at, 0.0))

    def _record(self, meet: Meet, start: float, end: float) -> None:
        if meet.timed:
            self.timings.append((meet.op, end - start))
            self.spans.append(Span(meet.op, meet.tag, start, end - start))

    def settle(self) -> None:
        """Where an iteration ends without a collective (after the optimizer step): the clock books
        the last compute within the iteration that did it."""
        self.clock.settle()

    def _carry(self, slots: torch.Tensor | None) -> torch.Tensor | None:
        """A clock's slots on their own (an all-reduce of a few float64s) where the collective
        itself cannot carry them."""
        if slots is not None:
            dist.all_reduce(slots, group=self.pg)
        return slots

    def _global(self, r: int) -> int:
        return r if self.pg in (None, dist.group.WORLD) else dist.get_global_rank(self.pg, r)

    def all_reduce(self, t: torch.Tensor, op: str = "sum", *, timed: bool = True) -> torch.Tensor:
        """In place; returns `t`. `t` must be contiguous."""
        n = t.numel()

        def run(slots: torch.Tensor | None) -> tuple[torch.Tensor | None, float]:
            if slots is not None and t.dtype in _SLOT_DTYPES:
                # The slots ride in the same call (one Gloo round, not two). Every rank fills only its
                # own, non-negative entries, so a max-reduce gives them back as a sum would.
                flat = t.view(-1)
                buf = torch.cat([flat, slots.to(t.dtype)])
                cpu = _cpu(lambda: dist.all_reduce(buf, op=_OPS[op], group=self.pg))
                flat.copy_(buf[:n])
                return buf[n:].to(torch.float64), cpu
            back = self._carry(slots)
            return back, _cpu(lambda: dist.all_reduce(t, op=_OPS[op], group=self.pg))

        self._meet(f"all_reduce_{op}", timed, n * t.element_size(), run)
        return t

    def all_reduce_async(self, t: torch.Tensor, op: str = "sum", *, timed: bool = True) -> Pending:
        """Start an all-reduce of `t` (in place, contiguous) and return at once, so that the rank
        computes while it travels; `wait()` the result before touching `t`. Its span is the wait
        (what the compute since the launch did not hide), tagged with the segment kind current at
        the launch; a world of one marks there too. Wait in launch order (Gloo and the virtual
        clock's link both carry them in that order)."""
        meet = Meet(f"all_reduce_{op}", self._tag, t.numel() * t.element_size(), timed)
        if self.world_size == 1 or self.alone:
            return Pending(self, t, meet, None)

        def start(slots: torch.Tensor | None) -> Flight:
            return _Flight(t, slots, op, self.pg)

        if self.launched == 0:
            progress.promote()  # Gloo's threads ahead of this one while calls fly (progress.py)
        self.launched += 1
        return Pending(self, t, meet, self.clock.launch(meet, start, self.rank, self.world_size))

    def _land(self, p: Pending) -> None:
        if p.ticket is None:
            self._skip(p.meet)
        else:
            self._record(p.meet, *self.clock.land(p.ticket))

    def broadcast(self, t: torch.Tensor, src: int, *, timed: bool = True) -> torch.Tensor:
        def run(slots: torch.Tensor | None) -> tuple[torch.Tensor | None, float]:
            back = self._carry(slots)
            return back, _cpu(lambda: dist.broadcast(t, src=self._global(src), group=self.pg))

        self._meet("broadcast", timed, t.numel() * t.element_size(), run, peer=src)
        return t

    def all_gather(self, t: torch.Tensor, *, timed: bool = True) -> list[torch.Tensor]:
        """Every rank's `t` (same shape and dtype everywhere), in rank order (alone: `t` for all)."""
        if self.world_size == 1 or self.alone:
            return [t] * self.world_size
        parts = [torch.empty_like(t) for _ in range(self.world_size)]

        def run(slots: torch.Tensor | None) -> tuple[torch.Tensor | None, float]:
            back = self._carry(slots)
            return back, _cpu(lambda: dist.all_gather(parts, t.contiguous(), group=self.pg))

        self._meet("all_gather", timed, t.numel() * t.element_size(), run)
        return parts

    def _p2p(self, t: torch.Tensor) -> bool:
        return self.world_size > 1 and not self.alone and t.numel() > 0

    def send(self, t: torch.Tensor, dst: int) -> None:
        if self._p2p(t):
            def run(slots: torch.Tensor | None) -> tuple[torch.Tensor | None, float]:
                if slots is not None:
                    dist.send(slots, dst=self._global(dst), group=self.pg)
                return slots, _cpu(lambda: dist.send(t.contiguous(), dst=self._global(dst), group=self.pg))

            self._meet("send", True, t.numel() * t.element_size(), run, peer=dst)

    def isend(self, t: torch.Tensor, dst: int) -> _Works | None:
        """A send that returns at once (`wait()` the result, or `wait_all`, before reusing `t`);
        untimed: its wall time says nothing (the pipeline baseline times the wait itself)."""
        if not self._p2p(t):
            return None
        works = _Works()

        def run(slots: torch.Tensor | None) -> tuple[torch.Tensor | None, float]:
            if slots is not None:
                works.items.append(dist.isend(slots, dst=self._global(dst), group=self.pg))
            c0 = time.process_time()
            works.items.append(dist.isend(t.contiguous(), dst=self._global(dst), group=self.pg))
            return slots, time.process_time() - c0

        self._meet("isend", False, t.numel() * t.element_size(), run, peer=dst)
        return works

    def wait_all(self, works: list[_Works]) -> None:
        """Wait for `isend`s: a wait for peers like any other (untimed, as `isend`)."""
        def run(slots: torch.Tensor | None) -> tuple[torch.Tensor | None, float]:
            return slots, _cpu(lambda: [w.wait() for w in works])

        if self.world_size > 1 and not self.alone:
            self._meet("wait", False, 0, run)

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        if self._p2p(t):
            def run(slots: torch.Tensor | None) -> tuple[torch.Tensor | None, float]:
                if slots is not None:
                    dist.recv(slots, src=self._global(src), group=self.pg)
                return slots, _cpu(lambda: dist.recv(t, src=self._global(src), group=self.pg))

            self._meet("recv", True, t.numel() * t.element_size(), run, peer=src)
        return t

    def exchange(self, sends: dict[int, list[torch.Tensor]], recvs: dict[int, list[torch.Tensor]]) -> None:
        """Point to point with many peers at once (a live re-shard; every rank calls it): `sends[peer]`
        go to `peer`, `recvs[peer]` are filled from it, in list order on both sides; returns when all
        are done. Every send is posted with its receives, so no order of peers can deadlock. Untimed:
        the re-shard is timed as a whole by its caller, between two iterations. The clock forgets
        what it learnt of this rank's work: its shape changes."""
        if self.world_size == 1 or self.alone:
            return
        self.clock.forget()
        out = sum(t.numel() * t.element_size() for ts in sends.values() for t in ts)
        into = sum(t.numel() * t.element_size() for ts in recvs.values() for t in ts)

        def run(slots: torch.Tensor | None) -> tuple[torch.Tensor | None, float]:
            back = self._carry(slots)
            return back, _cpu(lambda: self._exchange(sends, recvs))

        self._meet("exchange", False, max(out, into), run)

    def _exchange(self, sends: dict[int, list[torch.Tensor]], recvs: dict[int, list[torch.Tensor]]) -> None:
        works = [dist.irecv(t, src=self._global(peer), group=self.pg)
                 for peer, ts in sorted(recvs.items()) for t in ts if t.numel()]
        works += [dist.isend(t.contiguous(), dst=self._global(peer), group=self.pg)
                  for peer, ts in sorted(sends.items()) for t in ts if t.numel()]
        for w in works:
            w.wait()

    def barrier(self, *, timed: bool = True) -> None:
        def run(slots: torch.Tensor | None) -> tuple[torch.Tensor | None, float]:
            if slots is not None:  # an all-reduce of the slots is a barrier itself
                return slots, _cpu(lambda: dist.all_reduce(slots, group=self.pg))
            return None, _cpu(lambda: dist.barrier(group=self.pg))

        self._meet("barrier", timed, 0, run)
