"""A node that joins a running job (issue 14): a box that comes online, or is switched back to
Participate, is taken into the job's next plan through the checkpoint path. Pure, like `machine`,
which hands every event's outcome to `after` (and passes its `_assign`).

The world size of a Gloo group cannot grow live, so a join is a restart: the running plan is
cancelled and a plan with the newcomer resumes from a consolidated checkpoint, as a node-loss
recovery does (not counted as one). It happens only when it pays:

1. `NodeUp` of a node the job may use (named in `spec.nodes`, or any when None), online, not in
   the plan, while the job runs or is paused with `spec.rebalance` on: the node is asked for a
   profile (a request of its own, in `Job.join_requests`), unless the job already holds one.
2. With the profile: the planner (`ctx.planner`) plans the plan's nodes plus every profiled
   newcomer, and the plan's nodes alone, from the same profiles (apples to apples; the current
   plan's own prediction may come from a live re-plan's refitted speeds). The join is taken when
   the predicted gain is above `ctx.join.min_gain` and the seconds it saves over the steps left
   after the next checkpoint (the gain, as a fraction, of the job's measured iteration time)
   repay a restart: what the job measured from its latest assignment to rank 0's first metrics
   (`Job.restart_s`; or `ctx.join.restart_s` when set, or `default_restart_s` without a
   measurement) plus one iteration redone (steps past the checkpoint before the cancel lands).
   Otherwise the job's events say why not ("predicted a -> b s/iteration", the bar, the cost).
3. Taken: the plan is kept as `Job.join_plan` until the owner reports a checkpoint beyond the one
   it had (`join_after`); then the running plan is cancelled and the new one assigned from that
   step, counted in `replans` with its reason ("node X joins: plan v3 -> v4, ...").

Coherence: the join's state lives only while the job runs or is paused. A recovery (a node lost,
a rank failed, a stall) drops it (the recovery's re-plan takes every online node anyway), as do
the job's end and a cancel; a newcomer that goes offline drops its request and any plan with it;
a live re-shard pending at the checkpoint is superseded by the new plan (a consolidated
checkpoint resumes under any layout). After a gateway restart the retained availability brings
a `NodeUp` for every online node again: a request in flight is dropped on restart and asked anew.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from xronos.protocol import messages as m

from .history import note, profile_warnings, short
from .types import (
    TERMINAL, Assign, Command, Control, Ctx, Event, Job, Metrics, NodeDown, NodeUp, Out, Profile, Profiled, Status,
    plan_of, profile_mismatch,
)

MAX_REASON_CHARS = 256  # JobState.last_replan_reason
JOINABLE = ("running", "paused")
Assigner = Callable[[Job, Ctx, m.Plan], Out]


def after(event: Event, out: Out, ctx: Ctx, assign: Assigner) -> Out:
    """The join's part of an event, after the rest of the state machine handled it."""
    job, effects = _after(event, out, ctx, assign)
    if any(isinstance(e, Assign) for e in effects):  # a restart's cost runs from here
        job = replace(job, assigned_at=ctx.now)
    return job, effects


def _after(event: Event, out: Out, ctx: Ctx, assign: Assigner) -> Out:
    job, effects = out
    if job.phase not in JOINABLE:
        return _dropped(job, ctx), effects
    if isinstance(event, Metrics):
        return _measured(job, event.m, ctx), effects
    if isinstance(event, Command) and event.action == "pause":
        return replace(job, assigned_at=None), effects  # a pause is no part of a restart's cost
    if isinstance(event, NodeUp):
        job, more = _on_up(job, event.node_id, ctx)
        return job, effects + more
    if isinstance(event, NodeDown):
        return _on_down(job, event.node_id, ctx), effects
    if isinstance(event, Profiled) and (event.request_id, event.node_id) in job.join_requests:
        return _on_profiled(job, event, ctx), effects
    if isinstance(event, Status) and job.join_plan is not None and job.checkpoint_step > job.join_after:
        job, more = _join(job, ctx, assign)
        return job, effects + more
    return job, effects


