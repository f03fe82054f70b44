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


def resolve(arrivals: Sequence[float], costs: Sequence[float], link_s: float, rank: int) -> Resolution:
    """A group collective: leave at max(arrivals) + max(link_s, max(costs))."""
    if not arrivals or len(arrivals) != len(costs):
        raise ValueError(f"need one arrival and one cost per rank, got {len(arrivals)} and {len(costs)}")
    start = max(arrivals)
    comm = max(link_s, max(costs))
    return Resolution(start + comm, comm, start - arrivals[rank])


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
