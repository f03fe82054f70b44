"""Who may import whom (ARCHITECTURE.md, "The house"), read from the source itself: every import
statement of every module, those inside functions included (a lazy import is still a dependency).

- the planes import only downwards: common (the plumbing below the wire) nothing of ours; protocol
  only common; gateway and node only protocol and common; cli every plane but never the bench; the
  bench everything;
- no import cycle between modules of common, protocol, gateway, node or cli (so none between cli,
  bench and node either, by the first rule);
- inside a plane, its rooms (ROOMS) import only the rooms below them, and its top rooms
  (TOP_ROOMS) nothing else of the plane imports;
- the gateway service's components meet only through its core's interface (gateway/service/component.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "protocol", "gateway", "node", "cli", "bench")
MAY_IMPORT = {
    "common": set(),
    "protocol": {"common"},
    "gateway": {"common", "protocol"},
    "node": {"common", "protocol"},
    "cli": {"common", "protocol", "gateway", "node"},
    "bench": {"common", "protocol", "gateway", "node", "cli"},
}
ACYCLIC = ("common", "protocol", "gateway", "node", "cli")


def _modules() -> dict[str, Path]:
    mods = {}
    for top in PACKAGES:
        for f in sorted((ROOT / top).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods["xronos." + ".".join(parts)] = f
    return mods


def _graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (a name imported from a package counts as its
    submodule when there is one)."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                names = [name] + [f"{name}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for n in names:
                while n and n not in mods:
                    n = n.rpartition(".")[0]
                if n and n != mod:
                    edges[mod].add(n)
    return edges


def _plane(mod: str) -> str:
    return mod.split(".")[1]


def test_the_planes_import_only_what_the_house_allows() -> None:
    graph = _graph()
    assert "xronos.node.rank.lifecycle" in graph and "xronos.cli.main" in graph and "xronos.common.configfile" in graph
    bad = sorted(f"{a} imports {b}" for a, bs in graph.items() for b in bs
                 if _plane(b) != _plane(a) and _plane(b) not in MAY_IMPORT[_plane(a)])
    assert bad == [], "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("plane", ACYCLIC)
def test_no_import_cycle_inside_a_plane(plane: str) -> None:
    graph = {m: {b for b in bs if _plane(b) == plane} for m, bs in _graph().items() if _plane(m) == plane}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_tp_engine_does_not_know_the_emulator() -> None:
    """node/tp meets an emulated box only through the clock it is given (`xronos.node.tp.clock`):
    no module of node/tp imports node/emulate, directly or through another module of ours."""
    graph = _graph()
    assert "xronos.node.emulate.pacer" in graph and "xronos.node.tp.group" in graph
    reach: dict[str, set[str]] = {}

    def reachable(m: str) -> set[str]:
        if m not in reach:
            reach[m] = set()
            for b in graph[m]:
                reach[m] |= {b} | reachable(b)
        return reach[m]

    bad = sorted(f"{m} reaches {b}" for m in graph if m.startswith("xronos.node.tp")
                 for b in reachable(m) if b.startswith("xronos.node.emulate"))
    assert bad == [], "\n".join(bad)


# Rooms inside a plane: module prefix -> the prefixes of that plane it may import (besides itself).
ROOMS = {
    "xronos.gateway.plan": (),  # planning is pure over profiles: it knows no job
    "xronos.gateway.job": ("xronos.gateway.plan", "xronos.gateway.registry"),
    "xronos.node.dp": ("xronos.node.models", "xronos.node.tp", "xronos.node.data"),  # below the rank's engines
    "xronos.node.box": ("xronos.node.emulate",),  # this box and the bounds of its children: low
    "xronos.node.data": ("xronos.node.models", "xronos.node.tp", "xronos.node.runconfig"),
    # a training rank: of measuring, only the two probes every rank process runs under (its own
    # memory watch and the allocator setting), which import nothing of the node
    "xronos.node.rank": ("xronos.node.box", "xronos.node.data", "xronos.node.dp", "xronos.node.emulate", "xronos.node.models",
                         "xronos.node.tp", "xronos.node.runconfig", "xronos.node.measure.memwatch",
                         "xronos.node.measure.allocator"),
    # measuring runs what a rank runs (its optimizer, its child processes): above the rank
    "xronos.node.measure": ("xronos.node.rank", "xronos.node.box", "xronos.node.data", "xronos.node.emulate",
                            "xronos.node.models", "xronos.node.tp", "xronos.node.runconfig"),
    # the probes a rank runs under: nothing of the node
    "xronos.node.measure.memwatch": (),
    "xronos.node.measure.allocator": (),
}
# Rooms at the top of their plane: nothing else in the plane imports them.
TOP_ROOMS = ("xronos.node.agent", "xronos.gateway.service")


def _in(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def test_the_rooms_of_a_plane_import_only_downwards() -> None:
    graph = _graph()
    assert {"xronos.gateway.plan.planner", "xronos.gateway.job.machine", "xronos.node.agent.service",
            "xronos.gateway.service.core",
            "xronos.node.box.limits", "xronos.node.data.batches", "xronos.node.rank.lifecycle",
            "xronos.node.measure.memwatch"} <= graph.keys()
    bad = []
    for room, allowed in ROOMS.items():
        plane = room.rsplit(".", 1)[0]
        for a in (m for m in graph if _in(m, room)):
            bad += [f"{a} imports {b}" for b in graph[a] if _in(b, plane) and not _in(b, room)
                    and not any(_in(b, ok) for ok in allowed)]
    for room in TOP_ROOMS:
        plane = room.rsplit(".", 1)[0]
        bad += [f"{a} imports {b}" for a, bs in graph.items() if _in(a, plane) and not _in(a, room)
                for b in bs if _in(b, room)]
    assert sorted(bad) == [], "\n".join(sorted(bad))


def test_the_gateway_services_components_meet_only_through_the_core_interface() -> None:
    """A component of the gateway service (gateway/service/) reaches the job table, the registry,
    the bus and the other components only through the core's interface (`component.Core`): no
    component imports another component or the core, and the interface imports neither."""
    graph = _graph()
    room = "xronos.gateway.service"
    interface = f"{room}.component"
    parts = {m for m in graph if _in(m, room)} - {room, f"{room}.core"}
    assert {interface, f"{room}.nodes", f"{room}.requests", f"{room}.homeassistant", f"{room}.availability"} <= parts
    bad = sorted(f"{a} imports {b}" for a in parts for b in graph[a] if _in(b, room) and b != interface)
    assert bad == [], "\n".join(bad)


def test_no_gateway_module_is_named_for_a_room_it_stands_beside() -> None:
    """Planning, job and Home Assistant modules live in their rooms (gateway/plan/, gateway/job/,
    gateway/homeassistant/), not beside them under a prefix (`planner.py`, `jobtypes.py`,
    `rebalmodel.py`, `habridge.py` at gateway/ were what the rooms replaced)."""
    prefixes = ("plan", "job", "rebal", "ha")
    stray = sorted(f.name for f in (ROOT / "gateway").glob("*.py") if f.stem.startswith(prefixes))
    assert stray == [], stray
