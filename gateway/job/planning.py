"""The job state machine's planner: a job's profiles and its nodes' latest capabilities in, a Plan
out. Pure (no I/O, no clock), so it runs inside the core's transition (`Ctx.planner`) instead of a
round trip through the service. Planning goes only through `profiles.plan_reports` and
`profiles.plan_message`.
"""

from __future__ import annotations

from xronos.gateway.plan.compatible import Loaded, job_settings
from xronos.gateway.plan.profiles import plan_message, plan_reports
from xronos.protocol import messages as m
from xronos.protocol.layout import KINDS, NOUN

from .types import Ctx, Job


def plan_job(job: Job, nodes: tuple[str, ...], version: int, ctx: Ctx) -> m.Plan:
    """Plan `job` on `nodes` (rank order: the owner first) as version `version`; ValueError
    (InfeasiblePlan included) saying why it cannot."""
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
    result = plan_reports(loaded, job.spec.strategy, reserve_mb=job.spec.reserve_mb,
                          bandwidth_Bps=ctx.net.bandwidth_Bps, latency_s=ctx.net.latency_s,
                          batch_size=recipe.batch_size, seq_len=recipe.seq_len, task=recipe.task,
                          settings=job_settings(job.spec),
                          checkpoints=True,  # a job's owner gathers consolidated checkpoints
                          export_merged=recipe.exports_whole_model)
    if not result.feasible:
        over = "; ".join(f"{r.node_id} needs {r.predicted_memory / 2**20:.0f} MiB of its {r.memory_cap / 2**20:.0f} "
                         f"MiB cap holding " + ", ".join(f"{r.count(k)} {NOUN[k]}" for k in KINDS)
                         for r in result.rows if r.over_cap)
        raise ValueError(f"the {result.strategy} plan exceeds memory caps: {over}")
    return plan_message(result, job.job_id, version)
