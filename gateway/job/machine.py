"""The job state machine: pure functions over typed data (`types`), no I/O, no clock.

`handle(job, event, ctx) -> (job, effects)`: an event (a node answered, a node dropped, a metric
arrived, a person asked to pause, time passed) turns one job record into a new one plus a list of
effects the service carries out (publish an inspection or profile request, assign, send a
control, answer a request). Planning is part of the core: once every profile is in, the
transition itself calls `ctx.planner` (the cost model and planner, pure) and goes on to assign or
refuse. Every timeout is a deadline checked on `Tick`, so tests drive time by hand.

Phases: queued → profiling → planning → assigning → running ⇄ paused → completed|failed|cancelled,
and recovering (a node dropped or a rank failed: cancel the survivors, re-plan on who is online,
resume from the owner's last checkpoint). Submit-time checks (owner online, owner's inspection,
every profile, a feasible plan) all run before the job is *accepted*; a failure there refuses the
submit request with the reason instead of failing half-way. Metrics aggregation is in `progress`.

Nodes speak only for themselves: an answer counts only if it carries the request id the job sent
to that node; a status or metric only if its rank is the node's rank in the current plan; and
completion, checkpoints, evaluations and the export only from rank 0 (the owner).
`abort(job, ctx, reason)` fails a job whose transition raised unexpectedly (the service's guard);
what the table keeps of finished jobs (`prune`, `finished`) is `retention`'s. The live re-shard transitions (the policy's
`Rebalanced`, the owner's word on a re-shard) are in `reshard`; a node that joins a running job
(taken into its next plan at a checkpoint) in `join`; the event history in `history`.
"""

from __future__ import annotations

from dataclasses import replace

from xronos.protocol import messages as m

from .history import MAX_EVENT_CHARS, MAX_EVENTS, note, profile_warnings, short
from .join import after as join_after
from .join import rejoin
from .planning import plan_text
from .progress import apply_metrics
from .reshard import on_rebalanced, owner_reshard_status, owner_trial_status
from .retention import finished, prune
from .types import (
    ACTIVE, TERMINAL, Acked, Agg, Assign, Command, Control, Ctx, Effect, Event, Inspect, Inspected, Job, JoinPolicy,
    Metrics, Net, NodeDown, NodeUp, Out, Planned, Profile, Profiled, Rebalanced, Reshard, Respond, Status, Tick,
    Timeouts, plan_of, profile_mismatch,
)

__all__ = ["ACTIVE", "TERMINAL", "Acked", "Agg", "Assign", "Command", "Control", "Ctx", "Effect", "Event",
           "Inspect", "Inspected", "Job", "JoinPolicy", "Metrics", "Net", "NodeDown", "NodeUp", "Out", "Profile",
           "Profiled", "Rebalanced", "Reshard", "Respond", "Status", "Tick", "Timeouts", "abort", "handle", "new_job",
           "occupies", "finished",
           "prune", "restart", "schedule", "MAX_ERROR_CHARS", "MAX_EVENT_CHARS", "MAX_EVENTS"]

MAX_ERROR_CHARS = 1000  # the event history's bounds (MAX_EVENTS, MAX_EVENT_CHARS) are `history`'s


def _few(names: list[str] | tuple[str, ...], n: int = 5) -> str:
    """A list of node names for a message: the first few, and how many more."""
    more = f" (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _request_ids(job: Job, nodes: tuple[str, ...]) -> tuple[Job, tuple[tuple[str, str], ...]]:
    """Fresh request ids for these nodes ("<job id>.<seq>"); earlier rounds' answers stop counting."""
    reqs = tuple((f"{job.job_id}.{job.request_seq + i + 1}", n) for i, n in enumerate(nodes))
    return replace(job, requests=reqs, request_seq=job.request_seq + len(nodes)), reqs


def occupies(job: Job) -> bool:
    """Holds (or is about to hold) the nodes: no other job may start meanwhile."""
    return job.phase in ACTIVE or (job.phase == "planning" and job.accepted)


