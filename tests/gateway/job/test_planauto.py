"""A job planned by `auto` through the state machine (`gateway.job.planning.plan_job`): submit,
inspect, profiles in, then the plan with the strategy chosen and the runner-up in its event and
the candidates in the answer; a forced `dp` that cannot fit refused by name; bad batch shares
refused with their reason; the live re-balancer re-splitting a data-parallel plan's batch.
Pure: the bench's synthetic profile reports, no broker, no torch."""

from __future__ import annotations

from dataclasses import replace

import pytest

from xronos.bench.plan_speed import synthetic_report
from xronos.gateway.job import machine as J
from xronos.gateway.job.planning import plan_job, plan_text
from xronos.gateway.job.rebalancers import Rebalancers
from xronos.gateway.job.types import Net, Planned
from xronos.gateway.plan.rebalance import PolicyConfig
from xronos.gateway.plan.shares import ShareError
from xronos.protocol import messages as m

GiB = 1 << 30
NODES = ("a", "b", "c", "d")
RECIPE = m.Recipe(model_dir="/m", data_path="/d.csv", task="classify", batch_size=8, seq_len=32, lr=1e-4,
                  max_steps=100, export_dir="/out")


def report(node: str, slowness: float, mem: int = 8 * GiB, frozen: bool = True) -> m.ProfileReport:
    """A profile for job "j"; `frozen`: the base's weights untrained (a LoRA-like job: the head trained)."""
    r = synthetic_report(node, slowness=slowness, memory_available=mem, units=8, num_blocks=2)
    if frozen:
        r = r.model_copy(update={"layers": [lay.model_copy(update={
            "param_bytes": lay.weight_bytes // 4 if lay.name == "head" else lay.weight_bytes}) for lay in r.layers]})
    return r.model_copy(update={"job_id": "j"})


def submit(reports: dict[str, m.ProfileReport], strategy: str | None = None, net: Net = Net(bandwidth_Bps=100e6 / 8),
           respond_to: str = "job/submit", **spec_kw):
    """Submit job "j" (strategy: the spec's default unless given), answer its inspection and profiles."""
    kw = {} if strategy is None else {"strategy": strategy}
    spec = m.JobSpec(name="t", owner="a", recipe=RECIPE, **kw, **spec_kw)
    ctx = J.Ctx(now=0.0, online=frozenset(reports), planner=plan_job, net=net)
    job, effects = J.new_job("j", spec, "tx", ctx, respond_to=respond_to)
    (inspect,) = [e for e in effects if isinstance(e, J.Inspect)]
    arch = next(iter(reports.values())).arch
    job, effects = J.handle(job, J.Inspected(m.InspectReport(node_id="a", request_id=inspect.request_id, job_id="j",
                                                             ok=True, arch=arch, total_steps=100)), ctx)
    (profile,) = [e for e in effects if isinstance(e, J.Profile)]
    for rid, node in profile.requests:
        job, effects = J.handle(job, J.Profiled(node, rid, reports[node]), ctx)
    return job, effects


def test_the_default_strategy_is_auto():
    assert m.JobSpec(name="t", owner="a", recipe=RECIPE).strategy == "auto"


def test_an_auto_job_is_planned_with_the_strategy_chosen_and_the_runner_up():
    job, effects = submit({n: report(n, 1 + 0.5 * i) for i, n in enumerate(NODES)})
    assert job.phase == "assigning" and job.plan.strategy == "dp" and sum(job.plan.shares) == 8
    (answer,) = [e for e in effects if isinstance(e, J.Respond)]
    assert answer.ok and answer.data["plan"] == job.plan
    assert [c["strategy"] for c in answer.data["candidates"]] == ["segment", "dp", "mesh"]
    assert [c["chosen"] for c in answer.data["candidates"]] == [False, True, False]
    event = next(e for e in job.events if "plan v1" in e)
    assert "plan v1 (dp (4 replicas) " in event and "(auto; runner-up mesh 2x2 (2 groups of TP 2) " in event
    assert f"a={job.plan.shares[0]} rows" in event and "resume from step 0" in event
    (assign,) = [e for e in effects if isinstance(e, J.Assign)]
    assert assign.plan.shares == job.plan.shares


def test_a_full_fine_tune_over_a_fast_link_stays_tensor_parallel():
    reports = {n: report(n, 1 + 0.5 * i, frozen=False) for i, n in enumerate(NODES[:3])}
    job, _ = submit(reports, net=Net())
    assert job.plan.strategy == "segment" and job.plan.shares is None
    assert "plan v1 (segment (TP over 3) " in next(e for e in job.events if "plan v1" in e)


def test_a_forced_dp_that_cannot_fit_is_refused_naming_each_nodes_need_and_cap():
    reports = {"a": report("a", 1.0), "b": report("b", 1.0, mem=GiB)}
    job, effects = submit(reports, strategy="dp")
    (answer,) = [e for e in effects if isinstance(e, J.Respond)]
    assert not answer.ok and J.refused(job)
    assert "plan cannot fit: data parallelism does not fit: every node holds a whole replica; a needs " in answer.error
    assert "cap 7,680 MiB" in answer.error and "b needs " in answer.error and "cap 512 MiB (over)" in answer.error


def test_bad_batch_shares_reach_the_submitter():
    """A planner's ShareError (shares that are negative, name unknown nodes or miss the batch's sum:
    `plan.shares.check_shares`) is a refusal with its reason, like any plan that cannot be made."""
    def planner(job, nodes, version, ctx):
        raise ShareError("shares: sum to 7 rows, but the global batch is 8 (a=4, b=3)")

    spec = m.JobSpec(name="t", owner="a", recipe=RECIPE)
    ctx = J.Ctx(now=0.0, online=frozenset({"a"}), planner=planner)
    job, effects = J.new_job("j", spec, "tx", ctx)
    (inspect,) = [e for e in effects if isinstance(e, J.Inspect)]
    r = report("a", 1.0)
    job, effects = J.handle(job, J.Inspected(m.InspectReport(node_id="a", request_id=inspect.request_id, job_id="j",
                                                             ok=True, arch=r.arch, total_steps=100)), ctx)
    (profile,) = [e for e in effects if isinstance(e, J.Profile)]
    job, effects = J.handle(job, J.Profiled("a", profile.requests[0][0], r), ctx)
    (answer,) = [e for e in effects if isinstance(e, J.Respond)]
    assert not answer.ok and answer.error == "plan cannot fit: shares: sum to 7 rows, but the global batch is 8 (a=4, b=3)"


def test_the_plan_text_says_rows_and_groups():
    job, _ = submit({n: report(n, 1 + 0.5 * i) for i, n in enumerate(NODES)})
    assert plan_text(job.plan) == ", ".join(f"{e.node_id}={r} rows" for e, r in zip(job.plan.entries, job.plan.shares))
    mesh = m.Plan.model_validate({**job.plan.model_dump(), "shares": [5, 3], "entries": [
        e.model_copy(update={"attn": 4, "mlp": 2048, "vocab": 25000}).model_dump() for e in job.plan.entries]})
    assert plan_text(mesh).startswith("group 0 (5 rows) a=attn 4/mlp 2048/vocab 25000, b=attn 4/")
    assert "; group 1 (3 rows) c=" in plan_text(mesh)


def test_the_live_re_balancer_re_splits_a_data_parallel_plan_and_the_plan_follows():
    """A node measured slower than its profile loses rows: the policy's word orders the owner a
    re-split (the layout kept, `JobReshard.shares`), the plan it makes waits until the owner says
    the ranks took it, then the plan's shares are the new ones (same plan version)."""
    from xronos.gateway.job.effects import messages
    from xronos.gateway.registry import Registry

    job, _ = submit({n: report(n, 1 + 0.5 * i) for i, n in enumerate(NODES)})
    job = replace(job, phase="running", accepted=True)
    plan, old = job.plan, tuple(job.plan.shares)
    rebal = Rebalancers(PolicyConfig(warmup=1, settle=2, confirm=2))
    ctx = J.Ctx(now=1.0, online=frozenset(NODES))
    # Each rank measures its plan's prediction, but the last node (rank 3) runs 3x slower.
    predicted = [e.predicted_compute_s for e in plan.entries]
    said = []
    for step in range(1, 8):
        for e in plan.entries:
            x = m.IterationMetrics(job_id="j", plan_version=1, node_id=e.node_id, rank=e.rank, step=step, epoch=0,
                                   loss=1.0, compute_s=predicted[e.rank] * (3 if e.rank == 3 else 1), comm_s=0.0,
                                   idle_s=0.0, iteration_s=0.1, voluntary_ctx_switches=0, involuntary_ctx_switches=0,
                                   peak_rss=1)
            d = rebal.observe(job, x)
            if d is not None:
                said.append(d)
                job, effects = J.handle(job, d, ctx)
        if job.pending_plan is not None:
            break
    assert [d.shares is None for d in said[:-1]] == [True] * (len(said) - 1)  # warming up, settling, confirming
    d = said[-1]
    assert d.layout == plan.layout() and d.old_shares == old and sum(d.shares) == sum(old)
    assert d.shares[3] < old[3] and "nothing moves" in d.reason
    (order,) = effects
    assert order.shares == d.shares and order.layout == plan.layout() and order.node == "a"
    ((msg, params),) = list(messages(order, job, Registry(), (29500, 29600)))
    assert isinstance(msg, m.JobReshard) and msg.shares == list(d.shares) and params == {"node_id": "a"}
    assert job.pending_plan.shares == list(d.shares) and job.plan.shares == list(old) and job.replans == 1
    assert job.events[-1].endswith(f"rows per group {list(old)} -> {list(d.shares)}; {d.reason}")
    # The owner's word: the ranks took the new rows at the ordered boundary.
    status = m.NodeJobStatus(node_id="a", job_id="j", plan_version=1, rank=0, status="running", step=d.at_step,
                             reshard_step=d.at_step, reshard_layout=plan.layout(), reshard_s=0.0, reshard_bytes=0,
                             reshard_shares=list(d.shares), sent_at=2.0)
    job, _ = J.handle(job, J.Status(status), ctx)
    assert job.plan.shares == list(d.shares) and job.pending_plan is None and job.plan_version == 1
    assert job.last_reshard_step == d.at_step and job.plan.layout() == plan.layout()
    assert f"re-split applied at step {d.at_step}" in job.events[-1]


def test_each_groups_rows_are_limited_by_its_nodes_memory_caps():
    from xronos.gateway.job.rebalancers import JobResplit

    job, _ = submit({n: report(n, 1 + 0.5 * i) for i, n in enumerate(NODES)})
    free = JobResplit.for_job(job)
    assert list(free.policy.max_rows) == [8, 8, 8, 8]
    cap = JobResplit._memory(free.nodes[3], job.plan.layout(), 0, 2, free.profile_rows)  # "d" fits 2 rows
    plan = m.Plan.model_validate({**job.plan.model_dump(), "entries": [
        e.model_copy(update={"memory_cap": cap}) if e.node_id == "d" else e for e in job.plan.entries]})
    assert list(JobResplit.for_job(replace(job, plan=plan)).policy.max_rows) == [8, 8, 8, 2]


def test_a_re_split_applied_later_than_ordered_restarts_the_measurements():
    """The order for step 10 lands at step 14: metrics of steps up to 14 ran under the old rows; the
    policy drops what it took of them and measures afresh from there (once per boundary)."""
    from xronos.gateway.job.rebalancers import JobResplit

    job, _ = submit({n: report(n, 1 + 0.5 * i) for i, n in enumerate(NODES)})
    policy = JobResplit.for_job(job)
    policy.policy.moved_to((8, 0, 0, 0))
    policy.ignore_until = 10
    policy.policy.samples[0].extend([1.0, 1.0])
    status = m.NodeJobStatus(node_id="a", job_id="j", plan_version=1, rank=0, status="running", step=15,
                             reshard_step=14, reshard_layout=job.plan.layout(), reshard_s=0.0, reshard_bytes=0,
                             reshard_shares=[8, 0, 0, 0], sent_at=2.0)
    assert policy.moved(status) and policy.ignore_until == 14 and not policy.policy.samples[0]
    assert not policy.moved(status)  # the same boundary again: nothing
    assert not policy.moved(status.model_copy(update={"reshard_step": 20, "reshard_shares": [4, 4, 0, 0]}))


def test_an_owner_refusing_a_re_split_keeps_the_plan():
    job, _ = submit({n: report(n, 1 + 0.5 * i) for i, n in enumerate(NODES)})
    plan = job.plan
    pending = m.Plan.model_validate({**plan.model_dump(), "shares": [8, 0, 0, 0]})
    job = replace(job, phase="running", accepted=True, pending_plan=pending)
    status = m.NodeJobStatus(node_id="a", job_id="j", plan_version=1, rank=0, status="running", step=3,
                             reshard_refused="re-split at step 5 refused: shares [8, 0, 0] name 3 groups",
                             sent_at=2.0)
    job, _ = J.handle(job, J.Status(status), J.Ctx(now=1.0, online=frozenset(NODES)))
    assert job.pending_plan is None and job.plan.shares == plan.shares
    assert job.last_replan_reason.startswith("re-shard refused by the ranks, plan kept: re-split at step 5")


def test_planned_keeps_the_plan_for_callers_that_want_only_it():
    job, _ = submit({n: report(n, 1 + 0.5 * i) for i, n in enumerate(NODES)})
    ctx = J.Ctx(now=0.0, online=frozenset(NODES), planner=plan_job, net=Net(bandwidth_Bps=100e6 / 8))
    planned = plan_job(job, NODES, 2, ctx)
    assert isinstance(planned, Planned) and planned.plan.version == 2 and planned.note.startswith("dp (4 replicas)")
    with pytest.raises(ValueError, match="node 'z' has no profile for this job"):
        plan_job(job, ("a", "z"), 2, ctx)


def test_the_plan_preview_answers_with_the_candidates_side_by_side():
    job, effects = submit({n: report(n, 1 + 0.5 * i) for i, n in enumerate(NODES)}, respond_to="plan/preview")
    (answer,) = effects
    assert answer.name == "plan/preview" and answer.ok and job.phase == "completed"
    assert answer.data["plan"].strategy == "dp" and answer.data["chosen"].startswith("dp (4 replicas) ")
    rows = answer.data["candidates"]
    assert [(c["label"], c["chosen"], c["feasible"]) for c in rows] == [
        ("segment (TP over 4)", False, True), ("dp (4 replicas)", True, True), ("mesh 2x2 (2 groups of TP 2)", False, True)]
    assert all(c["iteration_s"] > 0 and c["worst_memory"] <= c["worst_cap"] for c in rows)
    assert rows[1]["iteration_s"] < rows[2]["iteration_s"] < rows[0]["iteration_s"]


def test_a_job_that_lets_the_planner_choose_its_overlap_tries_the_modes_and_hears_which_was_kept():
    """overlap auto: the plan carries a trial of its mode and the next likeliest (its event says so),
    the re-balancer skips the trial's steps, and the owner's word on the outcome becomes one event
    (a repeat is not news)."""
    from xronos.gateway.job.rebalancers import JobRebalance

    reports = {n: report(n, 1 + 0.5 * i, frozen=False) for i, n in enumerate(NODES[:3])}
    job, _ = submit(reports, strategy="segment", overlap="auto")
    trial = job.plan.trial
    assert trial is not None and m.overlap_label(trial.modes[0]) == m.overlap_label(job.plan.overlap)
    assert "off" in [m.overlap_label(x) for x in trial.modes]
    assert f"overlap trial of {', '.join(m.overlap_label(x) for x in trial.modes)} over its first 14 steps" \
        in job.events[-1]
    assert JobRebalance.for_job(job).ignore_until == 14
    assert submit(reports, strategy="segment")[0].plan.trial is None  # overlap off: nothing to try
    # each mode comes with the planner's forecast for it once kept; the plan's mode's is the plan's
    assert trial.forecasts is not None and len(trial.forecasts) == len(trial.modes)
    assert trial.forecasts[0].iteration_s == pytest.approx(job.plan.predicted_iteration_s)
    job = replace(job, phase="running", accepted=True)
    seconds = {m.overlap_label(x): 0.2 + 0.01 * i for i, x in enumerate(trial.modes)}
    kept = m.overlap_label(trial.modes[1])
    status = m.NodeJobStatus(node_id="a", job_id="j", plan_version=1, rank=0, status="running", step=12,
                             trial_step=14, trial_kept=kept, trial_seconds=seconds, sent_at=2.0)
    ctx = J.Ctx(now=1.0, online=frozenset(NODES))
    job, _ = J.handle(job, J.Status(status), ctx)
    assert job.trial_kept == (1, 14, kept)
    want = trial.forecasts[1].iteration_s
    assert job.events[-1].endswith(f"overlap trial (wall clock, median iteration): "
                                   f"{', '.join(f'{k} {v:.4f} s' for k, v in seconds.items())}; kept {kept} "
                                   f"(predicted {want:.4f} s) from step 14")
    # what the job runs from then on is set against the kept mode's prediction, and its state says which
    assert job.plan.predicted_iteration_s == pytest.approx(want)
    from xronos.gateway.job.progress import state_view

    assert state_view(job).overlap_kept == kept
    n = len(job.events)
    job, _ = J.handle(job, J.Status(status.model_copy(update={"step": 13})), ctx)
    assert len(job.events) == n


def test_a_move_the_re_balancer_did_not_order_is_booked_as_its_own():
    """The overlap trial's move to the kept mode's layout: the policy takes that layout as the one
    running (so its next re-plan starts from it) and measures afresh from that boundary."""
    from xronos.gateway.job.rebalancers import JobRebalance
    from xronos.protocol.layout import Layout

    job, _ = submit({n: report(n, 1 + 0.5 * i, frozen=False) for i, n in enumerate(NODES[:3])}, strategy="segment")
    policy = JobRebalance.for_job(job)
    old = policy.policy.layout
    other = Layout(attn=(old.attn[1], old.attn[0], *old.attn[2:]), mlp=old.mlp, vocab=old.vocab)
    assert other != old
    status = m.NodeJobStatus(node_id="a", job_id="j", plan_version=1, rank=0, status="running", step=16,
                             reshard_step=15, reshard_layout=other, reshard_s=0.2, reshard_bytes=1000, sent_at=2.0)
    assert policy.moved(status)
    assert policy.policy.layout == other and policy.ignore_until == 15
    # a layout of another world (a hostile or broken owner) is not booked, and nothing raises
    wrong = Layout(attn=(sum(old.attn),), mlp=(sum(old.mlp),), vocab=(sum(old.vocab),))
    assert policy.moved(status.model_copy(update={"reshard_step": 20, "reshard_layout": wrong}))
    assert policy.policy.layout == other and policy.ignore_until == 15


def _trial_job():
    """A running segment job whose plan carries a trial with a mode that has a layout of its own
    (built by hand: which mode the planner gives one depends on the profiles)."""
    from xronos.protocol.layout import Layout

    job, _ = submit({n: report(n, 1 + 0.5 * i, frozen=False) for i, n in enumerate(NODES[:3])}, strategy="segment")
    plan = job.plan
    old = plan.layout()
    own = Layout(attn=(old.attn[1], old.attn[0], *old.attn[2:]), mlp=old.mlp, vocab=old.vocab)
    assert own != old
    trial = m.OverlapTrial(modes=[m.Overlap(backward=False), m.Overlap(backward=True), m.Overlap(backward=True, chunks=2)],
                           layouts=[None, None, own],
                           forecasts=[m.ModeForecast(iteration_s=plan.predicted_iteration_s),
                                      m.ModeForecast(iteration_s=0.9 * plan.predicted_iteration_s),
                                      m.ModeForecast(iteration_s=0.8 * plan.predicted_iteration_s, comm_s=0.01,
                                                     compute_s=[0.5, 0.6, 0.7], memory=[1e8, 2e8, 3e8])])
    plan = m.Plan.model_validate({**plan.model_dump(), "overlap": None, "trial": trial.model_dump()})
    return replace(job, plan=plan, phase="running", accepted=True), own


def test_the_trial_s_move_to_its_kept_mode_s_layout_takes_that_layout_s_predictions():
    """An overlap trial keeps c2 and the ranks move to c2's own layout, a re-shard nobody ordered:
    the plan's entries take the counts and the compute and memory the trial forecast there, and its
    predicted iteration is c2's, whichever of the two words comes first."""
    from xronos.gateway.job.progress import state_view

    job, own = _trial_job()
    ctx = J.Ctx(now=1.0, online=frozenset(NODES))
    moved = m.NodeJobStatus(node_id="a", job_id="j", plan_version=1, rank=0, status="running", step=16,
                            reshard_step=15, reshard_layout=own, reshard_s=0.2, reshard_bytes=1000, sent_at=2.0)
    kept = m.NodeJobStatus(node_id="a", job_id="j", plan_version=1, rank=0, status="running", step=15,
                           trial_step=14, trial_kept="c2", trial_seconds={"off": 0.3, "bwd": 0.25, "c2": 0.2},
                           sent_at=1.5)
    forecast = job.plan.trial.forecasts[2]
    for words in ((kept, moved), (moved, kept)):
        j = job
        for w in words:
            j, _ = J.handle(j, J.Status(w), ctx)
        assert j.plan.layout() == own
        assert [e.predicted_compute_s for e in j.plan.entries] == forecast.compute_s
        assert [e.predicted_memory for e in j.plan.entries] == forecast.memory
        assert j.plan.predicted_iteration_s == pytest.approx(forecast.iteration_s)
        assert j.plan.comm_s == 0.01 and all(v == 0.01 for v in state_view(j).predicted_comm_s.values())


def test_an_overlap_trial_s_steps_are_not_what_the_job_measures():
    """The job's running sums (its measured iteration and compute against the plan's) leave out a
    trial's steps, which run other modes, and the first step after them."""
    job, _ = _trial_job()
    steps = job.plan.trial.steps

    def metric(step: int, t: float) -> m.IterationMetrics:
        return m.IterationMetrics(node_id="a", job_id="j", plan_version=1, rank=0, step=step, epoch=0, loss=1.0,
                                  iteration_s=t, compute_s=t / 2, idle_s=0.0, comm_s=t / 2, peak_rss=1,
                                  voluntary_ctx_switches=0, involuntary_ctx_switches=0)

    ctx = J.Ctx(now=1.0, online=frozenset(NODES))
    for step in range(1, steps + 4):
        job, _ = J.handle(job, J.Metrics(metric(step, 9.0 if step <= steps + 1 else 1.0)), ctx)
    assert job.agg["a"].n == 2 and job.agg["a"].iteration_s == pytest.approx(2.0)


def test_a_node_named_twice_is_refused_before_anything_is_asked_of_it():
    spec = m.JobSpec(name="t", owner="a", recipe=RECIPE, nodes=["a", "b", "b", "c", "a"])
    job, effects = J.new_job("j", spec, "tx", J.Ctx(now=0.0, online=frozenset(NODES)))
    assert job.phase == "failed" and not [e for e in effects if isinstance(e, (J.Inspect, J.Profile))]
    (answer,) = [e for e in effects if isinstance(e, J.Respond)]
    assert not answer.ok and "nodes: a, b named more than once" in answer.error
