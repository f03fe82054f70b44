"""Virtual mode's clock: an emulated box's time is its compute over its speed plus modelled waits.

Why: on a shared host a CFS quota is not a slow core and the wall clock measures the scheduler
(quota and pace modes idle 7-19 % on perfectly balanced work, `bench/results/demo-idle.md`).
So, as SimGrid SMPI does, every rank really runs its shard on one thread, and its clock advances
by each compute burst's thread CPU time (the burst: from the end of one collective to the start of
the next, or to `settle` after the optimizer step), smoothed per recurring burst (`estimator`),
divided by the box's speed in host cores. Every collective carries the ranks' virtual arrivals
(`arrivals`), and all leave at the latest one plus the longer of the modelled link (`link`) and
the slowest rank's scaled process CPU for the call (Gloo's threads). Wall time never enters the
figures, so time slicing, quotas and other load on the host do not either. Memory caps stay real.

A process runs on this clock when the emulator placed it in a virtual-mode rank group
(`Confinement(cpu_mode="virtual")`): its box (speed in host cores, link, estimator) is a small JSON
file named after the cgroup (`box_path`), re-read every RECHECK_S so a bench can change a box's
speed mid-run. What it cannot model: memory-bandwidth and cache contention between co-located
ranks (it inflates CPU time; the window minimum mostly takes it out), the real network stack (but
for the CPU it takes per byte, when the link says it: `Link.stack_s_per_byte`), thermal throttling,
one box's own jitter (the estimator hides it).

Asynchronous all-reduces (`launch` ... `land`) overlap communication with compute: the launch
ends a compute burst and records the rank's arrival; the call completes at the latest arrival
(or when the link has carried the calls before it, `wire_free`) plus its cost, and the wait
leaves at that completion or later, so compute between launch and wait hides the link. The CPU
the call costs this box (Gloo's threads, and the network stack's work the link models) is not
hidden: it is charged on top of that compute
(`arrivals.land`); a box with cores to spare would hide it too, which this does not model. Nor
does the call move while the rank computes until its threads get the core, when the link says how
long that takes (`Link.progress_s`: a scheduler slice, 0 unless a bench sets it).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from xronos.node.emulate.arrivals import (Account, Resolution, decode, encode, flight, land, resolve, resolve_recv,
                                          send_delivery)
from xronos.node.emulate.estimator import DEFAULT_MODE, DEFAULT_WINDOW, Estimator, check_mode
from xronos.node.emulate.link import Link
from xronos.node.tp.clock import GROUP_OPS, Clock, Launcher, Meet, Runner

VCLOCK_ROOT = Path("/run/xronos-vclock")  # <run group>/<rank group>: that rank's box (JSON)


def check_speed(host_cores: object, box: str = "box") -> float:
    """A box's speed in host cores, or ValueError naming the box and the value."""
    if isinstance(host_cores, bool) or not isinstance(host_cores, (int, float)) \
            or not (host_cores > 0 and math.isfinite(host_cores)):
        raise ValueError(f"{box}: speed must be a finite number of host cores > 0, got {host_cores!r}")
    return float(host_cores)


@dataclass(frozen=True)
class Box:
    """An emulated box as its rank's clock sees it."""

    host_cores: float  # its speed: how many of this host's cores it is worth (one thread's CPU time / this)
    link: Link = field(default_factory=Link)
    estimator: str = DEFAULT_MODE
    window: int = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        check_speed(self.host_cores)
        check_mode(self.estimator)
        Estimator(self.estimator, self.window)  # checks the window

    def to_json(self) -> str:
        return json.dumps({"host_cores": self.host_cores, "bandwidth_Bps": self.link.bandwidth_Bps,
                           "latency_s": self.link.latency_s, "stack_s_per_byte": self.link.stack_s_per_byte,
                           "progress_s": self.link.progress_s, "estimator": self.estimator, "window": self.window})

    @classmethod
    def from_json(cls, text: str) -> Box:
        d = json.loads(text)
        if not isinstance(d, dict) or set(d) != _BOX_KEYS:
            raise ValueError(f"not a box: {text[:200]!r}")
        return cls(d["host_cores"], Link(d["bandwidth_Bps"], d["latency_s"], d["stack_s_per_byte"], d["progress_s"]),
                   d["estimator"], d["window"])