# --- creation --------------------------------------------------------------------------------
def new_job(job_id: str, spec: m.JobSpec, transaction: str | None, ctx: Ctx,
            respond_to: str = "job/submit") -> Out:
    job = note(Job(job_id, spec, ctx.now, respond_to=respond_to, transaction=transaction),
                ctx.now, f"submitted (owner {spec.owner})")
    named = spec.nodes
    if spec.owner not in ctx.online:
        return _refuse(job, ctx, f"owner node {spec.owner!r} is offline or not participating")
    if named is not None:
        twice = sorted({n for n in named if named.count(n) > 1})
        if twice:  # refused here, not by JobSpec: a stored job table from before still loads
            return _refuse(job, ctx, f"nodes: {_few(twice)} named more than once")
        if spec.owner not in named:
            return _refuse(job, ctx, f"nodes: the owner {spec.owner!r} must be one of {_few(named)}")
        missing = sorted(set(named) - ctx.online)
        if missing:
            return _refuse(job, ctx, f"nodes: {_few(missing)} offline or not participating")
    return _inspect(job, ctx)


def _inspect(job: Job, ctx: Ctx) -> Out:
    job, ((rid, _),) = _request_ids(job, (job.owner,))
    job = replace(job, awaiting="inspect", waiting=(job.owner,), deadline=ctx.now + ctx.timeouts.inspect_s)
    return job, [Inspect(job.job_id, job.owner, rid)]


def refused(job: Job) -> bool:
    """Refused at submit time: never accepted, never ran (the service does not keep these)."""
    return job.phase == "failed" and not job.accepted


def _refuse(job: Job, ctx: Ctx, reason: str) -> Out:
    """Submit-time refusal: the request is answered with the reason; nothing ran."""
    reason = short(reason, MAX_ERROR_CHARS)
    respond = Respond(job.respond_to, job.transaction, False, {"job_id": job.job_id}, reason)
    job = note(job, ctx.now, f"refused: {reason}", phase="failed", error=reason, transaction=None,
                awaiting="", waiting=(), requests=(), deadline=None)
    return job, [respond]


def _fail(job: Job, ctx: Ctx, reason: str) -> Out:
    reason = short(reason, MAX_ERROR_CHARS)
    effects: list[Effect] = []
    if job.plan and job.phase in ACTIVE:
        effects.append(Control(job.job_id, job.plan_version, job.plan_nodes, "cancel"))
    job = note(job, ctx.now, f"failed: {reason}", phase="failed", error=reason, awaiting="",
                waiting=(), requests=(), deadline=None, recover_deadline=None)
    return job, effects


def abort(job: Job, ctx: Ctx, reason: str) -> Out:
    """Fail this one job after an unexpected error in its own handling (the service's guard):
    answer a request still waiting, stop its ranks, keep the reason short."""
    if job.phase in TERMINAL:
        return job, []
    if not job.accepted:
        return _refuse(job, ctx, reason)
    return _fail(job, ctx, reason)


def _candidates(job: Job, ctx: Ctx) -> tuple[str, ...]:
    """Nodes a plan may use now: the named ones (or every online one), online, owner first."""
    pool = dict.fromkeys(job.spec.nodes or sorted(ctx.online))  # each once, in order
    usable = [n for n in pool if n in ctx.online and n not in job.excluded and n != job.owner]
    return ((job.owner,) if job.owner in ctx.online else ()) + tuple(usable)


def _plan_or_profile(job: Job, ctx: Ctx, nodes: tuple[str, ...]) -> Out:
    """Ask the nodes without a profile for one; once every node has one, plan."""
    missing = tuple(n for n in nodes if n not in job.profiles)
    if missing:
        phase = "recovering" if job.phase == "recovering" else "profiling"
        job, reqs = _request_ids(job, missing)
        job = replace(job, phase=phase, awaiting="profiles", waiting=missing, offline_since={},
                      deadline=ctx.now + ctx.timeouts.profile_s, updated_at=ctx.now)
        return job, [Profile(job.job_id, reqs)]
    if not nodes:
        return _no_plan(job, ctx, "no node is online to run it")
    phase = "recovering" if job.phase == "recovering" else "planning"
    job = replace(job, phase=phase, awaiting="", waiting=(), requests=(), deadline=None, updated_at=ctx.now)
    version = job.plan_version + 1
    try:
        planned = ctx.planner(job, nodes, version, ctx)
    except (ValueError, ArithmeticError) as exc:  # InfeasiblePlan is a ValueError
        return _no_plan(job, ctx, f"plan cannot fit: {exc}")
    return _planned(job, ctx, planned)