def rejoin(job: Job) -> Job:
    """After a gateway restart: requests in flight are dropped (the availability's `NodeUp` asks
    anew); a join taken stays, waiting for its checkpoint."""
    return replace(job, join_requests=())


def _newcomers(job: Job, ctx: Ctx) -> tuple[str, ...]:
    """Nodes the job may take that its plan does not have: named (or any), online, not excluded."""
    pool = job.spec.nodes or sorted(ctx.online)
    return tuple(n for n in pool if n in ctx.online and n not in job.excluded and n not in job.plan_nodes)


def _who(nodes: tuple[str, ...]) -> str:
    return f"node {nodes[0]!r}" if len(nodes) == 1 else "nodes " + ", ".join(repr(n) for n in nodes)


def _dropped(job: Job, ctx: Ctx) -> Job:
    """Out of running/paused: nothing of a join stays (a recovery re-plans on every online node)."""
    if job.join_plan is None and not job.join_requests:
        return job
    if job.join_plan is not None and job.phase not in TERMINAL:  # recovering (or assigning its re-plan)
        job = note(job, ctx.now, "join dropped: the job is recovering (its re-plan takes every online node)")
    return replace(job, join_plan=None, join_requests=())


def _measured(job: Job, x: m.IterationMetrics, ctx: Ctx) -> Job:
    """Rank 0's first metrics of the current plan: the restart it took is measured."""
    if job.assigned_at is None or x.plan_version != job.plan_version or x.rank != 0 \
            or x.node_id != job.rank0 or x.step <= job.resume_step:
        return job
    return replace(job, restart_s=max(ctx.now - job.assigned_at, 0.0), assigned_at=None)


def _on_up(job: Job, node: str, ctx: Ctx) -> Out:
    if not job.spec.rebalance or job.plan is None or node not in _newcomers(job, ctx):
        return job, []
    if job.join_plan is not None and node in job.join_plan_nodes:
        return job, []  # already taken (e.g. the availability again after a gateway restart)
    if node in job.profiles:
        return _consider(job, ctx), []
    rid = f"{job.job_id}.{job.request_seq + 1}"
    requests = tuple(r for r in job.join_requests if r[1] != node) + ((rid, node),)
    job = note(job, ctx.now, f"node {node!r} is online: profiling it for the job's next plan",
               join_requests=requests, request_seq=job.request_seq + 1)
    return job, [Profile(job.job_id, ((rid, node),))]


def _on_down(job: Job, node: str, ctx: Ctx) -> Job:
    job = replace(job, join_requests=tuple(r for r in job.join_requests if r[1] != node))
    if job.join_plan is not None and node in job.join_plan_nodes:
        job = note(job, ctx.now, f"join dropped: node {node!r} went offline before the checkpoint",
                   join_plan=None)
    return job


def _on_profiled(job: Job, ev: Profiled, ctx: Ctx) -> Job:
    job = replace(job, join_requests=tuple(r for r in job.join_requests if r[1] != ev.node_id))
    error = ev.error if ev.report is None else profile_mismatch(job, ev.report)
    if ev.report is None or error is not None:
        return _not_taken(job, ctx, f"node {ev.node_id!r} not taken: could not profile: {error}")
    job = profile_warnings(job, ctx.now, ev.warnings)
    return _consider(replace(job, profiles={**job.profiles, ev.node_id: ev.report}), ctx)


def _not_taken(job: Job, ctx: Ctx, why: str) -> Job:
    if job.join_plan is not None:
        why += f"; the join of {_who(job.join_newcomers)} taken before stands"
    return note(job, ctx.now, why, last_replan_reason=short(why, MAX_REASON_CHARS))


