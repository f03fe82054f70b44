"""A running job's live re-balancing at the gateway (`xronos.gateway.job.rebalancers`) and its path through
the job state machine (`J.Rebalanced` -> a `J.Reshard` effect, the plan's new counts, the JobState's
replans and last reason). Pure: profiles from the bench's synthetic reports, metrics made by hand
from the cost model with one node slower than its profile says."""

from __future__ import annotations

from dataclasses import replace

import pytest

from xronos.bench.plan_speed import synthetic_report
from xronos.gateway.job import machine as J
from xronos.gateway.job.progress import state_view
from xronos.gateway.job.rebalancers import JobRebalance, unit_bytes
from xronos.gateway.plan.costmodel import node_cost, segment_times
from xronos.gateway.plan.compatible import Loaded
from xronos.gateway.plan.profiles import node_profile, plan_message, plan_reports
from xronos.gateway.plan.rebalance import PolicyConfig
from xronos.protocol import messages as m
from xronos.protocol.layout import KINDS

NODES = ("a", "b")
SPEC = m.JobSpec(name="t", owner="a",
                 recipe=m.Recipe(model_dir="/m", data_path="/d.csv", task="classify", batch_size=8, seq_len=32,
                                 lr=1e-4, max_steps=200, export_dir="/out"),
                 rebalance=True)
def short(text: str) -> str:  # the JobState's and Home Assistant's 256 characters
    return text if len(text) <= 256 else text[:253] + "..."


FAST = PolicyConfig(window=3, warmup=1, interval=1, confirm=2, cooldown=5, payback=100)


def running_job(caps_mb: float | None = None) -> J.Job:
    reports = {n: synthetic_report(n, units=8, num_blocks=2) for n in NODES}
    result = plan_reports([Loaded(n, r) for n, r in reports.items()], "segment", batch_size=8, seq_len=32,
                          task="classify", checkpoints=True)
    plan = plan_message(result, "j", version=1)
    if caps_mb is not None:  # every node's cap just above what it holds now: no room to take more
        plan = plan.model_copy(update={"entries": [e.model_copy(update={"memory_cap": e.predicted_memory * caps_mb})
                                                   for e in plan.entries]})
    return J.Job("j", SPEC, 0.0, phase="running", accepted=True, profiles=reports, plan=plan, plan_version=1,
                 total_steps=200)


def metrics(job: J.Job, step: int, slow: dict[str, float], layout=None) -> list[m.IterationMetrics]:
    """One iteration's metrics from every rank: the profile's per-kind times x the node's slowness."""
    layout = layout or job.plan.layout()
    out = []
    for e in job.plan.entries:
        base = node_cost(node_profile(job.profiles[e.node_id]))
        t = segment_times(base, {k: layout.share(k, e.rank) for k in KINDS})
        f = slow.get(e.node_id, 1.0)
        per = {k: t[k] * f for k in KINDS}
        total = sum(per.values()) + t["out"]
        out.append(m.IterationMetrics(job_id="j", plan_version=1, node_id=e.node_id, rank=e.rank, step=step, epoch=0,
                                      loss=1.0, compute_s=total, comm_s=0.0, idle_s=0.0, iteration_s=total,
                                      voluntary_ctx_switches=0, involuntary_ctx_switches=0, peak_rss=1,
                                      compute_attn_s=per["attn"], compute_mlp_s=per["mlp"],
                                      compute_vocab_s=per["vocab"], compute_rest_s=t["out"]))
    return out


def run_until_decision(job, reb, slow, steps=range(1, 40), want=lambda d: d.layout is not None):
    """The first decision `want`s (a re-plan), and every decision seen on the way."""
    for step in steps:
        for x in metrics(job, step, slow):
            d = reb.observe(x)
            if d is not None:
                reb.seen.append(d)
                if want(d):
                    return step, d
    return None, None


