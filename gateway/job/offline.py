"""When a node's "offline" reaches its jobs. Pure: no I/O, no clock of its own.

A last will is the broker's word that a node's connection died, and a job whose plan holds that
node re-plans on it. But Mosquitto also publishes every connected client's will when it shuts down
itself: a broker restart (Home Assistant updating its Mosquitto add-on, a reboot of the hub)
delivered every node's "offline" to the gateway a moment before the gateway's own connection
closed (Mosquitto 2.0.11, `tests/services/test_e2e_broker_restart.py`), and the gateway cancelled
a healthy running plan, losing the job's steps since its checkpoint. Its ranks had never stopped:
they train over Gloo, not over the broker.

So an "offline" reaches the jobs only if it still stands after a grace, and never while the gateway
itself is disconnected: `short_s` while the gateway stays connected (a shutdown's wills are
followed by the gateway's own disconnect within milliseconds), and after each (re)connect of the
gateway `settle_s`, the time a node takes to reconnect after a broker restart and say "online"
again (its reconnect back-off). An "online" within the grace withdraws it. The registry shows the
node offline at once (planning leaves it out); only the jobs' reaction waits. A node that really
died is re-planned around a few seconds later, or at once when its peers' ranks report the failure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class OfflineGrace:
    short_s: float = 2.0
    settle_s: float = 35.0
    pending: dict[str, float] = field(default_factory=dict)  # node -> when its "offline" counts
    connected_at: float = -math.inf  # the gateway's latest (re)connect

    def offline(self, node: str, now: float) -> None:
        self.pending[node] = max(now + self.short_s, self.connected_at + self.settle_s)

    def online(self, node: str) -> None:
        self.pending.pop(node, None)

    def reconnected(self, at: float) -> None:
        """The gateway (re)connected at `at`: every node still offline gets `settle_s` from now."""
        self.connected_at = at
        for node in self.pending:
            self.pending[node] = max(self.pending[node], at + self.settle_s)

    def due(self, now: float, connected: bool) -> list[str]:
        """The nodes whose "offline" counts now (and is forgotten here), none while disconnected."""
        if not connected:
            return []
        out = sorted(n for n, t in self.pending.items() if t <= now)
        for n in out:
            del self.pending[n]
        return out
