"""What the gateway shows of its job table, and what of a job must be saved at once. Pure
functions of job records (no I/O), so the service stays glue."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .types import TERMINAL, Job


def current(jobs: Iterable[Job]) -> Job | None:
    """The job Home Assistant follows: the newest unfinished one, else the newest of all."""
    jobs = list(jobs)
    live = [j for j in jobs if j.phase not in TERMINAL]
    return max(live or jobs, key=lambda j: j.created_at, default=None)


def milestone(job: Job) -> tuple:
    """What is written to disk and published at once when it changes (not only every few seconds):
    a restart must not forget a phase, a plan, a checkpoint or a re-shard ordered or applied."""
    return (job.phase, job.plan_version, job.checkpoint_step, job.replans, job.pending_plan is None,
            job.last_reshard_step, job.plan.layout() if job.plan else None, job.plan.shares if job.plan else None)


def nodes_of(job: Job) -> set[str]:
    return {e.node_id for e in job.plan.entries} | {job.owner} if job.plan else {job.owner}


def summary(job: Job) -> dict[str, Any]:
    """A job's line in a status listing."""
    return {"job_id": job.job_id, "name": job.spec.name, "phase": job.phase, "accepted": job.accepted,
            "step": job.step, "total_steps": job.total_steps, "loss": job.loss, "error": job.error,
            "created_at": job.created_at}