def _consider(job: Job, ctx: Ctx) -> Job:
    """Plan with every profiled newcomer; take the join if it pays (module docstring, step 2)."""
    assert job.plan is not None
    joiners = tuple(n for n in _newcomers(job, ctx) if n in job.profiles)
    if not joiners:
        return job
    who, nodes, version = _who(joiners), job.plan_nodes, job.plan_version + 1
    every = job.spec.checkpoint_interval
    at = (max(job.step, job.checkpoint_step) // every + 1) * every  # the owner's next checkpoint
    if at >= job.total_steps:
        return _not_taken(job, ctx, f"{who} not taken: no checkpoint left to restart from before the job's "
                          f"end (the next would be at step {at} of {job.total_steps}; checkpoint_interval {every})")
    try:
        new = plan_of(ctx.planner(job, nodes + joiners, version, ctx))
    except (ValueError, ArithmeticError) as exc:  # InfeasiblePlan is a ValueError
        return _not_taken(job, ctx, f"{who} not taken: no plan with it: {exc}")
    try:
        old_s = plan_of(ctx.planner(job, nodes, version, ctx)).predicted_iteration_s
    except (ValueError, ArithmeticError):  # e.g. less memory now: the plan's own prediction
        old_s = job.plan.predicted_iteration_s
    new_s = new.predicted_iteration_s
    gain = (old_s - new_s) / old_s if old_s > 0 else 0.0
    measured = _iteration_s(job) or old_s
    left = job.total_steps - at
    saved = gain * measured * left
    restart, source = _restart_cost(job, ctx)
    restart += measured  # the iteration(s) past the checkpoint, redone
    faster = f"{gain:.1%} faster" if gain >= 0 else f"{-gain:.1%} slower"
    head = f"{who} not taken: predicted {old_s:.3g} -> {new_s:.3g} s/iteration ({faster})"
    if gain <= ctx.join.min_gain:
        return _not_taken(job, ctx, f"{head}: the bar is {ctx.join.min_gain:.0%} faster")
    if saved <= restart:
        return _not_taken(job, ctx, f"{head} would save ~{saved:.1f} s over the {left} steps after the "
                          f"checkpoint at step {at}, not a restart's ~{restart:.1f} s ({source})")
    why = (f"{who} taken for plan v{version} at the checkpoint of step {at}: predicted {old_s:.3g} -> "
           f"{new_s:.3g} s/iteration ({faster}), ~{saved:.1f} s saved over {left} steps against a "
           f"restart's ~{restart:.1f} s ({source})")
    return note(job, ctx.now, why, join_plan=new, join_after=job.checkpoint_step, join_base_s=old_s,
                last_replan_reason=short(why, MAX_REASON_CHARS))


def _iteration_s(job: Job) -> float | None:
    """The job's measured seconds per iteration under its plan (the slowest rank's mean)."""
    means = [a.iteration_s / a.n for a in job.agg.values() if a.n]
    return max(means) if means else job.last_iteration_s


def _restart_cost(job: Job, ctx: Ctx) -> tuple[float, str]:
    if ctx.join.restart_s is not None:
        return ctx.join.restart_s, "the gateway's join_restart_s"
    if job.restart_s is not None:
        return job.restart_s, "measured: assignment to first metrics"
    return ctx.join.default_restart_s, "a default: not measured"


def _join(job: Job, ctx: Ctx, assign: Assigner) -> Out:
    """The owner's checkpoint is in: cancel the plan, assign the join's plan from that step."""
    new = job.join_plan
    assert new is not None
    gone = [n for n in job.join_plan_nodes if n not in ctx.online]
    # A newcomer that went offline was dropped on NodeDown; one switched off Participate meanwhile is here.
    if new.version != job.plan_version + 1 or gone:
        why = f"{_who(tuple(gone))} offline or not participating" if gone else "plan superseded"
        return note(job, ctx.now, f"join dropped at the checkpoint: {why}", join_plan=None), []
    old = job.plan_version
    why = short(f"{_who(job.join_newcomers)} joins: plan v{old} -> v{new.version}, predicted "
                f"{job.join_base_s:.3g} -> {new.predicted_iteration_s:.3g} s/iteration", MAX_REASON_CHARS)
    cancel = Control(job.job_id, old, job.plan_nodes, "cancel")
    job = note(job, ctx.now, f"{why}; resuming from step {job.checkpoint_step}", join_plan=None,
               join_requests=(), pending_plan=None, last_reshard_step=None, replans=job.replans + 1,
               last_replan_reason=why)
    job, more = assign(job, ctx, new)
    return job, [cancel, *more]
