"""The node registry: who is online, what each node has, whether it takes part in plans.

Pure functions over a dict node_id -> NodeInfo, fed from the retained availability and
capabilities topics. A node that is online but switched `participate = false` (Home Assistant's
switch, or its config) is left out of the next plan, yet a job it is already running goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

MiB = 1024 * 1024


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    online: bool = False
    capabilities: dict[str, Any] | None = None  # Capabilities in JSON form
    seen_at: float = 0.0

    @property
    def participate(self) -> bool:
        return bool(self.capabilities and self.capabilities.get("participate", True))

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
    old = old or NodeInfo(node_id)
    return {**reg, node_id: replace(old, online=online, seen_at=now)}, change


def on_capabilities(reg: Registry, caps: dict[str, Any], now: float) -> Registry:
    node_id = caps["node_id"]
    old = reg.get(node_id, NodeInfo(node_id))
    return {**reg, node_id: replace(old, capabilities=caps, seen_at=now)}


def usable(reg: Registry) -> frozenset[str]:
    return frozenset(n for n, info in reg.items() if info.usable)


def memory_cap(reg: Registry, node_id: str, reserve_mb: int) -> float:
    """Bytes a plan may use on the node: what it reports available minus the job's reserve."""
    caps = reg[node_id].capabilities
    if caps is None:
        raise ValueError(f"node {node_id!r} has not announced its capabilities")
    return max(float(caps["memory_available"]) - reserve_mb * MiB, 0.0)


def listing(reg: Registry) -> list[dict[str, Any]]:
    """What `nodes/list` answers: one row per known node, sorted by id."""
    rows = []
    for node_id in sorted(reg):
        info, caps = reg[node_id], reg[node_id].capabilities or {}
        rows.append({
            "node_id": node_id, "online": info.online, "participate": info.participate,
            "hostname": caps.get("hostname"), "arch": caps.get("arch"), "cpu_model": caps.get("cpu_model"),
            "cores": caps.get("cores"), "memory_total": caps.get("memory_total"),
            "memory_available": caps.get("memory_available"), "torch_version": caps.get("torch_version"),
            "data_host": caps.get("data_host"), "cpu_temp_c": caps.get("cpu_temp_c"),
        })
    return rows