def test_a_slow_node_is_re_planned_and_the_job_orders_the_reshard():
    job = running_job()
    reb = JobRebalance.for_job(job, FAST, lead=2)
    reb.seen = []
    assert reb.policy.layout == job.plan.layout() and reb.policy.caps == [e.memory_cap for e in job.plan.entries]
    step, d = run_until_decision(job, reb, {"b": 3.0})
    assert d is not None and d.layout is not None and d.at_step == step + 2
    old, new = job.plan.layout(), d.layout
    assert sum(new.mlp[1:]) < sum(old.mlp[1:]) and new.mlp[0] > old.mlp[0]  # work moves off the slow node b
    job2, effects = J.handle(job, J.Rebalanced(1, d.at_step, d.layout, d.reason, d.old, d.gain,
                                               d.predicted_compute_s, d.predicted_memory,
                                               d.predicted_bottleneck_s), J.Ctx(now=5.0, online=frozenset(NODES)))
    (order,) = effects
    assert isinstance(order, J.Reshard) and order.node == "a" and order.layout == new and order.at_step == d.at_step
    # Ordered, not yet applied: the plan is still what the ranks run; the order's plan waits.
    assert job2.plan == job.plan and job2.pending_plan.layout() == new and job2.replans == 1
    assert job2.pending_plan.version == 1
    assert job2.pending_plan.predicted_iteration_s == d.predicted_bottleneck_s + job.plan.comm_s
    state = state_view(job2)
    assert state.replans == 1 and state.last_replan_reason == short(d.reason)
    assert f"re-plan for step {d.at_step}: {old.to_text()} -> {new.to_text()}" in state.events[-1]
    assert "faster" in state.events[-1]
    # The owner says the ranks moved: the plan is the new layout's, the measured sums restart.
    job2 = replace(job2, agg={"a": J.Agg(3, 1.0, 0.1, 1.2, 0.1)})
    moved = J.Status(m.NodeJobStatus(node_id="a", job_id="j", plan_version=1, rank=0, status="running",
                                     step=d.at_step, reshard_step=d.at_step, reshard_layout=new, sent_at=1.0))
    job3, _ = J.handle(job2, moved, J.Ctx(now=6.0, online=frozenset(NODES)))
    assert job3.plan == job2.pending_plan and job3.pending_plan is None and job3.agg == {}
    assert job3.events[-1].endswith(f"re-shard applied at step {d.at_step}: {new.to_text()}")
    assert state_view(job3).plan.layout() == new
    # Metrics of the iterations before the move (still the old layout) are not the policy's.
    fed = reb.fed
    for x in metrics(job, d.at_step, {"b": 3.0}):
        assert reb.observe(x) is None
    assert reb.fed == fed
    for x in metrics(job2, d.at_step + 1, {"b": 3.0}):
        reb.observe(x)
    assert reb.fed == d.at_step + 1


def test_a_decision_for_another_plan_or_layout_changes_nothing():
    job = running_job()
    reb = JobRebalance.for_job(job, FAST)
    reb.seen = []
    _, d = run_until_decision(job, reb, {"b": 3.0})
    c = J.Ctx(now=5.0, online=frozenset(NODES))
    # No boundary is left before the job's end: nothing is ordered, the reason says so.
    late, effects = J.handle(replace(job, total_steps=d.at_step), J.Rebalanced(1, d.at_step, d.layout, d.reason,
                                                                              d.old), c)
    assert effects == [] and late.pending_plan is None and late.last_replan_reason.startswith("not ordered")
    for ev in (J.Rebalanced(2, d.at_step, d.layout, d.reason, d.old),  # a superseded plan version
               J.Rebalanced(1, d.at_step, d.layout, d.reason, d.layout)):  # decided from another layout
        assert J.handle(job, ev, c) == (job, [])
    assert J.handle(replace(job, phase="recovering"), J.Rebalanced(1, d.at_step, d.layout, d.reason, d.old), c)[1] == []


def test_steady_nodes_are_never_re_planned_and_each_new_reason_is_told_once():
    job = running_job()
    reb = JobRebalance.for_job(job, FAST)
    reb.seen = []
    assert run_until_decision(job, reb, {}, range(1, 100)) == (None, None)
    assert reb.fed == 99 and reb.policy.last_reason.startswith("kept")
    reasons = [d.reason for d in reb.seen]
    assert reasons[0] == "warming up" and reasons[-1] == reb.policy.last_reason
    assert all(a != b for a, b in zip(reasons, reasons[1:])) and all(d.layout is None for d in reb.seen)
    # The job shows the latest as its reason, without an event line for each.
    c = J.Ctx(now=5.0, online=frozenset(NODES))
    for d in reb.seen:
        job = J.handle(job, J.Rebalanced(1, d.at_step, None, d.reason, d.old), c)[0]
    assert job.last_replan_reason == short(reasons[-1]) and job.replans == 0 and not job.events