def _no_plan(job: Job, ctx: Ctx, reason: str) -> Out:
    if not job.accepted:
        return _refuse(job, ctx, reason)
    if job.phase == "recovering":  # wait for a node to come back, until the recovery deadline
        return note(job, ctx.now, f"cannot re-plan yet: {reason}", awaiting="retry", waiting=(),
                     deadline=ctx.now + ctx.timeouts.retry_s), []
    return _fail(job, ctx, reason)


def _assign(job: Job, ctx: Ctx, plan: m.Plan, why: str = "") -> Out:
    nodes = tuple(e.node_id for e in plan.entries)
    job = note(job, ctx.now, f"plan v{plan.version} ({why or plan.strategy}): {plan_text(plan)}; "
                f"resume from step {job.checkpoint_step}",
                phase="assigning", plan=plan, plan_version=plan.version, awaiting="acks",
                waiting=nodes, deadline=ctx.now + ctx.timeouts.ack_s, agg={}, peak_rss={},
                resume_step=job.checkpoint_step, step=job.checkpoint_step)
    return job, [Assign(job.job_id, plan, job.checkpoint_step)]


def _recover(job: Job, ctx: Ctx, reason: str, known_cause: bool = False) -> Out:
    """A node or rank of the running plan is gone: stop the survivors, re-plan, resume.

    Unless the lost node is known (its last-will arrived), re-planning waits `regroup_s`: a rank
    that failed usually failed because a peer died, and that peer's last-will may still be on
    its way; planning it in again would only cost an ack timeout."""
    if job.recoveries >= ctx.timeouts.max_recoveries:
        return _fail(job, ctx, f"{reason}; gave up after {job.recoveries} recoveries")
    effects: list[Effect] = [Control(job.job_id, job.plan_version, job.plan_nodes, "cancel")]
    job = note(job, ctx.now, f"recovering: {reason}; resuming from step {job.checkpoint_step}",
                phase="recovering", recoveries=job.recoveries + 1, error=None, pending_plan=None,
                last_reshard_step=None,
                recover_deadline=ctx.now + ctx.timeouts.recover_s)
    if not known_cause:
        return replace(job, awaiting="retry", waiting=(), deadline=ctx.now + ctx.timeouts.regroup_s), effects
    job, more = _replan(job, ctx)
    return job, effects + more


def _replan(job: Job, ctx: Ctx) -> Out:
    if job.owner not in ctx.online:  # the owner holds the data and the checkpoint
        return note(job, ctx.now, f"waiting for the owner {job.owner!r} to come back",
                     awaiting="retry", waiting=(), deadline=ctx.now + ctx.timeouts.retry_s), []
    return _plan_or_profile(job, ctx, _candidates(job, ctx))


def _start(job: Job, ctx: Ctx) -> Out:
    nodes = job.plan_nodes
    effects: list[Effect] = [Control(job.job_id, job.plan_version, nodes, "start")]
    phase = "running"
    if job.want_paused:
        effects.append(Control(job.job_id, job.plan_version, nodes, "pause"))
        phase = "paused"
    job = note(job, ctx.now, f"started plan v{job.plan_version} on {len(nodes)} node{'s' * (len(nodes) != 1)}", phase=phase,
                awaiting="", waiting=(), deadline=ctx.now + ctx.timeouts.stall_s, recover_deadline=None)
    return job, effects


# --- the transition function -----------------------------------------------------------------
def handle(job: Job, event: Event, ctx: Ctx) -> Out:
    if job.phase in TERMINAL:
        if isinstance(event, Command):
            return job, [Respond(f"job/{event.action}", event.transaction, False, None,
                                 f"job {job.job_id} is already {job.phase}")]
        return job, []
    handler = _HANDLERS[type(event)]
    return join_after(event, handler(job, event, ctx), ctx, _assign)  # a node that joins: `join`


