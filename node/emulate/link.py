"""The emulated boxes' network, modelled: how long a collective takes on the link (pure).

Virtual time cannot measure the boxes' network (loopback between ranks on one host is nothing
like a LAN), so every collective costs what an alpha-beta model of the cell's link says, in the
cost model's own form and with its parameters (`xronos.gateway.plan.commmodel.comm_time`: one latency
per call, 1 Gbit/s by default), so that the bench compares plans, not two comm models:

- all-reduce (Gloo's ring): latency + 2(N-1)/N x bytes / bandwidth;
- all-gather (ring): latency + (N-1) x bytes of one rank / bandwidth;
- broadcast (the root sends to every peer on its one link): latency + (N-1) x bytes / bandwidth;
- barrier: latency;
- point to point: latency + bytes / bandwidth;
- exchange (a live re-shard: every rank sends and receives at once, full duplex): latency + the
  largest of any rank's bytes out or in / bandwidth.
The CPU a collective costs the boxes themselves is measured (`VirtualClock`: the calling process's
threads, Gloo's among them, over loopback). What loopback does not show is the kernel's work on a
real link: there a transfer is sent and delivered from softirqs on the core that happens to run,
which is the computing thread's while a call is in flight, so a call hidden behind compute still
takes CPU from it. `stack_s_per_byte` charges that to each end's box, per byte its link carries
(`wire_bytes`), in seconds of one host core (the clock divides by the box's speed as for compute).
It is 0 unless a bench measured it on a real link (`bench/stack_probe.py`, which
`bench/overlap_wall.py` runs first).
A call in flight also moves late beside a busy core. Gloo's threads carry it step by step, each
step woken by the network, and a woken thread of the normal scheduling class gets the core only
when the computing thread's slice ends. So a call launched before a compute burst completes
about one slice later than the same call with the core free: 4.5-6.9 ms later on this host's
kernel (6.18, two cores), on the real link and on loopback alike, whatever its size
(`bench/results/stack-probe-off.md`). `progress_s` models that (`arrivals.land`): the first
`progress_s` of compute after a launch hides nothing. It is the box's scheduler, not the wire, so
it is not scaled by the box's speed. It is 0 unless a bench asks for it: with the probe's 6.1 ms
the wall check's virtual gains fell 1.2-7.5 points below the wall's; without it they were 3.2-13.6
points above them (docs/planning.md, "The slice, modelled").
Not modelled: TCP's dynamics, NIC offloads and interrupts on real boxes, switch queueing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The cost model's defaults (gateway/plan/commmodel.py: DEFAULT_BANDWIDTH_BPS, DEFAULT_LATENCY_S; node
# may not import the gateway, tests/node/test_vclock_pure.py checks they agree).
DEFAULT_BANDWIDTH_BPS = 1e9 / 8  # 1 Gbit/s Ethernet, bytes per second
DEFAULT_LATENCY_S = 0.5e-3


@dataclass(frozen=True)
class Link:
    bandwidth_Bps: float = DEFAULT_BANDWIDTH_BPS
    latency_s: float = DEFAULT_LATENCY_S
    # the network stack's CPU per byte carried beyond what the call's threads show on loopback
    stack_s_per_byte: float = 0.0
    # how much later a call in flight completes beside a computing thread than with the core free
    # (seconds of the box's own time: a scheduler slice)
    progress_s: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.bandwidth_Bps, bool) or not (isinstance(self.bandwidth_Bps, (int, float))
                                                       and self.bandwidth_Bps > 0
                                                       and math.isfinite(self.bandwidth_Bps)):
            raise ValueError(f"link bandwidth must be finite and > 0 bytes/s, got {self.bandwidth_Bps!r}")
        if isinstance(self.latency_s, bool) or not (isinstance(self.latency_s, (int, float))
                                                   and self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"link latency must be finite and >= 0 s, got {self.latency_s!r}")
        if isinstance(self.stack_s_per_byte, bool) or not (isinstance(self.stack_s_per_byte, (int, float))
                                                          and self.stack_s_per_byte >= 0
                                                          and math.isfinite(self.stack_s_per_byte)):
            raise ValueError(f"link stack CPU must be finite and >= 0 s per byte, got {self.stack_s_per_byte!r}")
        if isinstance(self.progress_s, bool) or not (isinstance(self.progress_s, (int, float))
                                                    and 0 <= self.progress_s < 1):
            raise ValueError(f"a call's progress delay beside a busy core must be in [0, 1) s, got {self.progress_s!r}")

    @classmethod
    def mbit(cls, rate_mbit: float, latency_s: float = DEFAULT_LATENCY_S, stack_s_per_byte: float = 0.0,
             progress_s: float = 0.0) -> Link:
        """A link of `rate_mbit` Mbit/s (the bench's unit)."""
        if not (isinstance(rate_mbit, (int, float)) and rate_mbit > 0 and math.isfinite(rate_mbit)):
            raise ValueError(f"link rate must be finite and > 0 Mbit/s, got {rate_mbit!r}")
        return cls(rate_mbit * 1e6 / 8, latency_s, stack_s_per_byte, progress_s)

    def seconds(self, op: str, nbytes: float, world: int) -> float:
        """The link's time for one collective `op` of `nbytes` (per rank; exchange: the largest any
        rank sends or receives) among `world` ranks; 0 for a world of one."""
        if world <= 1 and op not in ("send", "isend", "recv"):
            return 0.0
        a = 0.0 if op == "wait" else self.latency_s
        return a + self.wire_bytes(op, nbytes, world) / self.bandwidth_Bps

    def stack_seconds(self, op: str, nbytes: float, world: int) -> float:
        """The network stack's CPU (seconds of one host core) for one rank's part in `op`."""
        return self.stack_s_per_byte * self.wire_bytes(op, nbytes, world) if self.stack_s_per_byte else 0.0

    @staticmethod
    def wire_bytes(op: str, nbytes: float, world: int) -> float:
        """The bytes one rank's link carries for `op` in the direction that carries most: the term
        the bandwidth divides (a ring all-reduce's rank sends, and receives, 2(N-1)/N of the tensor)."""
        if world <= 1 and op not in ("send", "isend", "recv"):
            return 0.0
        n, b = world, float(nbytes)
        if op.startswith("all_reduce"):
            return 2 * (n - 1) / n * b
        if op in ("all_gather", "broadcast"):
            return (n - 1) * b
        if op in ("barrier", "wait"):
            return 0.0
        if op in ("send", "isend", "recv", "exchange"):
            return b
        raise ValueError(f"no link model for collective {op!r}")
