"""The clock a `TPGroup` reads and tells about its collectives: the one hook an emulator plugs into.

A rank's figures (iteration, compute per kind, communication, idle) are differences of readings
of its group's clock, taken at the collectives (`Span`s) and wherever the trainer asks
(`TPGroup.now`). On a real box that clock is the wall clock (`Clock`, this module), and nothing
else happens. An emulated box gets another implementation when its rank process starts
(`xronos.node.emulate.process_clock`): a paced one that sleeps the rank to its box's speed before it
meets its peers, or a virtual one that advances by the rank's compute over its box's speed and
resolves every collective from the ranks' virtual arrival times. `node/tp` knows only this
interface, never the emulator.

Every collective reaches the clock as a `Meet` and a `Runner`: the clock calls the runner exactly
once (that is the real collective); a clock that must tell its peers something passes `slots`, a
float64 tensor the runner carries with the collective (summed across the ranks, or, point to
point, sent to the peer) and gives back.

An asynchronous all-reduce (`TPGroup.all_reduce_async`, to overlap communication with compute)
reaches the clock twice: `launch` when the rank starts it (a `Launcher`: the clock calls it once,
with slots or None, and gets a `Flight` back at once) and `land` when the rank waits for it (the
clock finishes the flight). What the rank computes in between is compute, and hides the call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

GROUP_OPS = ("all_reduce_sum", "all_reduce_max", "broadcast", "all_gather", "barrier", "exchange")
P2P_OPS = ("send", "isend", "recv")


class Meet(NamedTuple):
    """One collective as a clock sees it."""

    op: str  # one of GROUP_OPS or P2P_OPS
    tag: str | None  # the segment kind it closes ("attn", "mlp", "vocab"), "data", "rest", or None
    nbytes: int  # this rank's payload (all_gather: its own part; exchange: max(sent, received))
    timed: bool  # False: measurement or control; its time belongs to no figure
    peer: int | None = None  # send/isend: the destination; recv: the source; broadcast: the source


# The real collective. Given slots (a float64 torch tensor) it carries them with the call and returns what came
# back (group ops: the ranks' slots summed; recv: the sender's; send: the own slots); given None it
# carries nothing and returns None. The float is the process CPU seconds the call itself took (all
# threads: Gloo does its work on its own), not counting the carrying of the slots.
# (Typed loosely: this module is imported where torch is not, the pace mode's share lookup.)
Runner = Callable[[Any], tuple[Any, float]]


class Flight(Protocol):
    """A collective started and not yet waited for."""

    def finish(self) -> tuple[Any, float]:
        """Wait for it; (the slots that came back or None, as a `Runner` returns them; the process
        CPU seconds the call cost: the launching call, Gloo's threads while it flew, the wait)."""


# Starts the real collective, carrying the slots (or None), and returns at once.
Launcher = Callable[[Any], Flight]


class Clock:
    """Wall time (`time.perf_counter`): what a real box measures. Subclasses are emulations."""

    name = "wall"
    slots = 0  # values per rank a clock exchanges at every collective (0: it exchanges nothing)

    def now(self) -> float:
        """The time on this clock (the trainer reads it where an iteration begins and ends)."""
        return time.perf_counter()

    def meet(self, meet: Meet, run: Runner, rank: int, world: int) -> tuple[float, float]:
        """Run the collective (`run`, exactly once); (start, end) on this clock."""
        t0 = time.perf_counter()
        run(None)
        return t0, time.perf_counter()

    def launch(self, meet: Meet, start: Launcher, rank: int, world: int) -> object:
        """Start a collective (`start`, exactly once) without waiting for it; what `land` takes.
        The launch is not a span: the rank's compute goes on."""
        return start(None)

    def land(self, ticket: object) -> tuple[float, float]:
        """Wait for a launched collective: (start, end) of the wait on this clock (wall: what the
        compute since the launch did not hide)."""
        t0 = time.perf_counter()
        ticket.finish()  # type: ignore[attr-defined]
        return t0, time.perf_counter()

    def skipped(self, meet: Meet) -> float:
        """A collective not run (a world of one, or a rank profiled alone): a compute segment ends
        here. Its time on this clock."""
        return self.now()

    def settle(self) -> None:
        """Where an iteration ends without a collective (after the optimizer step)."""

    def forget(self) -> None:
        """This rank's work changed shape (a live re-shard): nothing learnt of it holds."""

    def describe(self) -> dict[str, object]:
        """What a result file says about the clock that made its figures."""
        return {"clock": self.name}


WALL = Clock()
