"""What a node keeps on disk of the jobs it ran: `state_dir/jobs/<job_id>/` holds a directory per
plan version it started a rank of (`v<N>/`: the rank's config, with the job's group key, and its
log) and, on the owner, the job's checkpoints (`checkpoint/`). Pure file handling, no service.

Every accepted assignment adds a version directory, and a job id from the broker adds a job
directory, so both are bounded (`prune`): a job keeps the directories of its `KEEP_VERSIONS` latest
versions (the ranks of the ones before are gone; their logs say how a rank failed in a move or a
recovery), and beyond `KEEP_JOBS` the oldest job directories go — except one that
holds checkpoints, which are a failed or cancelled job's way to resume and stay until the job
completes (docs/jobs.md).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

KEEP_JOBS = 32  # job directories kept besides the current one and those with checkpoints
KEEP_VERSIONS = 4  # a job's latest plan versions whose rank directories are kept (logs)


def _has_checkpoints(job: Path) -> bool:
    ckpt = job / "checkpoint"
    return ckpt.is_dir() and any(ckpt.iterdir())


def prune(jobs_root: Path, job_id: str, version: int, keep_jobs: int = KEEP_JOBS,
          keep_versions: int = KEEP_VERSIONS) -> list[Path]:
    """Before a rank of `job_id` v`version` starts under `jobs_root`: remove that job's version
    directories but `version` and the `keep_versions` - 1 latest others, and the oldest job
    directories without checkpoints beyond `keep_jobs`. The paths removed; a directory that cannot
    be removed is logged and left."""
    gone: list[Path] = []

    def remove(path: Path) -> None:
        if path.is_symlink() or not path.is_dir():  # never follow a link planted under the root
            return
        try:
            shutil.rmtree(path)
            gone.append(path)
        except OSError as exc:
            log.warning("could not remove an old job directory", path=str(path), error=str(exc))

    mine = jobs_root / job_id
    if mine.is_dir():
        others = sorted((v for v in mine.glob("v*") if v.name[1:].isdigit() and v.name != f"v{version}"),
                        key=lambda v: int(v.name[1:]), reverse=True)
        for v in others[max(0, keep_versions - 1):]:
            remove(v)
    if jobs_root.is_dir():
        others = [d for d in jobs_root.iterdir() if d.name != job_id and d.is_dir() and not d.is_symlink()
                  and not _has_checkpoints(d)]
        others.sort(key=lambda d: d.stat().st_mtime, reverse=True)
        for old in others[keep_jobs:]:
            remove(old)
    return gone
