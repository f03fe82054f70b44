"""The node registry: who is online, what each node has, whether it takes part in plans.

Pure functions over a dict node_id -> NodeInfo, fed from the retained availability and
capabilities topics. A node that is online but switched `participate = false` (Home Assistant's
switch, or its config) is left out of the next plan, yet a job it is already running goes on.

The registry is bounded (`MAX_KNOWN`): when it is full, a new node takes the place of the node
that has been offline longest; if every known node is online, the newcomer is not recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from xronos.protocol import messages as m

MAX_KNOWN = 256


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    online: bool = False
    capabilities: m.Capabilities | None = None
    seen_at: float = 0.0

    @property
    def participate(self) -> bool:
        return bool(self.capabilities and self.capabilities.participate)

    @property
    def usable(self) -> bool:
        """May be put in a plan: online, announced what it has, and willing."""
        return self.online and self.participate


Registry = dict[str, NodeInfo]


def on_availability(reg: Registry, node_id: str, online: bool, now: float) -> tuple[Registry, str | None]:
    """New registry and "up"/"down" when the node's online state changed (None otherwise). The
    first word about a node counts as a change: a node found offline at a gateway's start may
    hold a job that must now recover."""
    old = reg.get(node_id)
    change = None if old is not None and old.online == online else ("up" if online else "down")
    if old is None:
        reg = _make_room(reg)
        if len(reg) >= MAX_KNOWN:
            return reg, None
    old = old or NodeInfo(node_id)
    return {**reg, node_id: replace(old, online=online, seen_at=now)}, change


def _make_room(reg: Registry) -> Registry:
    if len(reg) < MAX_KNOWN:
        return reg
    offline = [i for i in reg.values() if not i.online]
    if not offline:
        return reg
    victim = min(offline, key=lambda i: i.seen_at)
    return {k: v for k, v in reg.items() if k != victim.node_id}


def on_capabilities(reg: Registry, caps: m.Capabilities, now: float) -> Registry:
    node_id = caps.node_id
    if node_id not in reg:
        reg = _make_room(reg)
        if len(reg) >= MAX_KNOWN:
            return reg
    old = reg.get(node_id, NodeInfo(node_id))
    return {**reg, node_id: replace(old, capabilities=caps, seen_at=now)}


def capabilities(reg: Registry) -> dict[str, m.Capabilities]:
    """The latest capabilities of every node that announced them."""
    return {n: i.capabilities for n, i in reg.items() if i.capabilities is not None}


def usable(reg: Registry) -> frozenset[str]:
    return frozenset(n for n, info in reg.items() if info.usable)


LISTED_CHARS = 64
_LISTED = ("hostname", "arch", "cpu_model", "cores", "memory_total", "memory_available", "torch_version",
           "data_host", "cpu_temp_c")


def listing(reg: Registry) -> list[dict[str, Any]]:
    """What `nodes/list` answers: one row per known node, sorted by id."""
    rows = []
    for node_id in sorted(reg):
        info, caps = reg[node_id], reg[node_id].capabilities
        row: dict[str, Any] = {"node_id": node_id, "online": info.online, "participate": info.participate}
        for name in _LISTED:
            value = getattr(caps, name) if caps is not None else None
            # a node's texts are its own to choose (up to 255 characters each): trimmed, the answer
            # for every known node stays within the response's size cap
            row[name] = value[:LISTED_CHARS] if isinstance(value, str) else value
        rows.append(row)
    return rows
