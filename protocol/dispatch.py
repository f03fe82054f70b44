"""Turn incoming (topic, payload) into typed messages and run the registered handler, safely.

Bad input is logged (topic, client, reason), counted per reason, answered where someone waits for
an answer (a gateway request gets an error GatewayResponse with its transaction when it can be
recovered), and never stops the service. A handler that raises is treated the same way. The log
lines are throttled per (topic, reason) (`throttle.LogThrottle`): a flood is counted and answered,
but does not fill the disk.

Retained messages are state, never commands: a message the broker delivers as retained on a topic
that the table does not retain by design (a request, an assignment, a control...) is ignored,
counted as `retained_command`, and cleared from the broker (an empty retained publish), so it
cannot replay on every restart. An empty payload on such a topic (what that clearing echoes) is
ignored silently; on a retained-by-design topic it means the state was removed and is ignored too.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import structlog
from pydantic_core import to_jsonable_python

from xronos.common.throttle import LogThrottle

from . import messages as m
from .codec import MAX_PAYLOAD, DecodeError, decode
from .topics import BY_KEY, TopicEntry

log = structlog.get_logger(__name__)

# handler(message, params) -> for a gateway request, the response `data` (dict | list | None)
Handler = Callable[[Any, dict[str, str]], Any]


class RequestError(ValueError):
    """Raised by a request handler to answer with an error text (no traceback logged)."""


# A request handler returns DEFER when it will publish the response itself later (e.g. a job
# submit answered only after the owner's inspection, the profiles and a feasible plan).
DEFER = object()


class Dispatcher:
    def __init__(self, bus: Any, *, max_bytes: int = MAX_PAYLOAD, node_id: str | None = None) -> None:
        """`node_id`: when set, bad input on this node's own topics is answered with an
        ErrorResponse on `{base}/node/{node_id}/error` (so the gateway sees why nothing happened)."""
        self.bus, self.table, self.max_bytes, self.node_id = bus, bus.table, max_bytes, node_id
        self.handlers: dict[str, Handler] = {}
        self.on_errors: dict[str, Callable[[str], None]] = {}
        self.on_refused: dict[str, Callable[[str, dict[str, str], bytes], None]] = {}
        self.on_cleared: dict[str, Callable[[dict[str, str]], None]] = {}
        self.errors: collections.Counter[str] = collections.Counter()
        self.throttle = LogThrottle()  # log lines of bad input, per (topic entry, reason)

    def on(self, key: str, handler: Handler, *, subscribe: bool = True,
           on_error: Callable[[str], None] | None = None,
           on_refused: Callable[[str, dict[str, str], bytes], None] | None = None,
           on_cleared: Callable[[dict[str, str]], None] | None = None, **params: str) -> None:
        """Handle topic-table entry `key`; subscribes to its filter (params narrow it).
        `on_error(text)` also hears why a payload on this topic was refused (e.g. to show it);
        `on_refused(text, topic params, payload)` too, for a reply whose asker must hear of it."""
        entry = BY_KEY[key]
        self.handlers[key] = handler
        if on_error is not None:
            self.on_errors[key] = on_error
        if on_refused is not None:
            self.on_refused[key] = on_refused
        if on_cleared is not None:  # a retained-by-design topic's state removed (an empty retained payload)
            self.on_cleared[key] = on_cleared
        if subscribe:
            self.bus.subscribe(self.table.filter(entry, **params))

    def run_once(self, timeout: float | None) -> bool:
        """Dispatch one incoming message; False if none arrived within `timeout`."""
        item = self.bus.get(timeout)
        if item is None:
            return False
        self.dispatch(*item, retain=getattr(item, "retain", False))
        return True

    def dispatch(self, topic: str, payload: bytes, retain: bool = False) -> None:
        """Decode, check and hand one message to its handler. Never raises."""
        try:
            self._dispatch(topic, payload, retain)
        except Exception:  # an answer that cannot be sent, a broken bus: logged, never fatal
            self.errors["internal"] += 1
            log.exception("dispatch.internal_error", topic=topic[:200], client=self.bus.client_id)

    def _dispatch(self, topic: str, payload: bytes, retain: bool) -> None:
        found = self.table.match(topic)
        entry, params = found if found else (None, {})
        if entry is not None and not entry.retained and (retain or not payload):
            if payload:  # a command left retained: never replayed, and removed from the broker
                self.errors["retained_command"] += 1
                self._log("dispatch.retained_command_ignored", (entry.key, "retained_command"), topic=topic)
                self.bus.publish(topic, b"", retain=True)
                if entry.key in self.on_errors:
                    self.on_errors[entry.key]("a retained command was ignored and cleared")
            else:
                self.errors["empty"] += 1
            return
        if entry is not None and entry.retained and not payload:
            self.errors["empty"] += 1  # retained state removed: nothing to do unless someone asked
            if entry.key in self.on_cleared:
                self.on_cleared[entry.key](params)
            return
        try:
            msg = decode(topic, payload, table=self.table, max_bytes=self.max_bytes)
        except DecodeError as err:
            self._bad(entry, params, topic, err.reason, str(err), err.transaction, payload)
            return
        handler = self.handlers.get(entry.key)
        if handler is None:
            self.errors["no_handler"] += 1
            log.debug("dispatch.no_handler", topic=topic, client=self.bus.client_id)
            return
        txn = getattr(msg, "transaction", None)
        try:
            data = handler(msg, params)
        except (RequestError, ValueError, TypeError) as exc:
            self._bad(entry, params, topic, "rejected", str(exc), txn, payload)
            return
        except Exception as exc:
            self.errors["handler_error"] += 1
            log.exception("dispatch.handler_error", topic=topic, client=self.bus.client_id)
            self._answer(entry, params, topic, "handler_error", f"internal error: {type(exc).__name__}: {exc}", txn)
            return
        if entry.is_request and data is not DEFER:
            self._respond(entry, txn, data=data)

    def _bad(self, entry: TopicEntry | None, params: dict[str, str], topic: str, reason: str,
             text: str, txn: str | None, payload: bytes = b"") -> None:
        self.errors[reason] += 1
        self._log("dispatch.bad_input", (entry.key if entry else None, reason), topic=topic[:200], reason=reason,
                  detail=text)
        self._answer(entry, params, topic, reason, text, txn)
        if entry is not None and entry.key in self.on_errors:
            try:
                self.on_errors[entry.key](text)
            except Exception:
                log.exception("dispatch.on_error_failed", topic=topic)
        if entry is not None and entry.key in self.on_refused:
            try:
                self.on_refused[entry.key](text, params, payload)
            except Exception:
                log.exception("dispatch.on_error_failed", topic=topic)

    def _log(self, event: str, key: tuple[str | None, str], **fields: Any) -> None:
        self.warn_throttled(event, key, client=self.bus.client_id, **fields)

    def warn_throttled(self, event: str, key: tuple[Any, ...], **fields: Any) -> None:
        """A warning, unless lines of this key (e.g. topic entry and reason) had their share
        lately. Also for the services' own echoes of bad input (the gateway logs every error a
        node answers a bad payload with)."""
        dropped = self.throttle.admit(key)
        if dropped is None:
            return
        if dropped:
            fields["suppressed_before"] = dropped  # lines of this kind left out since the last one
        log.warning(event, **fields)

    def _answer(self, entry: TopicEntry | None, params: dict[str, str], topic: str, reason: str,
                text: str, txn: str | None) -> None:
        if entry is None:
            return
        if entry.is_request:
            self._respond(entry, txn, error=text[:2000])
        elif self.node_id is not None and params.get("node_id") == self.node_id and entry.key != "node.error":
            self.bus.publish_message(m.ErrorResponse(code=reason, message=text[:2000], topic=topic),
                                     node_id=self.node_id)

    def _respond(self, entry: TopicEntry, txn: str | None, *, data: Any = None, error: str | None = None) -> None:
        name = entry.key.removeprefix("gateway.request.")
        try:
            response = m.GatewayResponse(status="error" if error else "ok", error=error,
                                         data=to_jsonable_python(data), transaction=txn)
            self.bus.publish_message(response, name=name)
        except (ValueError, TypeError) as exc:  # handler data not a dict/list, not JSON-able, too large
            self.errors["response_error"] += 1
            log.warning("dispatch.response_error", name=name, client=self.bus.client_id, detail=str(exc))
            self.bus.publish_message(m.GatewayResponse(status="error", error=f"cannot send response: {exc}"[:2000],
                                                       transaction=txn), name=name)
