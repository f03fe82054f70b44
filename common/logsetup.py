"""Logging for the services: structlog JSON lines on stdout, journald-aware, secrets masked.

Under systemd, stdout goes to journald, which reads a leading `<N>` on each line as the syslog
priority (SyslogLevelPrefix=, on by default) — so `journalctl -p warning` works without a journald
client library. Library logs (paho, asyncio) go through the same chain via the stdlib bridge.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping
from typing import IO, Any

import structlog

# syslog priorities (man 3 syslog) by structlog/stdlib level name.
PRIORITY = {"debug": 7, "info": 6, "warning": 4, "warn": 4, "error": 3, "exception": 3,
            "critical": 2, "fatal": 2}
MASK = "***"
_SECRET_WORDS = {"password", "passwd", "pwd", "passphrase", "secret", "token", "apikey",
                 "credential", "credentials", "authorization", "cookie", "privatekey"}
# A key naming *where* a secret lives is not itself secret ("password_file" is a path).
_LOCATION_WORDS = {"file", "path", "dir", "directory", "env"}
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
_HANDLER_NAME = "xronos-json"


def is_secret_key(key: str) -> bool:
    words = [w.lower() for w in _WORD.findall(key)]
    if not words or words[-1] in _LOCATION_WORDS:
        return False
    # Also join neighbours, so "api_key" and "privateKey" match "apikey" and "privatekey".
    candidates = words + [a + b for a, b in zip(words, words[1:])]
    return any(w in _SECRET_WORDS for w in candidates)


def _redact(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: (MASK if isinstance(k, str) and is_secret_key(k) else _redact(v))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact(v) for v in value]
    return value


def redact_secrets(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: mask values of secret-looking keys, at any nesting depth."""
    return _redact(event_dict)


class JournaldJSONRenderer:
    """JSON line, prefixed with `<priority>` when journald reads our stream."""

    def __init__(self, prefix: bool) -> None:
        self.prefix = prefix
        self._json = structlog.processors.JSONRenderer(sort_keys=False)

    def __call__(self, logger: Any, method: str, event_dict: dict[str, Any]) -> str:
        level = str(event_dict.get("level", method)).lower()
        line = self._json(logger, method, event_dict)
        return f"<{PRIORITY.get(level, 6)}>{line}" if self.prefix else line


def stream_is_journal(stream: IO[str], env: Mapping[str, str] | None = None) -> bool:
    """True if `stream` is the journald stream systemd connected (per $JOURNAL_STREAM dev:inode)."""
    env = os.environ if env is None else env
    raw = env.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in raw.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def configure_logging(level: str = "info", stream: IO[str] | None = None,
                      journald: bool | None = None) -> None:
    """Configure structlog and the stdlib root logger; safe to call again (replaces our handler).

    `journald=None` detects it from $JOURNAL_STREAM; tests pass True/False explicitly.
    """
    stream = sys.stdout if stream is None else stream
    levelno = logging.getLevelName(level.upper())
    if not isinstance(levelno, int):
        raise ValueError(f"log level {level!r}: expected one of debug, info, warning, error")
    prefix = stream_is_journal(stream) if journald is None else journald
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.add_logger_name,
            structlog.stdlib.add_log_level,
            timestamper,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,  # reconfiguring (tests, a level change) must take effect
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, structlog.stdlib.add_log_level,
                           structlog.stdlib.ExtraAdder(), timestamper],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            redact_secrets,
            structlog.processors.format_exc_info,
            JournaldJSONRenderer(prefix),
        ],
    )
    handler = logging.StreamHandler(stream)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(levelno)
