"""The job state machine over typed data: every path from submit to an end, driven by hand. The
planner is injected (`Ctx.planner`), so these tests need neither the cost model nor MQTT."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from xronos.gateway.job import machine as J
from xronos.gateway.job.progress import state_view
from xronos.protocol import messages as m
from xronos.protocol.layout import Sizes

SPEC = m.JobSpec(name="t", owner="a",
                 recipe=m.Recipe(model_dir="/m", data_path="/d.csv", task="classify", batch_size=4, seq_len=16,
                                 lr=1e-4, max_steps=10, export_dir="/out"))
ARCH = m.ArchSpec(family="bert", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4,
                  intermediate_size=64, vocab_size=100, max_positions=64, num_labels=2, tie_word_embeddings=True)
CAPS = m.Capabilities(node_id="a", hostname="h", arch="x86_64", cpu_model="cpu", cores=2, memory_total=8 << 30,
                      memory_available=4 << 30, torch_version="2", data_host="127.0.0.1", sent_at=1.0)
LAYER = m.LayerProfile(name="blk", kind="blk", partitioned=False, time_s=0.1, time_samples=[], weight_bytes=1,
                       activation_bytes=1, temp_bytes=1)
TO = J.Timeouts(inspect_s=10, profile_s=20, ack_s=10, stall_s=30, recover_s=100, retry_s=5, regroup_s=2,
                max_recoveries=3)


def plan(nodes, version, job_id="j"):
    n = len(nodes)
    return m.Plan(job_id=job_id, version=version, strategy="segment",
                  sizes=Sizes(attn=n, mlp=32 * n, vocab=32 * n),
                  entries=[m.PlanEntry(node_id=node, rank=r, attn=1, mlp=32, vocab=32, predicted_compute_s=0.1,
                                       predicted_memory=1.0, memory_cap=2.0) for r, node in enumerate(nodes)],
                  predicted_iteration_s=0.1, ideal_iteration_s=0.1, comm_s=0.0)


def planner(job, nodes, version, ctx):
    return plan(nodes, version, job.job_id)


def failing(reason):
    def fail(job, nodes, version, ctx):
        raise ValueError(reason)
    return fail


def ctx(now=0.0, online=("a", "b", "c"), busy=False, plans=planner):
    return J.Ctx(now=now, online=frozenset(online), timeouts=TO, busy=busy, planner=plans)


def kinds(effects):
    return [type(e).__name__ for e in effects]


def inspected(job, ok=True, error=None, node="a"):
    rid = job.requests[0][0] if job.requests else "nope.1"
    fields = dict(arch=ARCH, train_rows=40, eval_rows=4, total_steps=10) if ok else {"error": error}
    return J.Inspected(m.InspectReport(node_id=node, request_id=rid, job_id=job.job_id, ok=ok, **fields))


def report(node, rid, job_id="j", **changes):
    r = m.ProfileReport(node_id=node, request_id=rid, job_id=job_id, capabilities=CAPS.model_copy(
        update={"node_id": node}), arch=ARCH, task="classify", batch_size=4, seq_len=16, threads=1, sizes=ARCH.sizes(),
        num_blocks=2, layers=[LAYER], profile_seconds=1.0, created_at=1.0)
    return r.model_copy(update=changes)


def profiled(job, node, ok=True, error="no torch"):
    rid = dict((n, r) for r, n in job.requests).get(node, "none.1")
    return J.Profiled(node, rid, report(node, rid, job.job_id) if ok else None, None if ok else error)


def profile_all(job, c):
    out = []
    for rid, node in job.requests:
        job, out = J.handle(job, J.Profiled(node, rid, report(node, rid, job.job_id)), c)
    return job, out


def submit_to_running(spec=SPEC, online=("a", "b", "c")):
    job, eff = J.new_job("j", spec, "t1", ctx(online=online))
    assert eff == [J.Inspect("j", "a", "j.1")] and job.awaiting == "inspect"
    job, eff = J.handle(job, inspected(job), ctx(1))
    assert job.phase == "profiling" and kinds(eff) == ["Profile"]
    assert [n for _, n in eff[0].requests] == ["a"] + [n for n in online if n != "a"]
    job, eff = profile_all(job, ctx(2))
    assert kinds(eff) == ["Respond", "Assign"] and eff[0].ok and eff[0].transaction == "t1"
    assert eff[1].plan.entries[0].node_id == "a"  # the owner is rank 0
    assert job.phase == "assigning" and job.accepted
    for n in job.plan_nodes:
        job, eff = J.handle(job, J.Acked(n, job.plan_version, True), ctx(4))
    assert job.phase == "running" and eff == [J.Control("j", 1, job.plan_nodes, "start")]
    return job


def metric(node, rank, step, version=1, **kw):
    fields = dict(job_id="j", plan_version=version, node_id=node, rank=rank, step=step, epoch=0,
                  loss=1.0 / step, compute_s=0.1 * (rank + 1), comm_s=0.01, idle_s=0.02, iteration_s=0.2,
                  voluntary_ctx_switches=1, involuntary_ctx_switches=0, peak_rss=1)
    return J.Metrics(m.IterationMetrics(**{**fields, **kw}))


def status(node, rank, st, version=1, **kw):
    return J.Status(m.NodeJobStatus(node_id=node, job_id="j", plan_version=version, rank=rank, status=st,
                                    step=kw.pop("step", 0), epoch=0, sent_at=1.0, **kw))


def test_happy_path_metrics_and_completion():
    job = submit_to_running()
    for step in (1, 2, 3):
        for r, n in enumerate(job.plan_nodes):
            job, _ = J.handle(job, metric(n, r, step), ctx(5 + step))
    view = state_view(job)
    assert view.step == 3 and view.loss == pytest.approx(1 / 3)
    assert view.measured_s == {"a": pytest.approx(0.1), "b": pytest.approx(0.2), "c": pytest.approx(0.3)}
    assert view.idle_ratio["a"] == pytest.approx(0.1) and view.eta_s == pytest.approx(7 * 0.2)
    assert view.predicted_s == {"a": 0.1, "b": 0.1, "c": 0.1}
    # Predicted vs measured compute and communication per node, and their MAPE.
    assert view.compute_mape_pct == pytest.approx(100 * (0 + 0.1 / 0.2 + 0.2 / 0.3) / 3)
    assert view.measured_comm_s == {n: pytest.approx(0.01) for n in "abc"}
    assert view.predicted_comm_s == {n: job.plan.comm_s for n in "abc"}
    assert view.comm_mape_pct == pytest.approx(100 * abs(job.plan.comm_s - 0.01) / 0.01)
    job, _ = J.handle(job, status("a", 0, "running", checkpoint_step=2), ctx(9))
    job, _ = J.handle(job, status("a", 0, "running", checkpoint_step=4), ctx(9))
    assert job.checkpoint_step == 4 and job.events[-1].endswith("checkpoint at step 4")
    assert not any(e.endswith("checkpoint at step 2") for e in job.events)
    job, eff = J.handle(job, status("b", 1, "completed", step=10), ctx(10))
    assert job.phase == "running"  # only the owner's completion counts (it holds the export)
    job, eff = J.handle(job, status("a", 0, "completed", step=10, export_dir="/out", eval_metric=0.9,
                                    eval_metric_name="accuracy"), ctx(10))
    assert job.phase == "completed" and job.export_dir == "/out" and job.eval_metric == 0.9


def test_stale_metrics_are_ignored():
    job = submit_to_running()
    job2, _ = J.handle(job, metric("a", 0, 5, version=0), ctx(5))
    job3, _ = J.handle(job, metric("zz", 0, 5), ctx(5))
    assert job2.step == job3.step == 0


def test_a_node_speaks_only_for_its_own_rank():
    """Regression (issue 15, claims): a helper claiming rank 0 completed the job with its own
    export_dir; a helper's metric as rank 0 set the job's step and loss."""
    job = submit_to_running()
    claims = [status("b", 0, "completed", step=10, export_dir="/evil"),  # b holds rank 1
              status("c", 0, "running", checkpoint_step=8),
              status("b", 0, "running", eval_initial=0.1, eval_metric=0.99, eval_metric_name="accuracy"),
              status("c", 1, "failed", detail="c speaks for b")]
    for ev in claims:
        after, eff = J.handle(job, ev, ctx(5))
        assert after == job and eff == []
    after, _ = J.handle(job, metric("b", 0, 7), ctx(5))
    assert after.step == 0 and after.loss is None
    # The owner at rank 0 may; and a checkpoint beyond the job's end is no resume point.
    after, _ = J.handle(job, status("a", 0, "running", checkpoint_step=10**6), ctx(5))
    assert after.checkpoint_step == 0
    after, _ = J.handle(job, status("a", 0, "completed", step=10**6, export_dir="/out"), ctx(5))
    assert after.phase == "completed" and after.step == 10


def test_answers_count_only_for_the_nodes_own_request():
    """Regression (issue 15, claims): an answer carrying another node's request id, or a stale one,
    is ignored; a report that does not answer the request drops the node, not the job."""
    job, _ = J.new_job("j", SPEC, "t", ctx())
    wrong = J.Inspected(m.InspectReport(node_id="a", request_id="j.99", job_id="j", ok=False, error="x"))
    assert J.handle(job, wrong, ctx(1)) == (job, [])
    job, _ = J.handle(job, inspected(job), ctx(1))
    rid_a = dict((n, r) for r, n in job.requests)["a"]
    # b answers with a's request id (its own report, and a failure): neither counts.
    for ev in (J.Profiled("b", rid_a, report("b", rid_a)), J.Profiled("b", rid_a, None, "b cancels a")):
        assert J.handle(job, ev, ctx(2)) == (job, [])
    # c's report for another batch size: c is left out; the plan goes on with a and b.
    job, _ = J.handle(job, profiled(job, "a"), ctx(2))
    job, _ = J.handle(job, profiled(job, "b"), ctx(2))
    rid_c = dict((n, r) for r, n in job.requests)["c"]
    job, eff = J.handle(job, J.Profiled("c", rid_c, report("c", rid_c, batch_size=8)), ctx(2))
    assert job.accepted and "c" in job.excluded and [e.node_id for e in eff[1].plan.entries] == ["a", "b"]
    assert "batch_size does not match" in " ".join(job.events)


@pytest.mark.parametrize("online, reason", [(("b", "c"), "owner node 'a' is offline")])
def test_refused_when_owner_offline(online, reason):
    job, eff = J.new_job("j", SPEC, "t1", ctx(online=online))
    assert job.phase == "failed" and reason in job.error and J.refused(job)
    assert eff == [J.Respond("job/submit", "t1", False, {"job_id": "j"}, job.error)]


def test_refused_when_named_node_offline_or_owner_not_named():
    job, eff = J.new_job("j", SPEC.model_copy(update={"nodes": ["a", "x"]}), "t", ctx())
    assert job.phase == "failed" and "x offline" in job.error
    job, eff = J.new_job("j", SPEC.model_copy(update={"nodes": ["b"]}), "t", ctx())
    assert "must be one of" in job.error


def test_refused_when_inspection_fails_or_times_out():
    job, _ = J.new_job("j", SPEC, "t", ctx())
    bad, eff = J.handle(job, inspected(job, ok=False, error="data_path: /d.csv does not exist"), ctx(1))
    assert bad.phase == "failed" and "does not exist" in bad.error and not eff[0].ok
    late, eff = J.handle(job, J.Tick(), ctx(11))
    assert late.phase == "failed" and "did not answer" in late.error and not eff[0].ok
    down, eff = J.handle(job, J.NodeDown("a"), ctx(1))
    assert down.phase == "failed" and "went offline" in down.error


def test_a_refusal_reason_is_kept_short():
    """Regression (issue 15): a refusal echoing a huge reason made the JobState too large to send."""
    job, _ = J.new_job("j", SPEC, "t", ctx())
    job, eff = J.handle(job, inspected(job, ok=False, error="x" * 4000), ctx(1))
    assert len(job.error) <= J.MAX_ERROR_CHARS and len(eff[0].error) <= J.MAX_ERROR_CHARS
    assert all(len(e) <= J.MAX_EVENT_CHARS for e in job.events)
    assert len(state_view(replace(job, accepted=True)).model_dump_json()) < 10_000


def test_refused_when_plan_cannot_fit():
    job, _ = J.new_job("j", SPEC, "t", ctx())
    job, _ = J.handle(job, inspected(job), ctx(1))
    job, eff = profile_all(job, ctx(2, plans=failing("node a needs 3 GB, cap 1 GB")))
    assert job.phase == "failed" and eff[0].error == "plan cannot fit: node a needs 3 GB, cap 1 GB"
    assert eff[0].transaction == "t" and not job.accepted


def test_a_planner_overflow_refuses_instead_of_hanging():
    """Regression (issue 15): an OverflowError in planning left the submit unanswered in 'planning'."""
    def overflow(job, nodes, version, ctx):
        raise OverflowError("int too large to convert to float")
    job, _ = J.new_job("j", SPEC, "t", ctx())
    job, _ = J.handle(job, inspected(job), ctx(1))
    job, eff = profile_all(job, ctx(2, plans=overflow))
    assert job.phase == "failed" and "int too large" in job.error and kinds(eff) == ["Respond"]


def test_unnamed_node_that_cannot_profile_is_left_out():
    job, _ = J.new_job("j", SPEC, "t", ctx())
    job, _ = J.handle(job, inspected(job), ctx(1))
    job, _ = J.handle(job, profiled(job, "a"), ctx(2))
    job, _ = J.handle(job, profiled(job, "b", ok=False), ctx(2))
    job, eff = J.handle(job, J.Tick(), ctx(30))  # c never answers
    assert [e.node_id for e in eff[-1].plan.entries] == ["a"] and set(job.excluded) == {"b", "c"}
    named, _ = J.new_job("j", SPEC.model_copy(update={"nodes": ["a", "b"]}), "t", ctx())
    named, _ = J.handle(named, inspected(named), ctx(1))
    named, eff = J.handle(named, profiled(named, "b", ok=False), ctx(2))
    assert named.phase == "failed" and "no torch" in named.error


def test_node_loss_recovers_from_checkpoint_on_survivors():
    job = submit_to_running()
    job, _ = J.handle(job, status("a", 0, "running", checkpoint_step=4, step=5), ctx(5))
    job, eff = J.handle(job, J.NodeDown("c"), ctx(6, online=("a", "b")))
    assert job.recoveries == 1 and job.phase == "assigning"  # profiles cached: straight to a plan
    assert eff == [J.Control("j", 1, ("a", "b", "c"), "cancel"), J.Assign("j", plan(("a", "b"), 2), 4)]
    assert job.step == 4
    job, _ = J.handle(job, J.Acked("a", 1, True), ctx(7))  # stale version: ignored
    assert job.waiting == ("a", "b")
    for n in ("a", "b"):
        job, eff = J.handle(job, J.Acked(n, 2, True), ctx(8))
    assert job.phase == "running" and eff == [J.Control("j", 2, ("a", "b"), "start")]
    assert any("recovering: node 'c' went offline" in e for e in job.events)
    job, _ = J.handle(job, status("c", 2, "failed", version=1), ctx(9))  # late, old plan
    assert job.phase == "running"


def test_a_survivors_failure_first_then_the_lost_node_is_named_and_re_planned_at_once():
    """A node dies: its peer's rank fails on the broken connection before the dead node's last-will
    arrives. The events then name the node that went offline (not only the survivor's failure), and
    the re-plan does not wait out the regroup delay any more."""
    job = submit_to_running()
    job, _ = J.handle(job, status("a", 0, "running", checkpoint_step=4, step=5), ctx(5))
    job, eff = J.handle(job, status("a", 0, "failed", detail="Connection reset by peer"), ctx(5.5))
    assert job.phase == "recovering" and job.awaiting == "retry" and "rank 0 on 'a' failed" in job.events[-1]
    job, eff = J.handle(job, J.NodeDown("c"), ctx(6, online=("a", "b")))
    assert any("node 'c' went offline (what the rank's failure followed)" in e for e in job.events)
    assert job.phase == "assigning" and eff == [J.Assign("j", plan(("a", "b"), 2), 4)]
    n = len(job.events)
    job, eff = J.handle(job, J.NodeDown("c"), ctx(6.5, online=("a", "b")))  # said once
    assert len(job.events) == n and eff == []


def test_rank_failure_and_waiting_for_memory_or_owner():
    job = submit_to_running()
    job, eff = J.handle(job, status("b", 1, "failed", detail="Gloo timeout"), ctx(5))
    assert job.phase == "recovering" and "Gloo timeout" in job.events[-1] and job.awaiting == "retry"
    assert eff == [J.Control("j", 1, ("a", "b", "c"), "cancel")]  # then wait for last-wills
    job, eff = J.handle(job, J.Tick(), ctx(6))
    assert eff == []
    job, eff = J.handle(job, J.Tick(), ctx(7.5, plans=failing("b needs 9 GB")))
    assert job.phase == "recovering" and job.awaiting == "retry" and eff == []
    assert "b needs 9 GB" in job.events[-1]
    job, eff = J.handle(job, J.NodeDown("a"), ctx(7, online=("b", "c")))
    assert eff == []
    job, eff = J.handle(job, J.Tick(), ctx(14, online=("b", "c")))
    assert job.awaiting == "retry" and "waiting for the owner" in job.events[-1]
    job, eff = J.handle(job, J.NodeUp("a"), ctx(15, plans=failing("still no memory")))
    assert eff == [] and job.awaiting == "retry"
    job, eff = J.handle(job, J.Tick(), ctx(200))
    assert job.phase == "failed" and "could not recover" in job.error


def test_refused_assignment_excludes_node_until_it_reconnects():
    job, _ = J.new_job("j", SPEC, "t", ctx())
    job, _ = J.handle(job, inspected(job), ctx(1))
    job, eff = profile_all(job, ctx(2))
    job, eff = J.handle(job, J.Acked("b", 1, False, "busy"), ctx(4))
    assert job.phase == "assigning" and job.recoveries == 1 and eff[-1] == J.Assign("j", plan(("a", "c"), 2), 0)
    job, _ = J.handle(job, J.NodeUp("b"), ctx(5))
    assert "b" not in job.excluded


def test_too_many_recoveries_fail_the_job():
    job = submit_to_running()
    for i in range(3):
        job = replace(job, phase="running")
        job, _ = J.handle(job, status("b", 1, "failed"), ctx(5 + i))
    job = replace(job, phase="running")
    job, eff = J.handle(job, status("b", 1, "failed"), ctx(9))
    assert job.phase == "failed" and "gave up after 3" in job.error and kinds(eff) == ["Control"]


def test_a_training_failure_fails_the_job_instead_of_re_planning_it():
    """A rank whose training failed by itself (a non-finite loss: `job_fault`) fails the job at once:
    any plan would resume from the same checkpoint and meet it again."""
    detail = "JobFault: step 7: the loss is nan, not finite: training diverged"
    job = submit_to_running()
    job, eff = J.handle(job, status("a", 0, "failed", detail=detail, job_fault=True), ctx(5))
    assert job.phase == "failed" and job.recoveries == 0 and detail in job.error
    assert eff == [J.Control("j", 1, ("a", "b", "c"), "cancel")]
    assert f"failed: rank 0 on 'a': {detail}" in job.events[-1]
    # A peer's broken connection may arrive first (a node failure: recovering); the cause then fails it.
    job = submit_to_running()
    job, _ = J.handle(job, status("b", 1, "failed", detail="Gloo: connection closed by peer"), ctx(5))
    assert job.phase == "recovering" and job.recoveries == 1
    job, _ = J.handle(job, status("a", 0, "failed", detail=detail, job_fault=True), ctx(5.5))
    assert job.phase == "failed" and detail in job.error
    job, eff = J.handle(job, J.Tick(), ctx(60))
    assert job.phase == "failed" and eff == []  # no re-plan after all


def test_pause_resume_cancel():
    job = submit_to_running()
    job, eff = J.handle(job, J.Command("pause", "p1"), ctx(5))
    assert job.phase == "paused" and eff[0] == J.Control("j", 1, job.plan_nodes, "pause") and eff[1].ok
    job, eff = J.handle(job, J.Tick(), ctx(100))
    assert job.phase == "paused"  # no metrics while paused is not a stall
    job, eff = J.handle(job, J.Command("resume", "r1"), ctx(101))
    assert job.phase == "running" and eff[0].action == "resume"
    job, eff = J.handle(job, J.Command("resume", "r2"), ctx(102))
    assert job.phase == "running" and eff[-1].ok
    job, eff = J.handle(job, J.Command("cancel", "c1"), ctx(103))
    assert job.phase == "cancelled" and eff[0] == J.Control("j", 1, job.plan_nodes, "cancel")
    job, eff = J.handle(job, J.Command("pause", "p2"), ctx(104))
    assert eff == [J.Respond("job/pause", "p2", False, None, "job j is already cancelled")]


def test_pause_while_recovering_is_applied_on_restart_of_the_plan():
    job = submit_to_running()
    job, _ = J.handle(job, status("b", 1, "failed"), ctx(5))
    job, eff = J.handle(job, J.Command("pause", "p"), ctx(6))
    assert eff[-1].ok and job.want_paused and job.phase == "recovering"
    job, _ = J.handle(job, J.Tick(), ctx(8))
    for n in job.plan_nodes:
        job, eff = J.handle(job, J.Acked(n, 2, True), ctx(8))
    assert job.phase == "paused" and [e.action for e in eff] == ["start", "pause"]


def test_stall_and_ack_timeouts_recover():
    job = submit_to_running()
    job, _ = J.handle(job, J.Tick(), ctx(40))
    assert job.phase == "recovering" and "no progress" in job.events[-1]


def test_schedule_runs_one_job_at_a_time():
    first = submit_to_running()
    second, _ = J.new_job("k", SPEC.model_copy(update={"name": "k"}), "t2", ctx(10))
    second, _ = J.handle(second, inspected(second), ctx(11))
    second, eff = profile_all(second, ctx(13, busy=True))
    assert second.phase == "queued" and second.accepted and kinds(eff) == ["Respond"]
    table = {"j": first, "k": second}
    assert J.schedule(table, ctx(14)) == (table, [])
    table["j"] = replace(first, phase="completed")
    table, eff = J.schedule(table, ctx(15))
    assert table["k"].phase == "assigning" and eff == [J.Assign("k", plan(("a", "b", "c"), 1, "k"), 0)]


def test_restart_reissues_what_was_awaited():
    job, _ = J.new_job("j", SPEC, "t", ctx())
    again, eff = J.restart(job, ctx(50))
    assert eff == [J.Inspect("j", "a", "j.2")] and again.deadline == 60 and again.requests == (("j.2", "a"),)
    running = submit_to_running()
    again, eff = J.restart(running, ctx(50))
    assert eff == [] and again.phase == "running" and again.deadline == 80
    assigning = replace(running, phase="assigning", awaiting="acks", waiting=("b",))
    again, eff = J.restart(assigning, ctx(50))
    assert eff == [J.Assign("j", running.plan, 0)] and again.waiting == ("a", "b", "c")
    # A table from before planning moved into the core: a job awaiting "plan" plans now.
    old, _ = J.new_job("j", SPEC, "t", ctx())
    old, _ = J.handle(old, inspected(old), ctx(1))
    old = replace(old, profiles={n: report(n, "x.1") for n in "abc"}, awaiting="plan", waiting=("a", "b", "c"),
                  phase="planning")
    again, eff = J.restart(old, ctx(50))
    assert kinds(eff) == ["Respond", "Assign"] and again.phase == "assigning"


def test_plan_preview_answers_and_ends():
    job, _ = J.new_job("p", SPEC, "t9", ctx(), respond_to="plan/preview")
    job, _ = J.handle(job, inspected(job), ctx(1))
    job, eff = profile_all(job, ctx(2))
    assert job.phase == "completed" and eff == [J.Respond("plan/preview", "t9", True,
                                                          {"plan": plan(("a", "b", "c"), 1, "p")})]


def test_abort_fails_one_job_and_answers_a_waiting_request():
    job, _ = J.new_job("j", SPEC, "t", ctx())
    out, eff = J.abort(job, ctx(1), "internal error: boom")
    assert out.phase == "failed" and J.refused(out) and eff[0].error == "internal error: boom"
    running = submit_to_running()
    out, eff = J.abort(running, ctx(5), "internal error: boom")
    assert out.phase == "failed" and not J.refused(out) and eff == [J.Control("j", 1, running.plan_nodes, "cancel")]
    assert J.abort(out, ctx(6), "again") == (out, [])


def test_prune_bounds_the_history():
    done = {f"d{i}": replace(submit_to_running(), job_id=f"d{i}", phase="completed", updated_at=float(i))
            for i in range(10)}
    live = {"live": replace(submit_to_running(), job_id="live", updated_at=0.0)}
    kept, dropped = J.prune({**done, **live}, now=10.0, keep=3, max_age_s=1e9)
    assert sorted(kept) == ["d7", "d8", "d9", "live"] and dropped == [f"d{i}" for i in range(7)]
    kept, dropped = J.prune({**done, **live}, now=10.0, keep=100, max_age_s=5.5)
    assert sorted(kept) == ["d5", "d6", "d7", "d8", "d9", "live"]
    fin = J.finished(replace(submit_to_running(), phase="completed"))
    assert fin.profiles == {} and fin.requests == ()


def test_state_view_stays_within_the_message_bounds():
    """Regression (issue 15): iteration_s = inf made the ETA NaN; huge values overflowed the state."""
    job = submit_to_running()
    job = replace(job, total_steps=2**31 - 1, agg={"a": J.Agg(1, 1e7, 1e7, 1e-300)}, last_iteration_s=math.inf)
    view = state_view(job)
    assert view.eta_s is None or math.isfinite(view.eta_s)
    assert view.idle_ratio["a"] <= 1.0
    m.JobState.model_validate_json(view.model_dump_json())


def test_job_state_shows_predicted_and_measured_peak_memory_per_node():
    """Each node's highest reported peak_rss under the current plan, beside the plan's prediction;
    a new plan version starts over."""
    job = submit_to_running()
    for step, peaks in ((1, (300, 200, 100)), (2, (250, 400, 100))):
        for r, n in enumerate(job.plan_nodes):
            job, _ = J.handle(job, metric(n, r, step, peak_rss=peaks[r] << 20), ctx(5 + step))
    view = state_view(job)
    assert view.peak_rss_bytes == {"a": 300 << 20, "b": 400 << 20, "c": 100 << 20}
    assert view.predicted_peak_bytes == {e.node_id: int(e.predicted_memory) for e in job.plan.entries}
    assert set(view.predicted_peak_bytes) == {"a", "b", "c"}
    job, _ = J.handle(job, metric("a", 0, 3, version=2, peak_rss=999 << 20), ctx(9))  # another plan's
    assert state_view(job).peak_rss_bytes["a"] == 300 << 20


def test_job_state_says_which_clock_its_seconds_are_on():
    """The ranks' IterationMetrics name their clock (an emulated box's virtual one, else wall): the
    job state carries it, and a job from nodes that do not say stays None."""
    job = submit_to_running()
    for r, n in enumerate(job.plan_nodes):
        job, _ = J.handle(job, metric(n, r, 1), ctx(6))
    assert state_view(job).clock is None
    for r, n in enumerate(job.plan_nodes):
        job, _ = J.handle(job, metric(n, r, 2, clock="virtual", wall_s=0.9), ctx(7))
    view = state_view(job)
    assert view.clock == "virtual"
    assert m.JobState.model_validate_json(view.model_dump_json()).clock == "virtual"
    with pytest.raises(ValueError):
        m.IterationMetrics(**{**metric("a", 0, 3).m.model_dump(), "clock": "sundial"})


def test_a_node_that_drops_off_the_broker_while_profiling_is_waited_for_a_while():
    """Its profiling goes on without the broker and its report comes after the reconnect (the
    node's bus queues it): a blip costs nothing; a node that stays away is dropped after
    `profile_offline_s`, and an owner that stays away refuses the job, naming why."""
    to = replace(TO, profile_offline_s=5.0)

    def c(now, online=("a", "b", "c")):
        return replace(ctx(now, online), timeouts=to)

    job, _ = J.new_job("j", SPEC, "t1", c(0))
    job, eff = J.handle(job, inspected(job), c(1))
    assert job.awaiting == "profiles" and job.waiting == ("a", "b", "c")
    job, eff = J.handle(job, J.NodeDown("b"), c(2, ("a", "c")))
    assert eff == [] and job.waiting == ("a", "b", "c") and job.offline_since == {"b": 2}
    assert "node 'b' went offline while profiling: its profile is awaited 5 s more" in job.events[-1]
    job, eff = J.handle(job, J.Tick(), c(6.5, ("a", "c")))
    assert eff == [] and "b" in job.waiting
    rid = dict((n, r) for r, n in job.requests)["b"]
    job, eff = J.handle(job, J.NodeUp("b"), c(7))
    assert job.offline_since == {} and "node 'b' is back; its profile is asked for again" in job.events[-1]
    # asked again with the same request id: a service that restarted lost the request; one that
    # kept it ignores the duplicate (node/agent/requests.py), and only the first answer counts
    assert eff == [J.Profile("j", ((rid, "b"),))]
    job, _ = J.handle(job, J.Tick(), c(12))  # back: no offline clock runs for it any more
    job, _ = J.handle(job, profiled(job, "b"), c(13))
    assert "b" in job.profiles and job.waiting == ("a", "c")
    # c drops off and stays away: its profile counts as failed, the job goes on without it
    job, _ = J.handle(job, J.NodeDown("c"), c(14, ("a", "b")))
    job, _ = J.handle(job, profiled(job, "a"), c(15, ("a", "b")))
    job, eff = J.handle(job, J.Tick(), c(19.5, ("a", "b")))
    assert kinds(eff) == ["Respond", "Assign"] and [e.node_id for e in eff[1].plan.entries] == ["a", "b"]
    assert any("leaving out 'c': it could not profile: went offline for more than 5 s while profiling" in e
               for e in job.events), job.events
    # the owner staying away refuses the job (as any unusable owner does before acceptance)
    job, _ = J.new_job("k", SPEC, "t2", c(0))
    job, _ = J.handle(job, inspected(job), c(1))
    job, _ = J.handle(job, J.NodeDown("a"), c(2, ("b", "c")))
    assert job.phase == "profiling"
    job, eff = J.handle(job, J.Tick(), c(7.5, ("b", "c")))
    assert job.phase == "failed" and "went offline for more than 5 s while profiling" in job.error
    assert J.finished(replace(job, offline_since={"b": 3.0})).offline_since == {}  # the history keeps none
