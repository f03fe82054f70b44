"""Progress of a job from its ranks' iteration metrics, and the retained JobState view of a job.

Pure arithmetic over the job record. Per node the record keeps running sums over the current plan
version ([iterations, compute_s, idle_s, iteration_s]); the first iteration after a (re)start is
left out of them, because it pays one-time costs (allocator warm-up, first Gloo connections) and
would skew the comparison of measured against predicted compute time.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .jobtypes import Job


def apply_metrics(job: Job, m: dict[str, Any], now: float, stall_s: float) -> Job:
    if m["plan_version"] != job.plan_version or m["node_id"] not in job.plan_nodes \
            or job.phase not in ("running", "paused"):
        return job
    changes: dict[str, Any] = {"deadline": now + stall_s, "updated_at": now}
    if m["step"] > job.resume_step + 1:
        n, compute, idle, iteration = job.agg.get(m["node_id"], [0, 0.0, 0.0, 0.0])
        changes["agg"] = {**job.agg, m["node_id"]: [n + 1, compute + m["compute_s"], idle + m["idle_s"],
                                                     iteration + m["iteration_s"]]}
    if m["rank"] == 0:
        changes.update(step=m["step"], epoch=m["epoch"], loss=m["loss"],
                       last_iteration_s=m["iteration_s"])
    return replace(job, **changes)


def _mean_iteration_s(job: Job) -> float | None:
    sums = [(a[0], a[3]) for a in job.agg.values() if a[0]]
    if not sums:
        return job.last_iteration_s
    return max(total / n for n, total in sums)  # every rank waits for the slowest


def state_view(job: Job) -> dict[str, Any]:
    """Fields of the JobState message for this job."""
    iteration_s = _mean_iteration_s(job)
    remaining = max(job.total_steps - job.step, 0)
    eta = remaining * iteration_s if iteration_s is not None and job.phase == "running" else None
    predicted = {e["node_id"]: e["predicted_compute_s"] for e in job.plan["entries"]} if job.plan else {}
    return {
        "job_id": job.job_id, "name": job.spec["name"], "phase": job.phase, "step": job.step,
        "total_steps": job.total_steps or None, "epoch": job.epoch, "loss": job.loss,
        "eval_metric": job.eval_metric, "eval_metric_name": job.eval_metric_name,
        "iteration_s": iteration_s,
        "idle_ratio": {n: a[2] / a[3] for n, a in job.agg.items() if a[3] > 0},
        "predicted_s": predicted,
        "measured_s": {n: a[1] / a[0] for n, a in job.agg.items() if a[0]},
        "eta_s": eta, "plan": job.plan, "events": list(job.events), "updated_at": job.updated_at,
        "error": job.error,
    }