def test_a_re_plan_over_the_memory_caps_is_kept_and_the_job_says_why_once():
    job = running_job(caps_mb=1.0001)
    reb = JobRebalance.for_job(job, FAST)
    reb.seen = []
    step, d = run_until_decision(job, reb, {"b": 3.0}, want=lambda d: "memory cap" in d.reason)
    assert d is not None and d.layout is None and "memory cap" in d.reason
    c = J.Ctx(now=5.0, online=frozenset(NODES))
    job2, effects = J.handle(job, J.Rebalanced(1, d.at_step, None, d.reason, d.old), c)
    assert effects == [] and job2.plan == job.plan and job2.replans == 0
    assert job2.last_replan_reason == short(d.reason) and "plan kept" in job2.events[-1]
    # No re-plan ever; the same reason again is not told, and the job's history has it once.
    assert run_until_decision(job, reb, {"b": 3.0}, range(step + 1, step + 20)) == (None, None)
    assert J.handle(job2, J.Rebalanced(1, d.at_step, None, d.reason, d.old), c) == (job2, [])
    other = "kept: the re-plan puts ['a'] over their memory caps"
    again = J.handle(job2, J.Rebalanced(1, d.at_step, None, other, d.old), c)[0]
    assert again.events == job2.events and again.last_replan_reason == other


def test_incomplete_steps_and_foreign_metrics_are_not_fed():
    job = running_job()
    reb = JobRebalance.for_job(job, FAST)
    reb.seen = []
    a, b = metrics(job, 1, {})
    assert reb.observe(a) is None and reb.fed == 0  # b's half is missing
    assert reb.observe(b.model_copy(update={"node_id": "a"})) is None  # a node speaking for another's rank
    assert reb.observe(b.model_copy(update={"plan_version": 2})) is None
    assert reb.observe(b.model_copy(update={"compute_attn_s": None})) is None  # no per-kind split
    assert reb.fed == 0
    reb.observe(b)
    assert reb.fed == 1
    assert reb.observe(a) is None and reb.fed == 1  # a repeat of a fed step


def test_unit_bytes_follow_the_architecture():
    r = synthetic_report("a", units=8, num_blocks=2)
    full, lora = unit_bytes(r.arch, 2, "classify", False), unit_bytes(r.arch, 2, "classify", True)
    h = r.arch.hidden_size
    assert full["mlp"] == 2 * h * 2 * 4 * 3 and full["vocab"] == h * 4 * 3  # gpt2: c_fc column + c_proj row
    assert full["attn"] == h * (h / 8) * 4 * 2 * 4 * 3  # q, k, v, o of one head in each of 2 blocks
    assert {k: v * 3 for k, v in lora.items()} == full  # LoRA: the frozen base moves without moments


def test_the_owners_applied_reshard_is_noted_once_and_only_from_the_owner():
    job = running_job()
    new = job.plan.layout()
    c = J.Ctx(now=5.0, online=frozenset(NODES))

    def status(node, rank, **kw):
        return J.Status(m.NodeJobStatus(node_id=node, job_id="j", plan_version=1, rank=rank, status="running",
                                        step=9, sent_at=1.0, **kw))

    job2, _ = J.handle(job, status("a", 0, reshard_step=7, reshard_layout=new, reshard_s=0.25), c)
    assert job2.last_reshard_step == 7 and job2.events[-1].endswith(
        f"re-shard applied at step 7: {new.to_text()} (0.25 s at the boundary)")
    # A layout that does not cover the model is nothing the ranks moved to.
    bad = new.model_copy(update={"mlp": (1, 1)})
    assert J.handle(job, status("a", 0, reshard_step=7, reshard_layout=bad), c)[0] == job
    assert J.handle(job2, status("a", 0, reshard_step=7, reshard_layout=new, reshard_s=0.25), c)[0] == job2
    assert J.handle(job, status("b", 1, reshard_step=7, reshard_layout=new), c)[0].last_reshard_step is None


