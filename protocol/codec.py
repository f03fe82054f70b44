"""Bytes <-> typed messages, by the topic table. Every way a payload can be bad ends in DecodeError."""

from __future__ import annotations

import json
from typing import Any

import msgpack
from pydantic import ValidationError

from xronos.common.errtext import reason

from . import messages as m
from .topics import TopicEntry, TopicTable, encoding_for

MAX_PAYLOAD = 256 * 1024
_DEFAULT_TABLE = TopicTable()


class DecodeError(ValueError):
    """A payload that cannot become a message. `reason` is a short code used for counting."""

    def __init__(self, topic: str, reason: str, detail: str, *, field: str | None = None,
                 transaction: str | None = None, entry: TopicEntry | None = None) -> None:
        self.topic, self.reason, self.detail, self.field = topic, reason, detail, field
        self.transaction, self.entry = transaction, entry
        where = f" field {field!r}" if field else ""
        super().__init__(f"{topic}:{where} {reason}: {detail}")


def encode(message: Any, *, max_bytes: int = MAX_PAYLOAD) -> bytes:
    """Encode by the type's encoding in the table; refuses to send what receivers would drop."""
    encoding = encoding_for(message)
    if encoding == "text":
        data = m.Availability(message).value.encode()
    elif encoding == "json":
        data = message.model_dump_json().encode()
    else:
        try:
            data = msgpack.packb(message.model_dump(mode="json"), use_bin_type=True)
        except OverflowError as exc:  # an int beyond 64 bits
            raise ValueError(f"{type(message).__name__}: cannot encode as msgpack: {exc}") from None
    if len(data) > max_bytes:
        raise ValueError(f"{type(message).__name__}: encoded size {len(data)} exceeds cap {max_bytes}")
    return data


def _parse(topic: str, entry: TopicEntry, payload: bytes) -> Any:
    try:
        if entry.encoding == "json":
            return json.loads(payload)
        return msgpack.unpackb(payload, raw=False, strict_map_key=True, timestamp=0)
    except RecursionError:
        raise DecodeError(topic, "bad_encoding", f"not {entry.encoding}: nested too deeply", entry=entry) from None
    except Exception as exc:  # msgpack raises a zoo of types; translate all at the boundary
        why = str(exc) or {"FormatError": "invalid or reserved type byte", "StackError": "nested too deeply",
                           "OutOfData": "truncated"}.get(type(exc).__name__, type(exc).__name__)
        raise DecodeError(topic, "bad_encoding", f"not {entry.encoding}: {why}", entry=entry) from None


_REASONS = {"extra_forbidden": (0, "unknown_field"), "missing": (1, "missing_field")}


def _field(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "<payload>"


def _transaction(value: Any) -> str | None:
    """The request's transaction, if it can be echoed back in an error answer: a short, valid
    string (a lone surrogate would make the answer itself unsendable)."""
    if not isinstance(value, str) or len(value) > 256:
        return None
    try:
        return m.valid_text(value)
    except ValueError:
        return None


def decode_entry(entry: TopicEntry, topic: str, payload: bytes, *, max_bytes: int = MAX_PAYLOAD) -> Any:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise DecodeError(topic, "bad_encoding", f"payload is {type(payload).__name__}, not bytes", entry=entry)
    if entry.max_bytes is not None:
        max_bytes = min(max_bytes, entry.max_bytes)
    if len(payload) > max_bytes:  # before parsing: a huge payload costs nothing but this check
        raise DecodeError(topic, "too_large", f"{len(payload)} bytes exceeds cap {max_bytes}", entry=entry)
    payload = bytes(payload)
    if entry.encoding == "text":
        text = payload.decode("utf-8", errors="replace").strip()
        kind = entry.payload if isinstance(entry.payload, type) else m.Availability
        try:
            return kind(text)
        except ValueError:
            raise DecodeError(topic, "invalid", f"expected 'online' or 'offline', got {text[:40]!r}",
                              entry=entry) from None
    obj = _parse(topic, entry, payload)
    if not isinstance(obj, dict):
        raise DecodeError(topic, "invalid", f"expected an object, got {type(obj).__name__}", entry=entry)
    txn = _transaction(obj.get("transaction"))
    version = obj.get("schema_version", m.SCHEMA_VERSION)
    if type(version) is not int or version != m.SCHEMA_VERSION:
        hint = (" (the sender runs an older Xronos: upgrade it)" if type(version) is int and version < m.SCHEMA_VERSION
                else "")
        raise DecodeError(topic, "schema_version", f"saw schema_version {version!r}, this build supports "
                          f"{m.SCHEMA_VERSION}{hint}", field="schema_version", transaction=txn, entry=entry)
    try:
        return entry.adapter.validate_python(obj, strict=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        # Name an unknown field first, then a missing one: they explain the rest (e.g. a typo).
        first = min(errors, key=lambda e: _REASONS.get(e["type"], (2, "invalid"))[0])
        code = _REASONS.get(first["type"], (2, "invalid"))[1]
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        raise DecodeError(topic, code, f"{reason(first)}{more}", field=_field(first["loc"]),
                          transaction=txn, entry=entry) from None
    except RecursionError:
        raise DecodeError(topic, "invalid", "nested too deeply", transaction=txn, entry=entry) from None


def decode(topic: str, payload: bytes, *, table: TopicTable = _DEFAULT_TABLE,
           max_bytes: int = MAX_PAYLOAD) -> Any:
    """Typed message for (topic, payload) or DecodeError (unknown topic included)."""
    found = table.match(topic)
    if found is None:
        raise DecodeError(topic, "unknown_topic", f"not in the topic table under base {table.base!r}")
    return decode_entry(found[0], topic, payload, max_bytes=max_bytes)
