"""The job state machine's live re-shard transitions (issue 14): pure, like `machine`, which
dispatches to them. The policy's word (`Rebalanced`, from `rebalancers`) becomes an order to the
owner (`Reshard`) with the plan it makes kept as `Job.pending_plan`, or the reason the plan is
kept; the owner's status then makes that plan the job's (the ranks moved) or drops it (the owner
refused the order). A data-parallel plan's word is a re-split (new `Plan.shares`, the layout kept),
ordered, pending and applied the same way. The owner also reports its overlap trial's outcome
(`Plan.trial`): the mode kept, and, where that mode has a layout of its own, a re-shard of the
ranks' own that arrives as any applied re-shard does."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from xronos.protocol import messages as m
from xronos.protocol.layout import Layout

from .history import note, short
from .types import Ctx, Job, Out, Rebalanced, Reshard

MAX_REASON_CHARS = 256  # JobState.last_replan_reason, Home Assistant's text state


def _ordered(job: Job) -> m.Plan | None:
    """The plan the ranks run or have been ordered to: a re-shard not yet applied, else the plan."""
    if job.pending_plan is not None and job.pending_plan.version == job.plan_version:
        return job.pending_plan
    return job.plan


def on_rebalanced(job: Job, ev: Rebalanced, ctx: Ctx) -> Out:
    """The re-balancing policy's decision: order the owner to re-shard (the plan takes the new
    counts when the owner says the ranks moved: `owner_reshard_status`), or tell why the plan is kept."""
    plan = _ordered(job)
    if ev.plan_version != job.plan_version or plan is None or job.phase not in ("running", "paused") \
            or ev.old != plan.layout():
        return job, []
    reason = short(ev.reason, MAX_REASON_CHARS)
    if ev.layout is None:
        if reason == job.last_replan_reason:
            return job, []
        # The event history hears of a re-plan refused by the memory caps (once in a row of them);
        # the policy's every other word only updates the reason the state shows.
        if "memory cap" in ev.reason and "memory cap" not in (job.last_replan_reason or ""):
            return note(job, ctx.now, f"plan kept: {ev.reason}", last_replan_reason=reason), []
        return replace(job, last_replan_reason=reason, updated_at=ctx.now), []
    if job.total_steps and ev.at_step >= job.total_steps:  # no boundary left to move at
        why = f"not ordered: the job ends before step {ev.at_step}; {ev.reason}"
        return replace(job, last_replan_reason=short(why, MAX_REASON_CHARS), updated_at=ctx.now), []
    if plan.shares is not None or ev.shares is not None:
        return _resplit(job, plan, ev, ctx, reason)
    try:
        ev.layout.check(plan.sizes, world_size=len(plan.entries), quanta=None)
    except ValueError as exc:  # never from the policy: it plans over the same sizes
        return note(job, ctx.now, f"re-plan refused: {exc}"), []
    kept = _over_caps(job, plan, ev, "re-plan", ctx)
    if kept is not None:
        return kept
    entries = [e.model_copy(update={
        "attn": ev.layout.attn[e.rank], "mlp": ev.layout.mlp[e.rank], "vocab": ev.layout.vocab[e.rank],
        **({"predicted_compute_s": ev.predicted_compute_s[e.rank]} if ev.predicted_compute_s else {}),
        **({"predicted_memory": ev.predicted_memory[e.rank]} if ev.predicted_memory else {}),
    }) for e in plan.entries]
    update: dict[str, Any] = {"entries": entries}
    if ev.predicted_bottleneck_s:
        update["predicted_iteration_s"] = ev.predicted_bottleneck_s + plan.comm_s
    pending = m.Plan.model_validate({**plan.model_dump(), **update})
    job = note(job, ctx.now, f"re-plan for step {ev.at_step}: {ev.old.to_text()} -> {ev.layout.to_text()}; "
               f"{ev.reason}", pending_plan=pending, replans=job.replans + 1, last_replan_reason=reason)
    return job, [Reshard(job.job_id, job.plan_version, job.rank0 or job.owner, ev.at_step, ev.layout, reason)]


def _over_caps(job: Job, plan: m.Plan, ev: Rebalanced, what: str, ctx: Ctx) -> Out | None:
    """The plan kept when the decision's predicted memory puts a node over its cap (the policy
    checks the caps too; an order past them is never sent); None when it fits."""
    over = [(e.node_id, mem, e.memory_cap) for e, mem in zip(plan.entries, ev.predicted_memory)
            if mem > e.memory_cap]
    if not over:
        return None
    node, mem, cap = over[0]
    why = short(f"{what} not applied, plan kept: node {node!r} would need {mem / 2**20:.0f} MiB, over its "
                f"cap of {cap / 2**20:.0f} MiB (memory cap)", MAX_REASON_CHARS)
    if why == job.last_replan_reason:
        return job, []
    return note(job, ctx.now, why, last_replan_reason=why), []


def _resplit(job: Job, plan: m.Plan, ev: Rebalanced, ctx: Ctx, reason: str) -> Out:
    """A data-parallel plan's re-split: the owner is ordered the new rows per group (the plan's
    layout kept); the plan it makes waits as `pending_plan` until the owner says the ranks took it."""
    if plan.shares is None or ev.shares is None or ev.layout != plan.layout() \
            or (ev.old_shares is not None and tuple(ev.old_shares) != tuple(plan.shares)):
        return job, []  # a decision of another kind or for another split (stale): nothing to order
    try:
        pending = m.Plan.model_validate({**plan.model_dump(), "shares": list(ev.shares), "entries": [
            e.model_copy(update={
                **({"predicted_compute_s": ev.predicted_compute_s[e.rank]} if ev.predicted_compute_s else {}),
                **({"predicted_memory": ev.predicted_memory[e.rank]} if ev.predicted_memory else {})})
            for e in plan.entries],
            **({"predicted_iteration_s": ev.predicted_bottleneck_s + plan.comm_s} if ev.predicted_bottleneck_s else {})})
        batch = job.spec.recipe.batch_size
        if sum(ev.shares) != batch:
            raise ValueError(f"shares {list(ev.shares)} sum to {sum(ev.shares)} rows, the batch has {batch}")
    except ValueError as exc:  # never from the policy: it splits the same batch over the same groups
        return note(job, ctx.now, f"re-split refused: {exc}"), []
    kept = _over_caps(job, plan, ev, "re-split", ctx)
    if kept is not None:
        return kept
    job = note(job, ctx.now, f"re-split for step {ev.at_step}: rows per group {list(plan.shares)} -> "
               f"{list(ev.shares)}; {ev.reason}", pending_plan=pending, replans=job.replans + 1,
               last_replan_reason=reason)
    return job, [Reshard(job.job_id, job.plan_version, job.rank0 or job.owner, ev.at_step, plan.layout(), reason,
                         tuple(ev.shares))]


def owner_reshard_status(job: Job, ctx: Ctx, s: m.NodeJobStatus) -> Job:
    """The owner's status (already checked to be the owner's, for the current plan) on re-shards:
    the ranks moved to a new layout (or a data-parallel plan's to new shares), or the owner refused
    an order. Anything else: the job as is."""
    if s.reshard_step is not None and s.reshard_step != job.last_reshard_step \
            and s.reshard_layout is not None and job.plan is not None:
        plan = job.plan
        if plan.shares is not None:
            if s.reshard_shares is not None and s.reshard_layout == plan.layout() \
                    and len(s.reshard_shares) == len(plan.shares) and sum(s.reshard_shares) == sum(plan.shares):
                job = _resplit_applied(job, ctx, s)
        elif s.reshard_layout.world_size == len(plan.entries) and s.reshard_shares is None:
            try:
                s.reshard_layout.check(plan.sizes, quanta=None)
            except ValueError:
                pass  # not a layout of this model: nothing the owner moved to
            else:
                job = _resharded(job, ctx, s)
    if s.reshard_refused is not None and s.reshard_refused != job.reshard_refused:
        job = _refused_reshard(job, ctx, s.reshard_refused)
    return job


def _moved_plan(plan: m.Plan, layout: Layout, kept: str | None) -> m.Plan:
    """`plan` with the ranks on `layout`, a move nobody ordered (an overlap trial's, to its kept
    mode's own layout): each entry's counts, with the compute and memory the trial's forecast
    predicted there and the mode's predicted iteration (`kept`: the mode the trial kept, when its
    outcome came first; two modes may have planned the same layout)."""
    trial = plan.trial
    forecast = None
    for i in range(len(trial.modes) if trial is not None and trial.forecasts is not None else 0):
        if trial.layout_for(i) == layout and (forecast is None or m.overlap_label(trial.modes[i]) == kept):
            forecast = trial.forecasts[i]
    entries = []
    for e in plan.entries:
        update = {"attn": layout.attn[e.rank], "mlp": layout.mlp[e.rank], "vocab": layout.vocab[e.rank]}
        if forecast is not None and forecast.compute_s is not None:
            update["predicted_compute_s"] = forecast.compute_s[e.rank]
        if forecast is not None and forecast.memory is not None:
            update["predicted_memory"] = forecast.memory[e.rank]
        entries.append(e.model_copy(update=update))
    extra = _forecast_figures(forecast)
    return m.Plan.model_validate({**plan.model_dump(), "entries": entries, **extra})


def _forecast_figures(forecast: m.ModeForecast | None) -> dict[str, float]:
    """The plan's fields a mode's forecast sets: its predicted iteration and communication."""
    if forecast is None:
        return {}
    return {"predicted_iteration_s": forecast.iteration_s,
            **({"comm_s": forecast.comm_s} if forecast.comm_s is not None else {})}


def owner_trial_status(job: Job, ctx: Ctx, s: m.NodeJobStatus) -> Job:
    """The owner's status (already checked to be the owner's) on the plan's overlap trial: one
    event per plan version and step with each mode's median and the mode kept, and the plan's
    predicted iteration made the kept mode's (`OverlapTrial.forecasts`: what the job runs from
    then on is set against its own prediction); else the job as is."""
    if s.trial_kept is None or s.trial_step is None or job.trial_kept == (s.plan_version, s.trial_step, s.trial_kept):
        return job
    each = ", ".join(f"{k} {v:.4f} s" for k, v in (s.trial_seconds or {}).items())
    changes = {}
    forecast = job.plan.trial.forecast(s.trial_kept) if job.plan is not None and job.plan.trial is not None else None
    predicted = ""
    if forecast is not None and job.plan is not None:
        changes["plan"] = m.Plan.model_validate({**job.plan.model_dump(), **_forecast_figures(forecast)})
        predicted = f" (predicted {forecast.iteration_s:.4f} s)"
    return note(job, ctx.now, f"overlap trial ({job.clock or 'wall'} clock, median iteration): {each}; "
                f"kept {s.trial_kept}{predicted} from step {s.trial_step}",
                trial_kept=(s.plan_version, s.trial_step, s.trial_kept), **changes)


def _refused_reshard(job: Job, ctx: Ctx, why: str) -> Job:
    """The owner refused a re-shard order: it is not pending any more; the job goes on under its plan."""
    job = replace(job, reshard_refused=why)
    if job.pending_plan is None:
        return job
    reason = short(f"re-shard refused by the ranks, plan kept: {why}", MAX_REASON_CHARS)
    return note(job, ctx.now, reason, pending_plan=None, last_replan_reason=reason)


def _resplit_applied(job: Job, ctx: Ctx, s: m.NodeJobStatus) -> Job:
    """The owner says every rank trains `s.reshard_shares` rows per group from `s.reshard_step` on:
    the plan's shares are those (the ordered plan's predictions with them), the measured sums restart."""
    assert s.reshard_shares is not None and job.plan is not None
    pending = _ordered(job)
    if pending is not None and pending.shares == s.reshard_shares:
        plan = pending
    else:  # not the ordered split (never from our owner): its shares, the plan's predictions
        plan = m.Plan.model_validate({**job.plan.model_dump(), "shares": list(s.reshard_shares)})
    return note(job, ctx.now, f"re-split applied at step {s.reshard_step}: rows per group {list(s.reshard_shares)}",
                plan=plan, pending_plan=None, agg={}, peak_rss={}, last_reshard_step=s.reshard_step)


def _resharded(job: Job, ctx: Ctx, s: m.NodeJobStatus) -> Job:
    """The owner says every rank moved to `s.reshard_layout` before step `s.reshard_step`: the plan
    is now that layout's (the ordered plan's predictions with it), and the measured sums restart."""
    assert s.reshard_layout is not None and job.plan is not None
    layout, pending = s.reshard_layout, _ordered(job)
    if pending is not None and pending.layout() == layout:
        plan = pending
    else:  # not the ordered layout (an overlap trial's own move, Plan.trial): its counts, and the
        # planner's predictions for it where the trial gave them (else the plan's)
        kept = job.trial_kept[2] if job.trial_kept is not None and job.trial_kept[0] == job.plan_version else None
        plan = _moved_plan(job.plan, layout, kept)
    took = f" ({s.reshard_s:.2f} s at the boundary)" if s.reshard_s is not None else ""
    return note(job, ctx.now, f"re-shard applied at step {s.reshard_step}: {layout.to_text()}{took}",
                plan=plan, pending_plan=None, agg={}, peak_rss={}, last_reshard_step=s.reshard_step)
