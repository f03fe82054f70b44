"""pydantic's validation errors as a person reads them: where the problem is and why.

Every refusal of a message, config, spec, layout or table names the field and the reason; these two
helpers keep that text the same everywhere it is produced."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def reason(err: Mapping[str, Any]) -> str:
    """The error's text. pydantic prefixes a validator's own text, which already says why, with
    "Value error, "; that prefix is noise to the person reading it."""
    return str(err["msg"]).removeprefix("Value error, ")


def where(loc: Sequence[Any], empty: str = "") -> str:
    """A field's path as written in a file: `jobs[2].spec.lr`; `empty` for the whole document."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or empty


def problems(errors: Sequence[Mapping[str, Any]], empty: str = "") -> str:
    """Every error of a ValidationError (`exc.errors()`) on one line: `field: reason; field: reason`.
    A rule across fields (no location, `empty` "") names its fields itself: its reason alone."""
    return "; ".join(f"{at}: {reason(e)}" if (at := where(e['loc'], empty)) else reason(e) for e in errors)
