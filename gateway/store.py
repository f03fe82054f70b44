"""The gateway's job table on disk: one JSON file under the state directory, replaced atomically.

Written after every change (temp file in the same directory, fsync, rename, fsync of the
directory), so a gateway killed at any instant restarts with either the old or the new table,
never a torn one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import structlog

from .jobtypes import Job

log = structlog.get_logger(__name__)
FORMAT = 1
_TUPLES = {f.name for f in dataclasses.fields(Job) if str(f.type).startswith("tuple")}
_FIELDS = {f.name for f in dataclasses.fields(Job)}


def job_to_dict(job: Job) -> dict[str, Any]:
    return dataclasses.asdict(job)


def job_from_dict(data: dict[str, Any]) -> Job:
    unknown = set(data) - _FIELDS
    if unknown:
        raise ValueError(f"job record {data.get('job_id')!r}: unknown fields {sorted(unknown)}")
    return Job(**{k: tuple(v) if k in _TUPLES else v for k, v in data.items()})


class JobStore:
    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / "jobs.json"

    def load(self) -> dict[str, Job]:
        """The saved table ({} on first start). A damaged file is an error naming the file: the
        gateway refuses to start rather than silently forget jobs."""
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
            jobs = {j["job_id"]: job_from_dict(j) for j in data["jobs"]}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{self.path}: not a readable job table: {exc}") from None
        log.info("job table loaded", path=str(self.path), jobs=len(jobs))
        return jobs

    def save(self, jobs: dict[str, Job]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        body = json.dumps({"format": FORMAT, "jobs": [job_to_dict(j) for j in jobs.values()]},
                          allow_nan=True).encode()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as fh:
            fh.write(body)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