def _answers(job: Job, request_id: str, node_id: str) -> bool:
    """Is this the answer to a request the job sent to this very node?"""
    return (request_id, node_id) in job.requests


def _on_inspected(job: Job, ev: Inspected, ctx: Ctx) -> Out:
    r = ev.report
    if job.awaiting != "inspect" or r.node_id != job.owner or not _answers(job, r.request_id, r.node_id):
        return job, []
    if not r.ok:
        return _refuse(job, ctx, f"owner {job.owner!r} cannot run it: {r.error}")
    if r.arch is None or r.total_steps is None:
        return _refuse(job, ctx, f"owner {job.owner!r} answered ok without arch and total_steps")
    job = note(job, ctx.now, f"owner checked model and data: {r.arch.family} with "
                f"{r.arch.num_kv_heads} attention units, {r.arch.intermediate_size} MLP columns, "
                f"{r.arch.vocab_size} vocabulary rows; {r.total_steps} steps", arch=r.arch,
                units_total=r.arch.num_kv_heads, total_steps=r.total_steps, requests=())
    return _plan_or_profile(job, ctx, _candidates(job, ctx))


def _on_profiled(job: Job, ev: Profiled, ctx: Ctx) -> Out:
    if job.awaiting != "profiles" or ev.node_id not in job.waiting or not _answers(job, ev.request_id, ev.node_id):
        return job, []
    waiting = tuple(n for n in job.waiting if n != ev.node_id)
    requests = tuple(r for r in job.requests if r[1] != ev.node_id)
    job = replace(job, offline_since={n: t for n, t in job.offline_since.items() if n != ev.node_id})
    error = ev.error if ev.report is None else profile_mismatch(job, ev.report)
    if ev.report is not None and error is None:
        job = replace(job, profiles={**job.profiles, ev.node_id: ev.report}, waiting=waiting, requests=requests)
        job = profile_warnings(job, ctx.now, ev.warnings)
    else:
        job, out = _drop_node(job, ctx, ev.node_id, f"could not profile: {error}")
        if out is not None:
            return out
        job = replace(job, waiting=waiting, requests=requests)
    if waiting:
        return job, []
    return _plan_or_profile(job, ctx, tuple(n for n in _candidates(job, ctx) if n in job.profiles))


def _drop_node(job: Job, ctx: Ctx, node: str, why: str) -> tuple[Job, Out | None]:
    """A candidate is unusable. Fatal when it was named or is the owner (before acceptance)."""
    named = job.spec.nodes or ()
    if not job.accepted and (node == job.owner or node in named):
        return job, _refuse(job, ctx, f"node {node!r} {why}")
    if node == job.owner:
        return job, _replan(note(job, ctx.now, f"owner {why}"), ctx)
    return note(job, ctx.now, f"leaving out {node!r}: it {why}", excluded=job.excluded + (node,)), None


def _planned(job: Job, ctx: Ctx, planned: m.Plan | Planned) -> Out:
    plan, why = plan_of(planned), planned.note if isinstance(planned, Planned) else ""
    chosen = {"candidates": list(planned.candidates), "chosen": why} if isinstance(planned, Planned) else {}
    if job.respond_to == "plan/preview":
        respond = Respond("plan/preview", job.transaction, True, {"plan": plan, **chosen})
        return note(job, ctx.now, "plan preview answered", phase="completed", plan=plan,
                     awaiting="", transaction=None), [respond]
    effects: list[Effect] = []
    if not job.accepted:
        effects.append(Respond("job/submit", job.transaction, True,
                               {"job_id": job.job_id, "plan": plan, "total_steps": job.total_steps, **chosen}))
        job = note(job, ctx.now, "accepted", accepted=True, transaction=None)
        if ctx.busy:  # the plan proved it fits; it is redone when the nodes are free
            return replace(job, phase="queued", awaiting="", waiting=(), plan=plan), effects
    job, more = _assign(job, ctx, plan, why)
    return job, effects + more


