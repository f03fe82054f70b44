"""The Participate switch survives a restart: Home Assistant's last choice, kept in state_dir.

node.toml's `participate` is the default for a node that was never switched; once Home
Assistant (or anyone allowed to write `{base}/node/<id>/set`) switches it, that choice is
written to `<state_dir>/participate.json` and wins at the next start.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)
FILE = "participate.json"


def load(state_dir: str | os.PathLike[str], default: bool) -> bool:
    path = Path(state_dir) / FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as exc:
        log.warning("participation file unreadable: using node.toml's value", path=str(path), error=str(exc))
        return default
    value = doc.get("participate") if isinstance(doc, dict) else None
    if not isinstance(value, bool):
        log.warning("participation file malformed: using node.toml's value", path=str(path))
        return default
    return value


def save(state_dir: str | os.PathLike[str], value: bool) -> None:
    """Atomically; a failure is logged, never fatal (the switch still works until restart)."""
    path = Path(state_dir) / FILE
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"participate": value}) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot persist the participation switch", path=str(path), error=str(exc))
