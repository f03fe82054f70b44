"""The job state machine's planner: a job's profiles and its nodes' latest capabilities in, a Plan
out. Pure (no I/O, no clock), so it runs inside the core's transition (`Ctx.planner`) instead of a
round trip through the service. Planning goes only through `auto.choose_reports` (every strategy:
`auto` predicts the candidates and picks, a forced one plans just it) and `auto.choice_message`;
the answer carries a line for the job's events (what was chosen, the runner-up) and the
candidates side by side (the plan preview's answer).
"""

from __future__ import annotations

from xronos.gateway.plan.auto import candidates_data, choice_message, choice_note, choose_reports, with_trial
from xronos.gateway.plan.compatible import Loaded, job_settings
from xronos.gateway.plan.profiles import DEFAULT_RESERVE_MB
from xronos.protocol import messages as m
from xronos.protocol.layout import KINDS, NOUN

from .types import Ctx, Job, Planned


def plan_job(job: Job, nodes: tuple[str, ...], version: int, ctx: Ctx) -> Planned:
    """Plan `job` on `nodes` (rank order: the owner first) as version `version`; ValueError
    (InfeasiblePlan, DPInfeasible and the shares' ShareError included) saying why it cannot."""
    loaded = []
    for node in nodes:
        report = job.profiles.get(node)
        if report is None:
            raise ValueError(f"node {node!r} has no profile for this job")
        caps = ctx.caps.get(node)
        if caps is not None:  # plan with the node's memory now, not when it profiled
            report = report.model_copy(update={"capabilities": caps})
        loaded.append(Loaded(source=f"node {node}", report=report))
    recipe = job.spec.recipe
    # None only in a job made outside the gateway's submit, which fills in gateway.toml's
    reserve = job.spec.reserve_mb if job.spec.reserve_mb is not None else DEFAULT_RESERVE_MB
    choice = choose_reports(loaded, job.spec.strategy, reserve_mb=reserve,
                            bandwidth_Bps=ctx.net.bandwidth_Bps, latency_s=ctx.net.latency_s,
                            batch_size=recipe.batch_size, seq_len=recipe.seq_len, task=recipe.task,
                            settings=job_settings(job.spec), batch=recipe.batch_size,
                            overlap=job.spec.overlap, chunks=job.spec.chunks,
                            checkpoints=True,  # a job's owner gathers consolidated checkpoints
                            export_merged=recipe.exports_whole_model)
    result = choice.winner.tp
    if result is not None and not result.feasible:  # a forced uniform plan ignores the caps
        over = "; ".join(f"{r.node_id} needs {r.predicted_memory / 2**20:.0f} MiB of its {r.memory_cap / 2**20:.0f} "
                         f"MiB cap holding " + ", ".join(f"{r.count(k)} {NOUN[k]}" for k in KINDS)
                         for r in result.rows if r.over_cap)
        raise ValueError(f"the {result.strategy} plan exceeds memory caps: {over}")
    # The job let the planner choose the overlap mode: its ranks measure the likeliest few first.
    msg = choice_message(choice, job.job_id, version)
    if job.spec.overlap in ("auto", "on") and job.spec.chunks is None:
        msg = with_trial(msg, choice, job.total_steps)
    return Planned(msg, choice_note(choice),
                   tuple(candidates_data(choice)))


def plan_text(plan: m.Plan) -> str:
    """Each node's part of a plan, for the job's events: its counts (TP), its rows (DP), or both (a
    mesh); a TP plan's overlap trial after it."""
    if plan.shares is None:
        text = ", ".join(f"{e.node_id}=attn {e.attn}/mlp {e.mlp}/vocab {e.vocab}" for e in plan.entries)
        if plan.trial is None:
            return text
        modes = ", ".join(m.overlap_label(x) for x in plan.trial.modes)
        return f"{text}; overlap trial of {modes} over its first {plan.trial.steps} steps"
    tp = plan.tp_size
    if tp == 1:
        return ", ".join(f"{e.node_id}={rows} rows" for e, rows in zip(plan.entries, plan.shares))
    groups = [plan.entries[i:i + tp] for i in range(0, len(plan.entries), tp)]
    return "; ".join(f"group {g} ({rows} rows) " + ", ".join(
        f"{e.node_id}=attn {e.attn}/mlp {e.mlp}/vocab {e.vocab}" for e in grp)
        for g, (grp, rows) in enumerate(zip(groups, plan.shares)))
