"""The gateway's job table on disk: one compact JSON file under the state directory, replaced
atomically, with the previous good table kept beside it.

Written after a change (temp file in the same directory, fsync, then the current table becomes
`jobs.json.prev` and the temp file `jobs.json`, each by an atomic rename, then fsync of the
directory), so a gateway killed at any instant restarts with the old or the new table, never a torn
one; if it died between the two renames, `jobs.json.prev` is loaded. A table that does not read
back (damaged on disk, edited by hand, wrong field types) stops the gateway with an error naming
the file and the field, and says how to put the previous good table back:

    xronos gateway --config /etc/xronos/gateway.toml --restore-previous

which checks `jobs.json.prev`, keeps the damaged file as `jobs.json.damaged-<unix time>` and
puts the previous table in place (`restore_previous`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import structlog
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from xronos.common.errtext import reason, where
from xronos.protocol.specfile import upgrade_spec

from .types import Job

log = structlog.get_logger(__name__)
FORMAT = 1
MAX_TABLE_BYTES = 64 * 1024 * 1024  # far beyond a bounded history; refuses a runaway file


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, ser_json_inf_nan="constants")
    format: Literal[1]
    jobs: list[Job]


_TABLE = TypeAdapter(_Table)
_JOB = TypeAdapter(Job)


def _loc(loc: tuple) -> str:
    return where(loc, "<document>")


def job_to_dict(job: Job) -> dict:
    return _JOB.dump_python(job, mode="json")


def job_from_dict(data: Mapping) -> Job:
    """A job record from its JSON form (ValueError naming the field otherwise)."""
    try:
        return _JOB.validate_python(dict(data))
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        raise ValueError(f"job record {data.get('job_id')!r}: field {_loc(first['loc'])}: {reason(first)}") from None


def _upgraded(text: bytes | str) -> bytes | str:
    """The table with each job's spec as version 3: a table written before the recipe holds
    version-2 specs (`specfile.upgrade_spec`, the one place that maps them). A table that is not a
    list of jobs is returned as it is, for the validation to name what is wrong."""
    try:
        doc = json.loads(text)
        jobs = doc["jobs"]
        specs = [job["spec"] for job in jobs]
    except (ValueError, TypeError, KeyError, RecursionError):
        return text
    if not all(isinstance(s, dict) for s in specs) or all("recipe" in s for s in specs):
        return text
    for job, spec in zip(jobs, specs):
        job["spec"] = upgrade_spec(spec, stored=True)
    return json.dumps(doc)  # NaN and Infinity as the table writes them


def parse_table(text: bytes | str, source: str) -> dict[str, Job]:
    """The jobs of a table file's content; ValueError naming `source`, the field and the problem."""
    try:
        table = _TABLE.validate_json(_upgraded(text), strict=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        at = "not valid JSON" if first["type"] == "json_invalid" else f"field {_loc(first['loc'])}"
        raise ValueError(f"{source}: not a readable job table: {at}: {reason(first)}{more}") from None
    jobs: dict[str, Job] = {}
    for i, job in enumerate(table.jobs):
        if job.job_id in jobs:
            raise ValueError(f"{source}: not a readable job table: field jobs[{i}].job_id: "
                             f"duplicate job id {job.job_id!r}")
        jobs[job.job_id] = job
    return jobs


class JobStore:
    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / "jobs.json"
        self.prev = self.dir / "jobs.json.prev"

    def _read(self, path: Path) -> dict[str, Job]:
        try:
            with open(path, "rb") as fh:
                data = fh.read(MAX_TABLE_BYTES + 1)
        except OSError as exc:
            raise ValueError(f"{path}: cannot read the job table: {exc.strerror}") from None
        if len(data) > MAX_TABLE_BYTES:
            raise ValueError(f"{path}: not a readable job table: larger than {MAX_TABLE_BYTES} bytes")
        return parse_table(data, str(path))

    def load(self) -> dict[str, Job]:
        """The saved table ({} on first start). A damaged file is an error naming the file: the
        gateway refuses to start rather than silently forget jobs."""
        if not self.path.exists():
            if self.prev.exists():  # killed between the two renames of a save
                log.warning("job table missing, loading the previous one", path=str(self.prev))
                return self._read(self.prev)
            return {}
        try:
            jobs = self._read(self.path)
        except ValueError as exc:
            hint = ""
            if self.prev.exists():
                hint = (f"; the previous good table is {self.prev}: `xronos gateway --config <gateway.toml> "
                        "--restore-previous` puts it back")
            raise ValueError(f"{exc}{hint}") from None
        log.info("job table loaded", path=str(self.path), jobs=len(jobs))
        return jobs

    def save(self, jobs: Mapping[str, Job]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        body = _TABLE.dump_json(_Table(format=FORMAT, jobs=list(jobs.values())))
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as fh:
            fh.write(body)
            fh.flush()
            os.fsync(fh.fileno())
        if self.path.exists():
            os.replace(self.path, self.prev)
        os.replace(tmp, self.path)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def restore_previous(self) -> tuple[int, Path | None]:
        """Put the previous good table back: check it reads, keep the current (damaged) file as
        `jobs.json.damaged-<time>`, rename the previous one into place. Returns (number of jobs,
        where the damaged file went). ValueError if there is no readable previous table."""
        if not self.prev.exists():
            raise ValueError(f"{self.prev}: no previous job table to restore")
        jobs = self._read(self.prev)
        kept = None
        if self.path.exists():
            kept = self.path.with_name(f"{self.path.name}.damaged-{int(time.time())}")
            os.replace(self.path, kept)
        os.replace(self.prev, self.path)
        return len(jobs), kept
