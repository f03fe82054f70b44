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
Not modelled: the real network stack, TCP on the boxes' CPUs, NIC interrupts, switch queueing.
The CPU a collective costs the boxes themselves is measured instead (`VirtualClock`).
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

    def __post_init__(self) -> None:
        if isinstance(self.bandwidth_Bps, bool) or not (isinstance(self.bandwidth_Bps, (int, float))
                                                       and self.bandwidth_Bps > 0
                                                       and math.isfinite(self.bandwidth_Bps)):
            raise ValueError(f"link bandwidth must be finite and > 0 bytes/s, got {self.bandwidth_Bps!r}")
        if isinstance(self.latency_s, bool) or not (isinstance(self.latency_s, (int, float))
                                                   and self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"link latency must be finite and >= 0 s, got {self.latency_s!r}")

    @classmethod
    def mbit(cls, rate_mbit: float, latency_s: float = DEFAULT_LATENCY_S) -> Link:
        """A link of `rate_mbit` Mbit/s (the bench's unit)."""
        if not (isinstance(rate_mbit, (int, float)) and rate_mbit > 0 and math.isfinite(rate_mbit)):
            raise ValueError(f"link rate must be finite and > 0 Mbit/s, got {rate_mbit!r}")
        return cls(rate_mbit * 1e6 / 8, latency_s)

    def seconds(self, op: str, nbytes: float, world: int) -> float:
        """The link's time for one collective `op` of `nbytes` (per rank; exchange: the largest any
        rank sends or receives) among `world` ranks; 0 for a world of one."""
        if world <= 1 and op not in ("send", "isend", "recv"):
            return 0.0
        n, b, a = world, float(nbytes), self.latency_s
        if op.startswith("all_reduce"):
            return a + 2 * (n - 1) / n * b / self.bandwidth_Bps
        if op in ("all_gather", "broadcast"):
            return a + (n - 1) * b / self.bandwidth_Bps
        if op == "barrier":
            return a
        if op in ("send", "isend", "recv", "exchange"):
            return a + b / self.bandwidth_Bps
        if op == "wait":
            return 0.0
        raise ValueError(f"no link model for collective {op!r}")