def _on_acked(job: Job, ev: Acked, ctx: Ctx) -> Out:
    if job.awaiting != "acks" or ev.plan_version != job.plan_version or ev.node_id not in job.waiting:
        return job, []
    if not ev.accepted:
        job = replace(job, excluded=job.excluded + (ev.node_id,))
        return _recover(job, ctx, f"node {ev.node_id!r} refused its assignment: {ev.reason}", known_cause=True)
    job = replace(job, waiting=tuple(n for n in job.waiting if n != ev.node_id))
    return _start(job, ctx) if not job.waiting else (job, [])


def _on_down(job: Job, ev: NodeDown, ctx: Ctx) -> Out:
    node = ev.node_id
    if job.awaiting in ("inspect", "profiles") and node in job.waiting:
        if job.awaiting == "inspect":
            return _refuse(job, ctx, f"owner {node!r} went offline")
        if node in job.offline_since:
            return job, []
        # Its profiling goes on without the broker, and the report comes once it is back: wait a while.
        return note(job, ctx.now, f"node {node!r} went offline while profiling: its profile is awaited "
                    f"{ctx.timeouts.profile_offline_s:.0f} s more",
                    offline_since={**job.offline_since, node: ctx.now}), []
    if job.phase in ("assigning", "running", "paused") and node in job.plan_nodes:
        return _recover(job, ctx, f"node {node!r} went offline", known_cause=True)
    if job.phase == "recovering" and node in job.plan_nodes and job.awaiting == "retry":
        # A survivor's broken connection came first (its rank failed when this node's died): the
        # events name the cause, and the re-plan need not wait for it any longer.
        return _replan(note(job, ctx.now, f"node {node!r} went offline (what the rank's failure followed)"), ctx)
    return job, []


def _on_up(job: Job, ev: NodeUp, ctx: Ctx) -> Out:
    out: list = []
    if ev.node_id in job.offline_since:
        # Back while profiling. After a broker blip its profiling went on and the report is queued;
        # after a service restart the request is gone. Asking again with the same request id is
        # safe either way: a node still profiling it ignores the duplicate, one that finished
        # answers from its profile cache, a restarted one profiles anew (its first answer counts).
        job = note(job, ctx.now, f"node {ev.node_id!r} is back; its profile is asked for again",
                   offline_since={n: t for n, t in job.offline_since.items() if n != ev.node_id})
        again = tuple(r for r in job.requests if r[1] == ev.node_id)
        if job.awaiting == "profiles" and ev.node_id in job.waiting and again:
            out.append(Profile(job.job_id, again))
    if ev.node_id in job.excluded:
        job = replace(job, excluded=tuple(n for n in job.excluded if n != ev.node_id))
    if job.phase == "recovering" and job.awaiting == "retry":
        return _replan(note(job, ctx.now, f"node {ev.node_id!r} is back"), ctx)
    return job, out


def _on_status(job: Job, ev: Status, ctx: Ctx) -> Out:
    s = ev.s
    # A node speaks only for its own rank of the current plan.
    if s.plan_version != job.plan_version or job.rank_of(s.node_id) != s.rank:
        return job, []
    is_owner = s.rank == 0 and s.node_id == job.rank0 == job.owner
    if is_owner and s.checkpoint_step and s.checkpoint_step > job.checkpoint_step:
        if s.checkpoint_step > max(job.total_steps, job.step, 1):
            return job, []  # a checkpoint beyond the job's end is no resume point
        if job.events and " checkpoint at step " in job.events[-1]:  # one line for a run of them
            job = replace(job, events=job.events[:-1])
        job = note(job, ctx.now, f"checkpoint at step {s.checkpoint_step}", checkpoint_step=s.checkpoint_step)
    if is_owner and s.eval_initial is not None and job.eval_initial is None:
        job = note(job, ctx.now, f"before training: {s.eval_metric_name} {s.eval_initial:.4f}",
                    eval_initial=s.eval_initial, eval_metric_name=s.eval_metric_name)
    if is_owner and s.eval_metric is not None:
        job = replace(job, eval_metric=s.eval_metric, eval_metric_name=s.eval_metric_name)
    if is_owner:
        job = owner_trial_status(owner_reshard_status(job, ctx, s), ctx, s)
    if s.status == "failed" and s.job_fault and job.phase in ACTIVE:
        # Not a node's failure: any plan would meet it again from the same checkpoint (and in
        # "recovering" too: a peer's broken connection may have arrived before the cause).
        return _fail(job, ctx, f"rank {s.rank} on {s.node_id!r}: {s.detail}")
    if s.status == "failed" and job.phase in ("assigning", "running", "paused"):
        return _recover(job, ctx, f"rank {s.rank} on {s.node_id!r} failed: {s.detail}")
    # "recovering" too: the owner may finish just as a peer's last-will arrives.
    if s.status == "completed" and is_owner and job.phase in ("running", "paused", "recovering"):
        return _complete(job, ctx, s), []
    return job, []


