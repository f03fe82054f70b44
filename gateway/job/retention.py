"""What the job table keeps of finished jobs: `prune` bounds the history (by age, then by count;
unfinished jobs are never dropped), `finished` strips a finished job of its profiles and in-flight
bookkeeping. Pure, like the machine: the service calls them when a job ends and on its sweep."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from .types import TERMINAL, Job


def prune(jobs: Mapping[str, Job], now: float, keep: int, max_age_s: float) -> tuple[dict[str, Job], list[str]]:
    """Bound the history: finished jobs older than `max_age_s` go, and of the rest only the newest
    `keep`. Unfinished jobs are never pruned. Returns (kept table, ids of the jobs dropped)."""
    done = sorted((j for j in jobs.values() if j.phase in TERMINAL), key=lambda j: (j.updated_at, j.created_at))
    old = {j.job_id for j in done if now - j.updated_at > max_age_s}
    young = [j for j in done if j.job_id not in old]
    old |= {j.job_id for j in young[: max(len(young) - keep, 0)]}
    return {k: j for k, j in jobs.items() if k not in old}, sorted(old)


def finished(job: Job) -> Job:
    """A finished job as the history keeps it: without its profiles and in-flight bookkeeping."""
    if job.phase not in TERMINAL or not (job.profiles or job.requests or job.waiting or job.join_requests
                                         or job.join_plan or job.offline_since):
        return job
    return replace(job, profiles={}, requests=(), waiting=(), awaiting="", deadline=None, recover_deadline=None,
                   join_requests=(), join_plan=None, offline_since={})
