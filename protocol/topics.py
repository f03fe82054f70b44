"""The topic table: the only place that says which topic carries which message, how it is encoded
and whether it is retained. Patterns are relative to a configurable base topic (default "xronos").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import TypeAdapter

from . import hastate as ha
from . import messages as m

Encoding = Literal["json", "msgpack", "text"]
DEFAULT_BASE = "xronos"
DEFAULT_DISCOVERY_PREFIX = "homeassistant"
_PARAM = re.compile(r"\{(\w+)\}")
# A node or job id in a topic: the same pattern as the messages' `Id` (safe as a topic level and a
# file name). A topic whose id level does not match is not in the table: nothing decodes it.
_ID_LEVEL = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,%d}" % (m.MAX_ID - 1)


@dataclass(frozen=True)
class TopicEntry:
    key: str  # stable short name, e.g. "node.capabilities"
    pattern: str  # relative to the base, e.g. "node/{node_id}/capabilities"
    payload: Any  # a Message subclass, the JobControl union, or Availability (text)
    encoding: Encoding
    retained: bool
    direction: str  # for humans: who publishes → who reads
    # A parameter listed here may only take these values (and may contain "/").
    choices: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # "base": under the Xronos base topic; "discovery": under Home Assistant's discovery prefix.
    root: Literal["base", "discovery"] = "base"
    # A tighter payload cap than the bus-wide one (Home Assistant's small commands).
    max_bytes: int | None = None
    # A command (Home Assistant's): someone acts on it once. Like every topic not retained by
    # design, a retained copy is ignored and cleared by the dispatcher, never acted on.
    command: bool = False

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(_PARAM.findall(self.pattern))

    @property
    def adapter(self) -> TypeAdapter:
        return _adapter(self.payload)

    @property
    def is_request(self) -> bool:
        return self.key.startswith("gateway.request.")


_ADAPTERS: dict[int, TypeAdapter] = {}


def _adapter(payload: Any) -> TypeAdapter:
    key = id(payload)
    if key not in _ADAPTERS:
        _ADAPTERS[key] = TypeAdapter(payload)
    return _ADAPTERS[key]


def _request_entry(name: str, model: type[m.GatewayRequest]) -> TopicEntry:
    return TopicEntry(f"gateway.request.{name}", f"gateway/request/{name}", model, "json", False,
                      "client → gateway")


ENTRIES: tuple[TopicEntry, ...] = (
    # The node reads it too: it answers an `offline` left by another process under its id (ownavail).
    TopicEntry("node.availability", "node/{node_id}/availability", m.Availability, "text", True,
               "node → all, itself too (last-will offline)"),
    # ... and this one: another process announcing under its id is a duplicate node id (owncaps).
    TopicEntry("node.capabilities", "node/{node_id}/capabilities", m.Capabilities, "json", True,
               "node → gateway, HA, itself too"),
    TopicEntry("node.profile_request", "node/{node_id}/profile/request", m.ProfileRequest,
               "msgpack", False, "gateway → node"),
    TopicEntry("node.profile_report", "node/{node_id}/profile/report", m.ProfileReport,
               "msgpack", False, "node → gateway"),
    TopicEntry("node.assignment", "node/{node_id}/assignment", m.Assignment, "msgpack", False,
               "gateway → node"),
    TopicEntry("node.ack", "node/{node_id}/ack", m.AssignmentAck, "msgpack", False,
               "node → gateway"),
    TopicEntry("node.control", "node/{node_id}/control", m.JobControl, "msgpack", False,
               "gateway → node"),
    TopicEntry("node.metrics", "node/{node_id}/metrics", m.IterationMetrics, "msgpack", False,
               "node → gateway"),
    TopicEntry("node.error", "node/{node_id}/error", m.ErrorResponse, "json", False,
               "node → gateway, HA"),
    TopicEntry("node.inspect_request", "node/{node_id}/inspect/request", m.InspectRequest,
               "msgpack", False, "gateway → node"),
    TopicEntry("node.inspect_report", "node/{node_id}/inspect/report", m.InspectReport,
               "msgpack", False, "node → gateway"),
    TopicEntry("node.job", "node/{node_id}/job", m.NodeJobStatus, "json", True,
               "node → gateway, HA"),
    # The owner's model directories and data files (protocol/msgcatalog.py), for HA's job form.
    TopicEntry("node.catalog", "node/{node_id}/catalog", m.NodeCatalog, "json", True, "node → gateway"),
    TopicEntry("node.catalog_request", "node/{node_id}/catalog/request", m.CatalogRequest, "json", False,
               "gateway → node"),
    TopicEntry("job.state", "job/{job_id}/state", m.JobState, "json", True, "gateway → HA, CLI"),
    TopicEntry("gateway.availability", "gateway/availability", m.Availability, "text", True,
               "gateway → all (last-will offline)"),
    *(_request_entry(name, model) for name, model in m.REQUEST_MODELS.items()),
    TopicEntry("gateway.response", "gateway/response/{name}", m.GatewayResponse, "json", False,
               "gateway → client", choices={"name": tuple(m.REQUEST_MODELS)}),
    # Home Assistant (INTERFACES.md §7): JSON, no schema_version, small bounded commands.
    TopicEntry("gateway.ha_state", ha.GATEWAY_STATE, ha.GatewayHAState, "json", True, "gateway → HA"),
    TopicEntry("gateway.set", ha.GATEWAY_SET, ha.GatewayCommand, "json", False, "HA → gateway",
               max_bytes=ha.COMMAND_MAX_BYTES, command=True),
    TopicEntry("node.ha_state", ha.NODE_STATE, ha.NodeHAState, "json", True, "node → HA"),
    TopicEntry("node.set", ha.NODE_SET, ha.NodeCommand, "json", False, "HA → node",
               max_bytes=ha.COMMAND_MAX_BYTES, command=True),
    TopicEntry("ha.status", "status", ha.HAStatus, "text", True, "HA → gateway (birth / last-will)",
               root="discovery", max_bytes=64),
)
BY_KEY: dict[str, TopicEntry] = {e.key: e for e in ENTRIES}

# Concrete classes a payload may be, per entry (the JobControl union expands to its members).
_CONTROL_CLASSES = (m.JobStart, m.JobPause, m.JobResume, m.JobCancel, m.JobReshard)


def _classes(entry: TopicEntry) -> tuple[type, ...]:
    if entry.payload is m.JobControl:
        return _CONTROL_CLASSES
    if entry.payload is m.Availability:
        return (m.Availability, str)
    return (entry.payload,)



def encoding_for(message: Any) -> Encoding:
    """Encoding of a message by its type (the table guarantees one encoding per type)."""
    for entry in ENTRIES:
        if isinstance(message, _classes(entry)):
            return entry.encoding
    raise TypeError(f"{type(message).__name__} is not carried by any topic of the table")


def _check_level(name: str, value: str, multi: bool) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"topic parameter {name}: must be a non-empty string, got {value!r}")
    bad = set(value) & ({"+", "#", "\0"} if multi else {"/", "+", "#", "\0"})
    if bad:
        raise ValueError(f"topic parameter {name}={value!r}: contains {''.join(sorted(bad))!r}")


class TopicTable:
    """The table bound to one base topic: build topics, subscription filters, and match topics."""

    def __init__(self, base: str = DEFAULT_BASE, discovery_prefix: str = DEFAULT_DISCOVERY_PREFIX) -> None:
        for name, value in (("base", base), ("discovery_prefix", discovery_prefix)):
            _check_level(name, value, multi=True)
            if value.startswith("/") or value.endswith("/") or "//" in value:
                raise ValueError(f"{name} topic {value!r}: no leading, trailing or empty levels")
        self.base, self.discovery_prefix = base, discovery_prefix
        self._regex = [(e, self._compile(e)) for e in ENTRIES]

    def root_of(self, entry: TopicEntry) -> str:
        return self.discovery_prefix if entry.root == "discovery" else self.base

    def _compile(self, entry: TopicEntry) -> re.Pattern[str]:
        parts, pos = [], 0
        for mt in _PARAM.finditer(entry.pattern):
            parts.append(re.escape(entry.pattern[pos:mt.start()]))
            name = mt.group(1)
            alts = entry.choices.get(name)
            body = "|".join(re.escape(a) for a in alts) if alts else _ID_LEVEL
            parts.append(f"(?P<{name}>{body})")
            pos = mt.end()
        parts.append(re.escape(entry.pattern[pos:]))
        return re.compile(re.escape(self.root_of(entry) + "/") + "".join(parts) + r"\Z")

    def build(self, entry: TopicEntry | str, **params: str) -> str:
        """Concrete topic, e.g. build("node.capabilities", node_id="pi5") -> "xronos/node/pi5/capabilities"."""
        entry = BY_KEY[entry] if isinstance(entry, str) else entry
        if set(params) != set(entry.params):
            raise ValueError(f"topic {entry.key}: needs parameters {entry.params}, got {tuple(params)}")
        for name, value in params.items():
            _check_level(name, value, multi=name in entry.choices)
            if name in entry.choices and value not in entry.choices[name]:
                raise ValueError(f"topic {entry.key}: {name}={value!r} is not one of {entry.choices[name]}")
            if name not in entry.choices and not re.fullmatch(_ID_LEVEL, value):
                raise ValueError(f"topic {entry.key}: {name}={value[:40]!r} is not an id "
                                 "([A-Za-z0-9_][A-Za-z0-9_.-]*, at most 128 characters)")
        return f"{self.root_of(entry)}/{entry.pattern.format(**params)}"

    def filter(self, entry: TopicEntry | str, **params: str) -> str:
        """Subscription filter: missing parameters become "+" ("#" for a multi-level one at the end)."""
        entry = BY_KEY[entry] if isinstance(entry, str) else entry
        unknown = set(params) - set(entry.params)
        if unknown:
            raise ValueError(f"topic {entry.key}: unknown parameters {sorted(unknown)}")
        filled = {n: params.get(n, "#" if n in entry.choices else "+") for n in entry.params}
        for name, value in params.items():
            _check_level(name, value, multi=name in entry.choices)
        return f"{self.root_of(entry)}/{entry.pattern.format(**filled)}"

    def match(self, topic: str) -> tuple[TopicEntry, dict[str, str]] | None:
        for entry, rx in self._regex:
            mt = rx.match(topic)
            if mt:
                return entry, mt.groupdict()
        return None

    def entry_for(self, message: Any, params: dict[str, str]) -> TopicEntry:
        """The entry that carries `message` with exactly these parameter names."""
        found = [e for e in ENTRIES if isinstance(message, _classes(e)) and set(e.params) == set(params)]
        if len(found) != 1:
            raise TypeError(
                f"no single topic carries {type(message).__name__} with parameters {sorted(params)}"
            )
        return found[0]

    def topic_for(self, message: Any, **params: str) -> tuple[str, TopicEntry]:
        entry = self.entry_for(message, params)
        return self.build(entry, **params), entry
