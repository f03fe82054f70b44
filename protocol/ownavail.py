"""A service's own retained availability (`online` / last-will `offline`), kept true while it runs.

The broker publishes a client's last will, retained, whenever that client's connection drops. When
a second process ran under the same node id (a copied node.toml on a second box) and stopped, or
an `offline` was left on the topic by hand, the retained availability says `offline` although the
service is connected and healthy: the gateway leaves that node out of every plan (and a job it runs
goes into recovery), Home Assistant shows the gateway's entities unavailable — until the service
next reconnects. So the service listens to its own availability topic and says `online` again.

The value the broker delivers on subscribing is state from before this connection (usually our
own last will from the previous one): it is not news. Only once our own `online` has come back on
this connection is a later `offline` someone else's doing. So is anything else that replaces our
`online` there: a payload that is neither value (Home Assistant reads it as "not available" too)
and an empty retained one (our state removed from the broker).

One `offline` is nobody's mistake: Mosquitto publishes every client's last will when it shuts
down, ours included, a moment before it closes our connection (a broker restart). Handled once our
connection is gone, it is logged as that, not as an error; the `online` of the reconnect answers it.
"""

from __future__ import annotations

from typing import Any

import structlog

from xronos.common.throttle import LogThrottle

from . import messages as m

log = structlog.get_logger(__name__)


class OwnAvailability:
    """Publishes `online` on every connect, `offline` on a clean stop, and re-asserts `online` when
    another publisher replaces it in between. `event` and `hint` word the error that is logged."""

    def __init__(self, bus: Any, key: str, *, event: str, hint: str, **params: str) -> None:
        self.bus, self.key, self.params = bus, key, params
        self.topic = bus.table.build(key, **params)
        self.event, self.hint = event, hint
        # The network thread resets it on connect; the loop thread sets it when our `online` arrives.
        self._back = False
        self._withdrawn = False
        self.reasserted = 0  # times someone else's value was answered with `online`
        self._throttle = LogThrottle(limit=5, window_s=60.0)

    @property
    def confirmed(self) -> bool:
        """Our own `online` has come back on this connection: an `offline` now is someone else's."""
        return self._back

    def register(self, dispatcher: Any) -> None:
        dispatcher.on(self.key, self._on_message, **self.params,
                      on_refused=lambda _text, _params, _payload: self._reassert("unreadable"),
                      on_cleared=lambda _params: self._reassert("cleared"))

    def announce(self) -> None:
        """On every (re)connect: what arrives on the topic before our own `online` is old state."""
        self._back = False
        self._withdrawn = False
        self.bus.publish(self.topic, m.Availability.ONLINE.value, retain=True)

    def withdraw(self) -> None:
        """A clean stop: our own `offline`, which must not be answered."""
        self._withdrawn = True
        self.bus.publish(self.topic, m.Availability.OFFLINE.value, retain=True)

    def _on_message(self, msg: m.Availability, _params: dict[str, str]) -> None:
        if msg == m.Availability.ONLINE:
            self._back = True
            return
        self._reassert("offline")

    def _reassert(self, found: str) -> None:
        """Someone else's value (`found`: offline, unreadable or cleared) replaced our `online`."""
        if not self._back or self._withdrawn:
            return  # old state (our `online` overwrites it), or our own stop
        if found == "offline" and not self.bus.connected:
            log.info("availability.own_will_on_broker_shutdown", topic=self.topic,
                     hint="the broker published our last will as it went away (a broker restart): "
                          "'online' is published again on reconnect")
            return
        self.reasserted += 1
        dropped = self._throttle.admit(self.event)  # someone repeating it must not fill the log
        if dropped is not None:
            log.error(self.event, topic=self.topic, found=found, times=self.reasserted, hint=self.hint)
        self.bus.publish(self.topic, m.Availability.ONLINE.value, retain=True)