_BOX_KEYS = {"host_cores", "bandwidth_Bps", "latency_s", "stack_s_per_byte", "progress_s", "estimator", "window"}


def box_path(run: str, rank_group: str, root: Path = VCLOCK_ROOT) -> Path:
    return root / run / rank_group


def write_box(path: Path, box: Box) -> None:
    """Atomically: a rank re-reading it mid-write sees the old box or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(box.to_json())
    tmp.replace(path)


def read_box(path: Path | None) -> Box | None:
    """The box in a box file; None when there is none (or it is not one)."""
    if path is None:
        return None
    try:
        return Box.from_json(path.read_text())
    except (OSError, ValueError, TypeError):
        return None


# The statistic of a call's CPU samples the clock charges: a blocking call its window minimum, a
# launched one its window median (the reasons at `VirtualClock.__init__`). The profile's all-reduce
# probe takes the same (`node/measure/commprobe.py`), so plan and run share one ruler.
CALL_STAT = "min"
FLIGHT_STAT = "med"


class VirtualClock(Clock):
    """One rank's virtual time (seconds since the clock was made)."""

    name = "virtual"
    RECHECK_S = 0.5  # how often (wall) the box file is looked at again

    def __init__(self, box: Box, *, path: Path | None = None, thread_time: Callable[[], float] = time.thread_time,
                 wall: Callable[[], float] = time.perf_counter,
                 slots: Callable[[list[float]], object] | None = None, serialize: Path | None = None) -> None:
        """`path`: the box file, re-read every RECHECK_S of `wall`; `slots`: list -> what a runner
        carries (a float64 tensor; a list in the pure tests). A run's boxes share one link (the
        emulator writes the same to every rank): each rank computes the link's time itself.
        `serialize`: a lock file shared by the run's ranks; a rank computes only while it holds it,
        so no two ranks' bursts run at once (as SimGrid SMPI runs its ranks one at a time): no
        co-located rank inflates another's CPU time, at the price of wall time. Never taken when the
        clock is made (the ranks are still joining), first at the end of its first reading or
        meeting; released at the start of every meeting."""
        self.box, self.path = box, path
        self._lock = os.open(serialize, os.O_RDWR | os.O_CREAT, 0o600) if serialize is not None else None
        self._held = False
        self._thread, self._wall = thread_time, wall
        self._slots = slots or _float64  # list -> what a runner carries (a float64 tensor)
        self.est = Estimator(box.estimator, box.window)  # compute bursts (thread CPU)
        # The calls' own process CPU: its window minimum whatever the bursts' estimator. A call's
        # process CPU is small (0.1-1 ms) and what pollutes it is not the call: other threads of the
        # process running while this one waits in it (a profiler's probe read 2.9 ms for 4 bytes).
        self.call_est = Estimator(CALL_STAT, box.window)
        # A launched call's CPU (Gloo's threads while it flies, `flight._Ledger`), its window median:
        # it is charged on top of the compute that hides it, so the charges must add up to what the
        # threads took, and the cheapest call of the window does not. With the minimum the clock
        # over-rated chunking's gain against two pinned wall-clock ranks by 10.5-10.7 points; with
        # the median it agreed within 5 (docs/planning.md, "What a launched call is charged").
        self.flight_est = Estimator(FLIGHT_STAT, box.window)
        self.t = 0.0
        self.base = 0.0  # the last group-wide departure: the same on every rank
        self.account = Account()
        self.link_free = 0.0  # until when this rank's link carries earlier sends
        # Asynchronous collectives launched and not yet resolved, in launch order (every rank
        # launches the same ones in the same order), and until when the group's link carries the
        # resolved ones: a later collective starts on the wire after them.
        self._flights: list[_Ticket] = []
        self.wire_free = 0.0
        # A burst's key: where it ends and every end before it since the last settle (an iteration
        # recurs as the same path; a first pass that differs, a re-planned one, get keys of their own)
        self._path = 0
        self._checked = wall()
        self._mark = thread_time()

    # -- compute ---------------------------------------------------------------------------
    def _burst(self, end: tuple) -> None:
        """A compute burst ends here: the clock advances by its estimate over the box's speed."""
        cpu = max(0.0, self._thread() - self._mark)
        if self._held:
            fcntl.flock(self._lock, fcntl.LOCK_UN)  # type: ignore[arg-type]
            self._held = False
        self._recheck()
        self._path = hash((self._path, end))
        v = self.est.add(self._path, cpu) / self.box.host_cores
        self.t += v
        self.account.compute += v

    def _resume(self) -> None:
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_EX)
            self._held = True
        self._mark = self._thread()

    def _recheck(self) -> None:
        if self.path is not None:
            w = self._wall()
            if w - self._checked > self.RECHECK_S:
                self._checked = w
                self.box = read_box(self.path) or self.box

    def now(self) -> float:
        self._burst(("now",))
        self._resume()
        return self.t

    def skipped(self, meet: Meet) -> float:
        self._burst((meet.op, meet.tag, meet.nbytes))
        self._resume()
        return self.t

    def settle(self) -> None:
        self._burst(("settle",))
        self._path = 0  # an iteration ends: the next one's bursts recur with the same keys
        self._resume()

    def forget(self) -> None:
        self.est.forget()

    def close(self) -> None:
        """Let go of the serializing lock for good (the process's end does it too)."""
        if self._lock is not None:
            os.close(self._lock)  # closing the descriptor releases its flock
            self._lock, self._held = None, False

    # -- collectives -----------------------------------------------------------------------
    def meet(self, meet: Meet, run: Runner, rank: int, world: int) -> tuple[float, float]:
        self._burst((meet.op, meet.tag, meet.nbytes))
        arrival = self.t
        ckey = (meet.op, meet.nbytes, world)
        own_cost = self._own_cost(ckey)
        if meet.op in GROUP_OPS:
            if self._flights:  # resolved first: they are on the link before this one
                self._resolve_flights(self._flights[-1])
            r = self._group(meet, run, rank, world, arrival, own_cost, ckey)
            self.base = r.leave
        elif meet.op in ("send", "isend"):
            # eager: the sender goes on after its own CPU for the call; the bytes follow on its link
            delivered = send_delivery(arrival, self.link_free, self.box.link.seconds(meet.op, meet.nbytes, world),
                                      own_cost)
            self.link_free = delivered
            _, cpu = run(self._slots([delivered, own_cost]))  # sent ahead of the payload
            r = Resolution(arrival + own_cost, own_cost, 0.0)
            self.call_est.add(ckey, cpu)
        elif meet.op == "recv":
            back, cpu = run(self._slots([0.0, 0.0]))
            delivered = float(back[0])
            r = resolve_recv(arrival, own_cost, delivered, self.box.link.seconds("recv", meet.nbytes, world))
            self.call_est.add(ckey, cpu)
        else:  # "wait": for this rank's own eager sends, which cost it nothing more
            _, cpu = run(None)
            r = Resolution(arrival, 0.0, 0.0)
        self.account.book(r)
        self.t = r.leave
        self._resume()
        return arrival, r.leave

    def _own_cost(self, ckey: tuple, est: Estimator | None = None) -> float:
        """What a call costs this box's CPU, in its time: the call's earlier samples (the process's
        threads, measured; `est`: a launched call's, else a blocking one's) and the network stack's
        work the link models beyond them."""
        op, nbytes, world = ckey
        cpu = (est or self.call_est).value(ckey)
        return (cpu + self.box.link.stack_seconds(op, nbytes, world)) / self.box.host_cores

    def _group(self, meet: Meet, run: Runner, rank: int, world: int, arrival: float, own_cost: float,
               ckey: tuple) -> Resolution:
        slots = self._slots(encode(rank, world, [arrival - self.base, own_cost, float(meet.nbytes)]))
        back, cpu = run(slots)
        offsets, costs, sizes = decode([float(x) for x in back], world, 3)
        self.call_est.add(ckey, cpu)
        nbytes = meet.nbytes
        if meet.op == "exchange":
            nbytes = max(sizes)
        elif meet.op == "broadcast" and meet.peer is not None:
            nbytes = sizes[meet.peer]
        link_s = self.box.link.seconds(meet.op, nbytes, world)
        r = resolve([self.base + o for o in offsets], costs, link_s, rank, self.wire_free)
        self.wire_free = max(self.wire_free, r.leave)
        return Resolution(r.leave, r.comm, max(0.0, r.leave - r.comm - arrival))

    # -- asynchronous collectives ----------------------------------------------------------
    def launch(self, meet: Meet, start: Launcher, rank: int, world: int) -> _Ticket:
        assert meet.op.startswith("all_reduce"), meet.op  # the only asynchronous collective
        self._burst(("launch", meet.op, meet.tag, meet.nbytes))
        ckey = (meet.op, meet.nbytes, world)
        # (before this call's first sample, what the same call costs blocking: a first guess)
        own_cost = self._own_cost(ckey, self.flight_est if ckey in self.flight_est else None)
        # Offsets from the base at the launch: a blocking collective before the wait moves it.
        fl = start(self._slots(encode(rank, world, [self.t - self.base, own_cost, float(meet.nbytes)])))
        ticket = _Ticket(meet, fl, self.base, own_cost, ckey, world)
        self._flights.append(ticket)
        self._resume()
        return ticket

    def land(self, ticket: object) -> tuple[float, float]:
        assert isinstance(ticket, _Ticket)
        self._burst(("land", ticket.meet.op, ticket.meet.tag, ticket.meet.nbytes))
        now = self.t
        if ticket in self._flights:
            self._resolve_flights(ticket)
        r = land(now, ticket.own_cost, ticket.completion, ticket.latest, ticket.start, self.box.link.progress_s)
        self.account.book(r)
        self.t = r.leave
        self._resume()
        return now, r.leave

    def _resolve_flights(self, upto: _Ticket) -> None:
        """Finish the flights up to `upto`, in launch order (the link carries them in that order),
        and set each one's completion. No virtual time passes here: that is `land`'s."""
        while self._flights:
            tk = self._flights.pop(0)
            back, cpu = tk.flight.finish()
            offsets, costs, _ = decode([float(x) for x in back], tk.world, 3)
            self.flight_est.add(tk.ckey, cpu)
            link_s = self.box.link.seconds(tk.meet.op, tk.meet.nbytes, tk.world)
            arrivals = [tk.base + o for o in offsets]
            tk.start, tk.completion = flight(arrivals, costs, link_s, self.wire_free)
            tk.latest = max(arrivals)
            self.wire_free = tk.completion
            if tk is upto:
                return

    # -- the record ------------------------------------------------------------------------
    def describe(self) -> dict[str, object]:
        """What a result file says about this clock."""
        return {"clock": self.name, "cpu_mode": "virtual", "host_cores": self.box.host_cores,
                "estimator": self.box.estimator, "window": self.box.window,
                "bandwidth_Bps": self.box.link.bandwidth_Bps, "latency_s": self.box.link.latency_s,
                "stack_s_per_byte": self.box.link.stack_s_per_byte, "progress_s": self.box.link.progress_s}


class _Ticket:
    """A launched collective as the clock keeps it until it is resolved and waited for."""

    def __init__(self, meet: Meet, flight, base: float, own_cost: float, ckey: tuple, world: int) -> None:
        self.meet, self.flight, self.base, self.world = meet, flight, base, world
        self.own_cost, self.ckey = own_cost, ckey
        self.start = self.completion = self.latest = 0.0


def _float64(values: list[float]):
    import torch

    return torch.tensor(values, dtype=torch.float64)
