"""When ranks leave a collective in virtual time, and what their wait was (pure).

Every rank comes to a collective at its own virtual time (its arrival: where its compute got it),
learns the others' arrivals from the collective itself, and all leave together at the latest
arrival plus the collective's cost: the longer of the link's time for it (`link.Link`) and the
slowest rank's CPU cost of the call at its box's speed (Gloo's own work, which a slow box pays
slowly): `gateway/commmodel.comm_time`'s form. A rank's idle is then its wait for the latest
arrival; the cost is communication. Point to point is eager: a send leaves after its own CPU cost,
the bytes arrive one link time after the sender's link is free, and the receiver leaves when they
have arrived (or at once, if they were there before it).

The exchanged values ride in float "slots": `world` entries per value, each rank filling only its
own (so a sum or a max across ranks gives every rank's value). Arrivals go as offsets from the
last group-wide departure, which every rank shares exactly: float32 slots (an activation's
all-reduce) then lose nothing that matters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class Resolution(NamedTuple):
    leave: float  # when every rank leaves (virtual seconds)
    comm: float  # the collective's own cost
    idle: float  # this rank's wait for the latest arrival


def resolve(arrivals: Sequence[float], costs: Sequence[float], link_s: float, rank: int,
            free: float = 0.0) -> Resolution:
    """A group collective: leave at max(max(arrivals), free) + max(link_s, max(costs)), where
    `free` is when the link has carried the collectives still in flight before it (asynchronous
    ones, `flight`). The wait for the latest arrival is idle; the rest (the link's queue, then
    the call) communication."""
    start, leave = flight(arrivals, costs, link_s, free)
    latest = max(arrivals)
    return Resolution(leave, leave - latest, latest - arrivals[rank])


def flight(arrivals: Sequence[float], costs: Sequence[float], link_s: float, free: float = 0.0
           ) -> tuple[float, float]:
    """(start, completion) of a collective on the link: it starts once every rank has come to it
    (launched it, for an asynchronous one) and the link is free of the ones before it, and takes
    the longer of the link's time and the slowest rank's CPU cost of the call."""
    if not arrivals or len(arrivals) != len(costs):
        raise ValueError(f"need one arrival and one cost per rank, got {len(arrivals)} and {len(costs)}")
    start = max(max(arrivals), free)
    return start, start + max(link_s, max(costs))


def land(now: float, own_cost: float, completion: float, latest: float, start: float | None = None,
         progress_s: float = 0.0) -> Resolution:
    """A rank waits, at `now`, for a collective it launched earlier, which completes at
    `completion` (`flight`) and which the last rank launched at `latest`. The compute since the
    launch hid the call up to `now`; but the CPU the call took on this box (`own_cost`: Gloo's
    threads, at the box's speed) came out of that compute, so the rank leaves at
    max(now + own_cost, completion). Of its wait, the time until the latest launch is idle, the
    rest communication (the call's own CPU included).

    `progress_s` (`Link.progress_s`): while the rank computes, the call, which went on the wire at
    `start`, moves only once its threads get the core, `progress_s` later; once the rank waits they
    have it at once. So the call completes min(progress_s, now - start) later: the first
    `progress_s` of compute after it started hides nothing. Each rank sees its own wait only, so
    this is the rank's view of the delay (a rank that waits early does not know whether the
    others' threads are still held back by their compute)."""
    if progress_s:
        if start is None:
            raise ValueError("land: a progress delay needs the call's start on the wire")
        completion += min(progress_s, max(0.0, now - start))
    leave = max(now + own_cost, completion)
    waited = leave - now
    idle = min(max(0.0, latest - now), waited)
    return Resolution(leave, waited - idle, idle)


def send_delivery(arrival: float, link_free: float, link_s: float, cpu_s: float) -> float:
    """When a send's bytes are at the receiver: its link is busy with earlier sends until
    `link_free`; then the transfer takes the longer of the link and the sender's CPU for it."""
    return max(arrival, link_free) + max(link_s, cpu_s)


def resolve_recv(arrival: float, cpu_s: float, delivered: float, link_s: float) -> Resolution:
    """A receive: done when the bytes are there (`delivered`, after `link_s` on the wire) and this
    rank has paid its CPU for the call. Waiting for the sender to start is idle, the rest comm."""
    leave = max(arrival + cpu_s, delivered)
    idle = min(max(0.0, delivered - link_s - arrival), leave - arrival)
    return Resolution(leave, leave - arrival - idle, idle)


def encode(rank: int, world: int, values: Sequence[float]) -> list[float]:
    """`len(values) * world` slots, this rank's values in its own places, zeros elsewhere. The
    values must be >= 0 (a max across ranks must give them back as a sum would)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} out of a world of {world}")
    out = [0.0] * (len(values) * world)
    for k, v in enumerate(values):
        if not v >= 0:
            raise ValueError(f"slot value {k} must be >= 0, got {v!r}")
        out[k * world + rank] = float(v)
    return out


def decode(slots: Sequence[float], world: int, k: int) -> list[list[float]]:
    """The k values of every rank: [value][rank]."""
    if len(slots) != k * world:
        raise ValueError(f"expected {k * world} slots, got {len(slots)}")
    return [list(slots[i * world:(i + 1) * world]) for i in range(k)]


@dataclass
class Account:
    """A rank's virtual seconds by what they were: compute, communication, idle (waits)."""

    compute: float = 0.0
    comm: float = 0.0
    idle: float = 0.0

    def book(self, r: Resolution) -> None:
        self.comm += r.comm
        self.idle += r.idle

    def idle_ratio(self) -> float:
        total = self.compute + self.comm + self.idle
        return self.idle / total if total > 0 else 0.0
