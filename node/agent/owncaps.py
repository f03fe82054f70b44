"""A second process announcing itself under this node's id: detected and reported.

Two boxes provisioned from one node.toml both subscribe to `node/<id>/#`: both take the
inspections, assignments and controls meant for one node, and would start the same rank twice.
Each announces its capabilities (retained) under the shared id, so each hears the other's: a
capabilities message on our own topic that we did not publish — once ours has come back on this
connection (what the broker hands over on subscribing is our previous run's) — is another process.
It is logged as an error naming the other host, and reported on `node/<id>/error`
(`duplicate_node_id`) so the gateway's log shows it too; at most once per `REPORT_EVERY_S`, as the
other process re-announces every minute.

Our own retained capabilities stay ours: whatever replaces them on the topic once ours came back —
another process's, a forged message, an unreadable payload or an empty retained one (our state
removed) — is answered by publishing ours again, at once, and never more than once per
`REASSERT_EVERY_S` (two processes under one id would otherwise answer each other without end);
one that comes sooner is answered by `tick()` when that time is up. So the retained value the
gateway and Home Assistant read is wrong for at most about a second, not until the next periodic
announcement.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import structlog

from xronos.common.throttle import LogThrottle
from xronos.protocol import messages as m

log = structlog.get_logger(__name__)

REPORT_EVERY_S = 600.0
REASSERT_EVERY_S = 1.0


class OwnCapabilities:
    def __init__(self, bus: Any, node_id: str) -> None:
        self.bus, self.node_id = bus, node_id
        self.topic = bus.table.build("node.capabilities", node_id=node_id)
        # our own recent announcements, whole: a forged copy of our sent_at alone is not ours
        # (the loop and network threads append; deque is safe)
        self._ours: collections.deque[m.Capabilities] = collections.deque(maxlen=16)
        self._back = False
        self.seen = 0  # announcements by another process
        self._throttle = LogThrottle(limit=1, window_s=REPORT_EVERY_S)
        self._last: m.Capabilities | None = None  # what we announced last, re-published when replaced
        self._reasserted_at = -REASSERT_EVERY_S
        self._due = False  # replaced sooner than REASSERT_EVERY_S after our last answer: tick() answers
        self.reasserted = 0

    @property
    def confirmed(self) -> bool:
        return self._back

    def register(self, dispatcher: Any) -> None:
        dispatcher.on("node.capabilities", self._on_message, node_id=self.node_id,
                      on_refused=lambda _text, _params, _payload: self._replaced(),
                      on_cleared=lambda _params: self._replaced())

    def connected(self) -> None:
        """On every (re)connect, before announcing: what arrives before our own is old state."""
        self._back = False

    def publish(self, caps: m.Capabilities) -> None:
        self._last = caps
        self._ours.append(caps)  # before it can echo back
        self.bus.publish_message(caps, node_id=self.node_id)

    def tick(self) -> None:
        """Every turn of the loop: answer a replacement that came too soon after our last answer."""
        if self._due and time.monotonic() - self._reasserted_at >= REASSERT_EVERY_S:
            self._reassert()

    def _replaced(self) -> None:
        """Something not ours stands on our retained topic (once ours came back: before, it is old state)."""
        if not self._back:
            return
        if time.monotonic() - self._reasserted_at >= REASSERT_EVERY_S:
            self._reassert()
        else:
            self._due = True

    def _reassert(self) -> None:
        self._due = False
        if self._last is None:
            return
        self._reasserted_at = time.monotonic()
        self.reasserted += 1
        self.publish(self._last.model_copy(update={"sent_at": max(time.time(), self._last.sent_at + 1e-3)}))

    def _on_message(self, caps: m.Capabilities, _params: dict[str, str]) -> None:
        if caps in self._ours:
            self._back = True
            return
        if not self._back:
            return
        self._replaced()
        self.seen += 1
        dropped = self._throttle.admit("duplicate")
        if dropped is None:
            return
        # Host names shown cut short: 255 characters each, escaped by repr (up to 10 each), would
        # overflow the report's 4096 and the report would be refused in place of being sent.
        text = (f"another process announces itself as node {self.node_id!r} (host {caps.hostname[:64]!r}, data "
                f"host {caps.data_host[:64]!r}): both receive this node's assignments; give every box its own node_id")
        log.error("node.duplicate_node_id", node=self.node_id, other_host=caps.hostname,
                  other_data_host=caps.data_host, times=self.seen)
        self.bus.publish_message(m.ErrorResponse(code="duplicate_node_id", message=text, topic=self.topic),
                                 node_id=self.node_id)