def test_a_rank_failing_after_a_re_plan_recovers_from_the_checkpoint_under_a_fresh_plan():
    """A rank that dies at or after a move fails like any rank: the survivors are cancelled, the
    job re-plans from the profiles on the nodes online and resumes from the last checkpoint (which
    loads under any layout); a decision of the old plan version is ignored from then on."""
    from xronos.gateway.job.planning import plan_job

    job = running_job()
    reb = JobRebalance.for_job(job, FAST)
    reb.seen = []
    _, d = run_until_decision(job, reb, {"b": 3.0})
    c = J.Ctx(now=5.0, online=frozenset(NODES), planner=plan_job)
    job, _ = J.handle(job, J.Rebalanced(1, d.at_step, d.layout, d.reason, d.old, d.gain), c)
    job = replace(job, checkpoint_step=10)
    failed = J.Status(m.NodeJobStatus(node_id="b", job_id="j", plan_version=1, rank=1, status="failed", step=12,
                                      detail="gloo: connection closed by peer", sent_at=1.0))
    job, effects = J.handle(job, failed, c)
    assert job.phase == "recovering" and "resuming from step 10" in job.events[-1]
    assert [(type(e).__name__, e.action) for e in effects] == [("Control", "cancel")]
    job, effects = J.handle(job, J.Tick(), replace(c, now=5.0 + 60))  # the regroup wait is over
    (assign,) = [e for e in effects if isinstance(e, J.Assign)]
    assert assign.resume_step == 10 and job.plan_version == 2 and assign.plan.version == 2
    assert J.handle(job, J.Rebalanced(1, d.at_step, d.layout, d.reason, job.plan.layout()), c) == (job, [])


def _ordered(job: J.Job, slow: dict[str, float] | None = None):
    """The job with a re-shard ordered by its policy (pending), and the decision."""
    reb = JobRebalance.for_job(job, FAST)
    reb.seen = []
    _, d = run_until_decision(job, reb, slow or {"b": 3.0})
    job2, effects = J.handle(job, J.Rebalanced(1, d.at_step, d.layout, d.reason, d.old, d.gain, d.predicted_compute_s,
                                               d.predicted_memory, d.predicted_bottleneck_s),
                             J.Ctx(now=5.0, online=frozenset(NODES)))
    assert job2.pending_plan is not None and len(effects) == 1
    return job2, d


def test_an_order_the_ranks_refused_is_not_kept_pending_and_the_job_says_why():
    job, d = _ordered(running_job())
    c = J.Ctx(now=6.0, online=frozenset(NODES))
    why = "re-shard at step 9 refused: attn: counts [5, 4] sum to 9"

    def status(node, rank, refused):
        return J.Status(m.NodeJobStatus(node_id=node, job_id="j", plan_version=1, rank=rank, status="running",
                                        step=9, sent_at=1.0, reshard_refused=refused))

    assert J.handle(job, status("b", 1, why), c)[0].pending_plan is not None  # only the owner speaks for the ranks
    job2, effects = J.handle(job, status("a", 0, why), c)
    assert effects == [] and job2.pending_plan is None and job2.plan == job.plan and job2.phase == "running"
    assert job2.last_replan_reason.startswith("re-shard refused by the ranks, plan kept: ") and why in job2.events[-1]
    assert state_view(job2).plan.layout() == job.plan.layout()
    # The retained status repeats the refusal with every update: a later order is not dropped by it.
    job3, _ = _ordered(replace(job2, pending_plan=None))
    job3 = replace(job3, reshard_refused=job2.reshard_refused)
    assert J.handle(job3, status("a", 0, why), c)[0].pending_plan == job3.pending_plan


def test_a_pending_order_is_dropped_at_a_gateway_restart_and_the_state_says_so():
    job, d = _ordered(running_job())
    c = J.Ctx(now=7.0, online=frozenset(NODES))
    job2, effects = J.restart(job, c)
    assert effects == [] and job2.pending_plan is None and job2.plan == job.plan and job2.phase == "running"
    assert "was pending: dropped" in job2.events[-1] and d.layout.to_text() in job2.events[-1]
    # Had the owner applied it all the same, its retained status makes it the plan.
    moved = J.Status(m.NodeJobStatus(node_id="a", job_id="j", plan_version=1, rank=0, status="running",
                                     step=d.at_step, reshard_step=d.at_step, reshard_layout=d.layout, sent_at=1.0))
    job3, _ = J.handle(job2, moved, c)
    assert job3.plan.layout() == d.layout and job3.plan.entries[0].node_id == "a"
    # The job table keeps an order across a restart of the store (the record round-trips).
    from xronos.gateway.job.store import job_from_dict, job_to_dict
    assert job_from_dict(job_to_dict(job)) == job


