"""Progress of a job from its ranks' iteration metrics, and the retained JobState view of a job.

Pure arithmetic over the job record. Per node the record keeps running sums over the current plan
version (`Agg`: iterations, compute_s, idle_s, iteration_s); the first iteration after a
(re)start is left out of them, because it pays one-time costs (allocator warm-up, first Gloo
connections) and would skew the comparison of measured against predicted compute time, and so are
an overlap trial's steps and the first after them (they run modes other than the one kept).

A metric counts only from a node of the current plan speaking for its own rank; only rank 0's
sets the job's step and loss, and never beyond the job's length. Every number of the view is
finite and within the JobState's bounds (an ETA that would overflow is unknown, not NaN).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from xronos.protocol import messages as m

from .types import Agg, Job


def apply_metrics(job: Job, x: m.IterationMetrics, now: float, stall_s: float) -> Job:
    if x.plan_version != job.plan_version or job.rank_of(x.node_id) != x.rank \
            or job.phase not in ("running", "paused"):
        return job
    changes: dict[str, Any] = {"deadline": now + stall_s, "updated_at": now}
    if x.peak_rss > job.peak_rss.get(x.node_id, 0):
        changes["peak_rss"] = {**job.peak_rss, x.node_id: x.peak_rss}
    # The first step of a (re)start pays one-time costs; an overlap trial's steps (Plan.trial) run
    # other modes than the one kept, and the first step after it switches: none is what runs.
    first = job.resume_step + 1 + (job.plan.trial.steps if job.plan is not None and job.plan.trial is not None else 0)
    if x.step > first:
        n, compute, idle, iteration, comm = job.agg.get(x.node_id, Agg(0, 0.0, 0.0, 0.0, 0.0))
        changes["agg"] = {**job.agg, x.node_id: Agg(n + 1, compute + x.compute_s, idle + x.idle_s,
                                                    iteration + x.iteration_s, comm + x.comm_s)}
    if x.clock is not None and x.clock != job.clock:
        changes["clock"] = x.clock
    if x.rank == 0:
        step = min(x.step, job.total_steps) if job.total_steps else x.step
        changes.update(step=step, epoch=x.epoch, loss=x.loss, last_iteration_s=x.iteration_s)
    return replace(job, **changes)


def _mean_iteration_s(job: Job) -> float | None:
    sums = [(a.n, a.iteration_s) for a in job.agg.values() if a.n]
    if not sums:
        return job.last_iteration_s
    return max(total / n for n, total in sums)  # every rank waits for the slowest


def _bounded(x: float | None, hi: float) -> float | None:
    return x if x is not None and math.isfinite(x) and 0 <= x <= hi else None


def _mape(predicted: dict[str, float], measured: dict[str, float]) -> float | None:
    """Mean absolute percentage error over the nodes with both numbers (None: none has)."""
    pairs = [(predicted[n], v) for n, v in measured.items() if n in predicted and v > 0]
    if not pairs:
        return None
    return _bounded(100.0 * sum(abs(p - v) / v for p, v in pairs) / len(pairs), m.MAX_PERCENT)


def state_view(job: Job) -> m.JobState:
    """The JobState message for this job."""
    iteration_s = _bounded(_mean_iteration_s(job), m.MAX_SECONDS)
    remaining = max(job.total_steps - job.step, 0)
    eta = _bounded(remaining * iteration_s, m.MAX_INT) \
        if iteration_s is not None and job.phase == "running" else None
    predicted = {e.node_id: e.predicted_compute_s for e in job.plan.entries} if job.plan else {}
    measured = {n: min(a.compute_s / a.n, m.MAX_SECONDS) for n, a in job.agg.items() if a.n}
    # Communication: a collective ends for every rank at once, so the plan's term is every node's.
    predicted_comm = {e.node_id: job.plan.comm_s for e in job.plan.entries} if job.plan else {}
    measured_comm = {n: min(a.comm_s / a.n, m.MAX_SECONDS) for n, a in job.agg.items() if a.n}
    return m.JobState(
        job_id=job.job_id, name=job.spec.name, phase=job.phase, step=job.step,
        total_steps=job.total_steps or None, epoch=job.epoch, loss=job.loss,
        eval_metric=job.eval_metric, eval_metric_name=job.eval_metric_name, eval_initial=job.eval_initial,
        export_dir=job.export_dir, iteration_s=iteration_s, clock=job.clock,
        idle_ratio={n: min(max(a.idle_s / a.iteration_s, 0.0), 1.0) for n, a in job.agg.items()
                    if a.iteration_s > 0},
        predicted_s=predicted,
        measured_s=measured,
        predicted_comm_s=predicted_comm,
        measured_comm_s=measured_comm,
        compute_mape_pct=_mape(predicted, measured),
        comm_mape_pct=_mape(predicted_comm, measured_comm),
        predicted_peak_bytes={e.node_id: min(int(e.predicted_memory), 2**50) for e in job.plan.entries}
        if job.plan else {},
        peak_rss_bytes=dict(job.peak_rss),
        eta_s=eta, plan=job.plan, replans=job.replans, last_replan_reason=job.last_replan_reason,
        overlap_kept=job.trial_kept[2] if job.trial_kept is not None and job.trial_kept[0] == job.plan_version
        else None,
        events=list(job.events), updated_at=job.updated_at, error=job.error,
    )
