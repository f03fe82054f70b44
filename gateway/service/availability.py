"""The gateway's own availability (`{base}/gateway/availability`), as a component of its service:
`online` on every connect, `offline` on a clean stop (the broker publishes the last will otherwise),
and `online` again when someone else replaces it meanwhile (protocol/ownavail.py says when and why).
Home Assistant's entities of the gateway follow it.
"""

from __future__ import annotations

from xronos.protocol.ownavail import OwnAvailability
from xronos.protocol.transport import BusBase

from .component import Component


class GatewayAvailability(OwnAvailability, Component):
    name = "availability"

    def __init__(self, bus: BusBase, base_topic: str) -> None:
        super().__init__(
            bus, "gateway.availability", event="gateway.availability_offline_while_running",
            hint=f"another gateway on base topic {base_topic!r} ran and stopped, or an 'offline' was "
                 "published by hand: run one gateway per base topic; 'online' published again")

    def connected(self) -> None:
        self.announce()

    def stop(self) -> None:
        self.withdraw()