def _complete(job: Job, ctx: Ctx, s: m.NodeJobStatus) -> Job:
    export = s.export_dir or job.spec.recipe.export_dir  # the owner's resolved path of the spec's export_dir
    step = min(s.step, job.total_steps) if job.total_steps else s.step
    return note(job, ctx.now, f"completed at step {step}; model exported to {export}",
                 phase="completed", step=step, epoch=s.epoch, export_dir=export,
                 awaiting="", deadline=None)


def _on_command(job: Job, ev: Command, ctx: Ctx) -> Out:
    name = f"job/{ev.action}"

    def ok(j: Job, *effects: Effect) -> Out:
        return j, [*effects, Respond(name, ev.transaction, True, {"job_id": j.job_id, "phase": j.phase})]

    if ev.action == "cancel":
        effects: list[Effect] = []
        if job.plan and job.phase in ACTIVE:
            effects.append(Control(job.job_id, job.plan_version, job.plan_nodes, "cancel"))
        if job.transaction:  # a submit still being checked
            effects.append(Respond(job.respond_to, job.transaction, False, {"job_id": job.job_id},
                                   "cancelled while being checked"))
        job = note(job, ctx.now, "cancelled", phase="cancelled", awaiting="", waiting=(), requests=(),
                    deadline=None, recover_deadline=None, transaction=None)
        return ok(job, *effects)
    if ev.action == "pause":
        if job.phase == "running":
            return ok(note(job, ctx.now, "paused", phase="paused", want_paused=True),
                      Control(job.job_id, job.plan_version, job.plan_nodes, "pause"))
        if job.phase in ("paused", "assigning", "recovering", "queued", "planning") and job.accepted:
            return ok(replace(job, want_paused=True))
    if ev.action == "resume":
        if job.phase == "paused":
            return ok(note(job, ctx.now, "resumed", phase="running", want_paused=False,
                            deadline=ctx.now + ctx.timeouts.stall_s),
                      Control(job.job_id, job.plan_version, job.plan_nodes, "resume"))
        if job.accepted:
            return ok(replace(job, want_paused=False))
    return job, [Respond(name, ev.transaction, False, {"job_id": job.job_id},
                         f"job {job.job_id} is {job.phase}: cannot {ev.action}")]


def _on_tick(job: Job, _ev: Tick, ctx: Ctx) -> Out:
    if job.awaiting == "profiles":
        for node, since in job.offline_since.items():
            if node in job.waiting and ctx.now > since + ctx.timeouts.profile_offline_s:
                rid = next((r for r, n in job.requests if n == node), "")
                return _on_profiled(job, Profiled(node, rid, None, f"went offline for more than "
                                                  f"{ctx.timeouts.profile_offline_s:.0f} s while profiling"), ctx)
    if job.recover_deadline is not None and ctx.now > job.recover_deadline:
        return _fail(job, ctx, f"could not recover within {ctx.timeouts.recover_s:.0f} s: "
                     f"{job.events[-1] if job.events else ''}")
    if job.deadline is None or ctx.now <= job.deadline:
        return job, []
    late = ", ".join(job.waiting)
    if job.awaiting == "inspect":
        return _refuse(job, ctx, f"owner {job.owner!r} did not answer the inspection within "
                       f"{ctx.timeouts.inspect_s:.0f} s")
    if job.awaiting == "profiles":
        for node in job.waiting:
            job, out = _drop_node(job, ctx, node, f"did not profile within {ctx.timeouts.profile_s:.0f} s")
            if out is not None:
                return out
        return _plan_or_profile(replace(job, waiting=()),
                                ctx, tuple(n for n in _candidates(job, ctx) if n in job.profiles))
    if job.awaiting == "acks":
        return _recover(replace(job, excluded=job.excluded + job.waiting), ctx, f"no ack from {late}",
                        known_cause=True)
    if job.awaiting == "retry":
        return _replan(replace(job, awaiting=""), ctx)
    if job.phase == "running":
        return _recover(job, ctx, f"no progress for {ctx.timeouts.stall_s:.0f} s")
    return replace(job, deadline=None), []


