"""Driving a NodeService over the FakeBus: step its loop until what a test waits for came out.

The node hears more than a test sends it (its own availability echo on every connect, among
others), so a test steps it until a condition holds rather than once per message it sent."""

from __future__ import annotations

import time
from typing import Any, Callable

from xronos.protocol.codec import decode
from xronos.protocol.topics import TopicTable

T = TopicTable()


def msgs(client: Any, key: str) -> list[Any]:
    """Decoded messages of topic-table entry `key` the client has received (drains its queue; an
    empty payload, a cleared retained state, is skipped)."""
    out = []
    for topic, payload in client.drain():
        found = T.match(topic)
        if found and found[0].key == key and payload:
            out.append(decode(topic, payload))
    return out


def pump(svc: Any, until: Callable[[], bool] | None = None, timeout: float = 60.0) -> None:
    """Step the node until `until()` holds (once, without a condition)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        svc.step(0.05)
        if until is None or until():
            return
    raise TimeoutError(f"the node did not get there within {timeout} s")


def replies(svc: Any, client: Any, key: str, count: int = 1, timeout: float = 60.0) -> list[Any]:
    """Step the node until `count` messages of `key` came out; all of them (others are drained)."""
    got: list[Any] = []

    def enough() -> bool:
        got.extend(msgs(client, key))
        return len(got) >= count

    pump(svc, until=enough, timeout=timeout)
    return got
