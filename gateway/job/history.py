"""A job's event history: one timestamped line per noteworthy transition, bounded in count and
length (a reason may quote what a node or a person sent: never all of it). Shared by the job state
machine (`machine`) and its live re-shard transitions (`reshard`)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from .types import Job

MAX_EVENTS = 20
MAX_EVENT_CHARS = 500


def short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def note(job: Job, now: float, text: str, **changes: Any) -> Job:
    stamp = time.strftime("%H:%M:%S", time.gmtime(now))
    line = short(f"{stamp} {text}", MAX_EVENT_CHARS)
    return replace(job, events=(job.events + (line,))[-MAX_EVENTS:], updated_at=now, **changes)


def profile_warnings(job: Job, now: float, warnings: tuple[str, ...]) -> Job:
    """A usable profile that looks disturbed (`profiles.falling_times`): one line on the timeline,
    where the user looks when a plan seems off."""
    if not warnings:
        return job
    more = f" (and {len(warnings) - 1} more layers)" if len(warnings) > 1 else ""
    return note(job, now, f"warning: {warnings[0]}{more}")