def _on_metrics(job: Job, ev: Metrics, ctx: Ctx) -> Out:
    return apply_metrics(job, ev.m, ctx.now, ctx.timeouts.stall_s), []


_HANDLERS = {Inspected: _on_inspected, Profiled: _on_profiled, Acked: _on_acked,
             NodeDown: _on_down, NodeUp: _on_up, Metrics: _on_metrics, Status: _on_status,
             Command: _on_command, Tick: _on_tick, Rebalanced: on_rebalanced}


# --- scheduling and restart ------------------------------------------------------------------
def schedule(jobs: dict[str, Job], ctx: Ctx) -> tuple[dict[str, Job], list[Effect]]:
    """Start the oldest accepted queued job when no job holds the nodes."""
    if any(occupies(j) for j in jobs.values()):
        return jobs, []
    waiting = sorted((j for j in jobs.values() if j.phase == "queued" and j.accepted),
                     key=lambda j: j.created_at)
    if not waiting:
        return jobs, []
    job, effects = _replan(note(waiting[0], ctx.now, "nodes free: planning"), ctx)
    if job.awaiting == "retry":  # the owner is away: stay queued, try again on the next event
        return jobs, []
    return {**jobs, job.job_id: job}, effects


def restart(job: Job, ctx: Ctx) -> Out:
    """After a gateway restart: re-issue whatever the job was waiting for.

    Running and paused jobs are left alone: the nodes train without the gateway; their retained
    NodeJobStatus and availability messages (arriving right after subscribing) complete or
    recover the job, and the stall deadline catches a plan that silently died meanwhile.
    """
    if job.phase in TERMINAL or (job.phase == "queued" and job.accepted):
        return job, []
    job = note(job, ctx.now, "gateway restarted")
    if job.phase in ("running", "paused"):
        if job.pending_plan is not None:
            # The order may or may not have reached the owner: it is dropped, not re-sent. Should the
            # ranks apply it all the same, the owner's status says so and the plan follows (`reshard`).
            to = job.pending_plan.layout().to_text() if job.pending_plan.shares is None \
                else f"rows per group {job.pending_plan.shares}"
            job = note(job, ctx.now, f"re-shard to {to} was pending: dropped "
                        "(the owner's status makes it the plan if the ranks moved)", pending_plan=None)
        return replace(rejoin(job), deadline=ctx.now + ctx.timeouts.stall_s), []
    if job.awaiting == "inspect":
        return _inspect(job, ctx)
    if job.awaiting == "profiles":
        job, reqs = _request_ids(job, job.waiting)
        return replace(job, deadline=ctx.now + ctx.timeouts.profile_s), [Profile(job.job_id, reqs)]
    if job.awaiting == "plan":  # a table written while planning was a round trip through the service
        return _plan_or_profile(replace(job, awaiting=""), ctx, job.waiting or _candidates(job, ctx))
    if job.awaiting == "acks" and job.plan is not None:  # nobody started: the same assignment again (nodes re-ack)
        return replace(job, waiting=job.plan_nodes, deadline=ctx.now + ctx.timeouts.ack_s), \
            [Assign(job.job_id, job.plan, job.resume_step)]
    # recovering, between attempts: retry once the retained availability has arrived
    return replace(job, awaiting="retry", deadline=ctx.now + ctx.timeouts.retry_s), []