def test_an_order_past_a_memory_cap_is_not_sent():
    job = running_job()
    reb = JobRebalance.for_job(job, FAST)
    reb.seen = []
    _, d = run_until_decision(job, reb, {"b": 3.0})
    over = tuple(e.memory_cap * 1.5 for e in job.plan.entries)  # as a policy that missed the caps would say
    c = J.Ctx(now=5.0, online=frozenset(NODES))
    ev = J.Rebalanced(1, d.at_step, d.layout, d.reason, d.old, d.gain, d.predicted_compute_s, over)
    job2, effects = J.handle(job, ev, c)
    assert effects == [] and job2.pending_plan is None and job2.replans == 0 and job2.plan == job.plan
    assert "memory cap" in job2.last_replan_reason and "plan kept" in job2.events[-1]
    assert J.handle(job2, ev, c) == (job2, [])  # said once


def test_the_ranks_rest_reaches_the_policy_booked_to_the_kinds_they_hold():
    """compute_rest_s (the optimizer step, clipping) is part of a rank's time the plan can move:
    the gateway hands it to the policy, which books it to the kinds by bytes held."""
    job = running_job()
    seen = {}
    for rest in (None, 0.5):
        reb = JobRebalance.for_job(job, FAST, lead=2)
        for step in (1, 2, 3):  # past the policy's warm-up
            for x in metrics(job, step, {}):
                reb.observe(x.model_copy(update={"compute_rest_s": rest}))
        seen[rest] = [{k: reb.policy.samples[d][k][-1] for k in KINDS} for d in range(len(NODES))]
    for d in range(len(NODES)):
        assert all(seen[0.5][d][k] > seen[None][d][k] for k in KINDS)


def test_a_measured_move_reaches_the_policy_once_and_only_from_this_plans_owner():
    """The owner's NodeJobStatus after a re-shard carries its wall time and the bytes moved: the
    gateway's policy refits its move model from it (as `xronos run` does), once per boundary."""
    job = running_job()
    reb = JobRebalance.for_job(job, FAST, lead=2)
    prior = 100e6 / reb.policy.bandwidth_Bps + reb.policy.move_fixed_s

    def status(**kw) -> m.NodeJobStatus:
        base = dict(node_id="a", job_id="j", plan_version=1, rank=0, status="running", step=9,
                    reshard_step=8, reshard_layout=job.plan.layout(), reshard_s=prior * 3,
                    reshard_bytes=100_000_000, sent_at=1.0)
        return m.NodeJobStatus(**{**base, **kw})

    assert not reb.moved(status(node_id="b", rank=1))  # not the owner
    assert not reb.moved(status(plan_version=2))  # another plan's
    assert not reb.moved(status(reshard_bytes=None))  # an older node's status: nothing to scale by
    assert list(reb.policy.moves) == []
    assert reb.moved(status())
    assert reb.policy.move_cost(100e6) == pytest.approx(prior * 3)  # the measured move, at its size
    assert not reb.moved(status(step=12))  # the same boundary, re-published with a later step
    assert list(reb.policy.moves) == [(100e6, prior * 3)]


def test_a_re_plans_memory_for_the_owner_is_the_planners():
    """Rank 0 reads the data and gathers the export: the decision's peak for it is the planner's
    arithmetic (owner included), so the cap check and the job's predicted peak see the same figure
    a fresh plan would (it was a plain rank's: 581 against a measured 902 MiB in `make demo`)."""
    job = running_job()  # the owner's data stack: what only rank 0 holds besides its shard
    job = replace(job, profiles={n: r.model_copy(update={"owner_bytes": 90 << 20, "runtime_bytes": 335 << 20}) for n, r in job.profiles.items()})
    reb = JobRebalance.for_job(job, FAST, lead=2)
    reb.seen = []
    _, d = run_until_decision(job, reb, {"b": 3.0})
    assert d is not None and d.layout is not None
    from xronos.gateway.plan.costmodel import layout_shares
    from xronos.gateway.plan.memorymodel import predict_memory
    owner = replace(reb.base[0], owner=True)
    assert reb.base[0].owner and not any(n.owner for n in reb.base[1:])
    assert d.predicted_memory[0] == predict_memory(owner, layout_shares(d.layout, 0))
    plain = replace(reb.base[0], owner=False)
    assert d.predicted_memory[0] > predict_memory(plain, layout_shares(d.layout, 0))
