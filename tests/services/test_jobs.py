"""The job state machine with plain data: every path from submit to an end, driven by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from xronos.gateway import jobs as J
from xronos.gateway.progress import state_view

SPEC = {"name": "t", "owner": "a", "model_dir": "/m", "data_path": "/d.csv", "task": "classify",
        "batch_size": 4, "seq_len": 16, "lr": 1e-4, "max_steps": 10, "export_dir": "/out", "nodes": None}
ARCH = {"family": "bert", "hidden_size": 32}
TO = J.Timeouts(inspect_s=10, profile_s=20, ack_s=10, stall_s=30, recover_s=100, retry_s=5, regroup_s=2,
                max_recoveries=3)


def ctx(now=0.0, online=("a", "b", "c"), busy=False):
    return J.Ctx(now=now, online=frozenset(online), timeouts=TO, busy=busy)


def plan(nodes, version):
    return {"job_id": "j", "version": version, "strategy": "segment",
            "sizes": {"attn": len(nodes), "mlp": 32 * len(nodes), "vocab": 32 * len(nodes)},
            "entries": [{"node_id": n, "rank": r, "attn": 1, "mlp": 32, "vocab": 32, "predicted_compute_s": 0.1,
                         "predicted_memory": 1.0, "memory_cap": 2.0} for r, n in enumerate(nodes)],
            "predicted_iteration_s": 0.1, "ideal_iteration_s": 0.1, "comm_s": 0.0}


def kinds(effects):
    return [type(e).__name__ for e in effects]


def submit_to_running(spec=SPEC, online=("a", "b", "c")):
    job, eff = J.new_job("j", spec, "t1", ctx(online=online))
    assert eff == [J.Inspect("j", "a")] and job.awaiting == "inspect"
    job, eff = J.handle(job, J.Inspected("a", True, ARCH, 10), ctx(1))
    assert job.phase == "profiling" and eff == [J.Profile("j", ("a",) + tuple(n for n in online if n != "a"))]
    for n in job.waiting:
        job, eff = J.handle(job, J.Profiled(n, {"node_id": n}), ctx(2))
    assert job.phase == "planning" and isinstance(eff[0], J.MakePlan) and eff[0].nodes[0] == "a"
    job, eff = J.handle(job, J.Planned(plan(eff[0].nodes, eff[0].version)), ctx(3))
    assert kinds(eff) == ["Respond", "Assign"] and eff[0].ok and eff[0].transaction == "t1"
    assert job.phase == "assigning" and job.accepted
    for n in job.plan_nodes:
        job, eff = J.handle(job, J.Acked(n, job.plan_version, True), ctx(4))
    assert job.phase == "running" and eff == [J.Control("j", 1, job.plan_nodes, "start")]
    return job


def metric(node, rank, step, version=1, **kw):
    m = {"job_id": "j", "plan_version": version, "node_id": node, "rank": rank, "step": step, "epoch": 0,
         "loss": 1.0 / step, "compute_s": 0.1 * (rank + 1), "comm_s": 0.01, "idle_s": 0.02,
         "iteration_s": 0.2}
    return J.Metrics({**m, **kw})


def status(node, rank, st, version=1, **kw):
    return J.Status({"node_id": node, "job_id": "j", "plan_version": version, "rank": rank, "status": st,
                     "step": kw.pop("step", 0), "epoch": 0, **kw})


def test_happy_path_metrics_and_completion():
    job = submit_to_running()
    for step in (1, 2, 3):
        for r, n in enumerate(job.plan_nodes):
            job, _ = J.handle(job, metric(n, r, step), ctx(5 + step))
    view = state_view(job)
    assert view["step"] == 3 and view["loss"] == pytest.approx(1 / 3)
    assert view["measured_s"] == {"a": pytest.approx(0.1), "b": pytest.approx(0.2), "c": pytest.approx(0.3)}
    assert view["idle_ratio"]["a"] == pytest.approx(0.1) and view["eta_s"] == pytest.approx(7 * 0.2)
    assert view["predicted_s"] == {"a": 0.1, "b": 0.1, "c": 0.1}
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


@pytest.mark.parametrize("online, reason", [(("b", "c"), "owner node 'a' is offline")])
def test_refused_when_owner_offline(online, reason):
    job, eff = J.new_job("j", SPEC, "t1", ctx(online=online))
    assert job.phase == "failed" and reason in job.error
    assert eff == [J.Respond("job/submit", "t1", False, {"job_id": "j"}, job.error)]


def test_refused_when_named_node_offline_or_owner_not_named():
    job, eff = J.new_job("j", {**SPEC, "nodes": ["a", "x"]}, "t", ctx())
    assert job.phase == "failed" and "x offline" in job.error
    job, eff = J.new_job("j", {**SPEC, "nodes": ["b"]}, "t", ctx())
    assert "must be one of" in job.error


def test_refused_when_inspection_fails_or_times_out():
    job, _ = J.new_job("j", SPEC, "t", ctx())
    bad, eff = J.handle(job, J.Inspected("a", False, error="data_path: /d.csv does not exist"), ctx(1))
    assert bad.phase == "failed" and "does not exist" in bad.error and not eff[0].ok
    late, eff = J.handle(job, J.Tick(), ctx(11))
    assert late.phase == "failed" and "did not answer" in late.error and not eff[0].ok
    down, eff = J.handle(job, J.NodeDown("a"), ctx(1))
    assert down.phase == "failed" and "went offline" in down.error


def test_refused_when_plan_cannot_fit():
    job, _ = J.new_job("j", SPEC, "t", ctx())
    job, _ = J.handle(job, J.Inspected("a", True, ARCH, 10), ctx(1))
    for n in ("a", "b", "c"):
        job, eff = J.handle(job, J.Profiled(n, {}), ctx(2))
    job, eff = J.handle(job, J.Planned(None, "node a needs 3 GB, cap 1 GB"), ctx(3))
    assert job.phase == "failed" and eff[0].error == "plan cannot fit: node a needs 3 GB, cap 1 GB"
    assert eff[0].transaction == "t" and not job.accepted


def test_unnamed_node_that_cannot_profile_is_left_out():
    job, _ = J.new_job("j", SPEC, "t", ctx())
    job, _ = J.handle(job, J.Inspected("a", True, ARCH, 10), ctx(1))
    job, _ = J.handle(job, J.Profiled("a", {}), ctx(2))
    job, _ = J.handle(job, J.Profiled("b", None, "no torch"), ctx(2))
    job, eff = J.handle(job, J.Tick(), ctx(30))  # c never answers
    assert eff == [J.MakePlan("j", ("a",), 1)] and set(job.excluded) == {"b", "c"}
    named, _ = J.new_job("j", {**SPEC, "nodes": ["a", "b"]}, "t", ctx())
    named, _ = J.handle(named, J.Inspected("a", True, ARCH, 10), ctx(1))
    named, eff = J.handle(named, J.Profiled("b", None, "no torch"), ctx(2))
    assert named.phase == "failed" and "no torch" in named.error


def test_node_loss_recovers_from_checkpoint_on_survivors():
    job = submit_to_running()
    job, _ = J.handle(job, status("a", 0, "running", checkpoint_step=4, step=5), ctx(5))
    job, eff = J.handle(job, J.NodeDown("c"), ctx(6, online=("a", "b")))
    assert job.phase == "recovering" and job.recoveries == 1
    assert eff[0] == J.Control("j", 1, ("a", "b", "c"), "cancel")
    assert eff[1] == J.MakePlan("j", ("a", "b"), 2)  # profiles cached: straight to planning
    job, eff = J.handle(job, J.Planned(plan(("a", "b"), 2)), ctx(7, online=("a", "b")))
    assert eff == [J.Assign("j", plan(("a", "b"), 2), 4)] and job.phase == "assigning"
    assert job.step == 4
    job, _ = J.handle(job, J.Acked("a", 1, True), ctx(7))  # stale version: ignored
    assert job.waiting == ("a", "b")
    for n in ("a", "b"):
        job, eff = J.handle(job, J.Acked(n, 2, True), ctx(8))
    assert job.phase == "running" and eff == [J.Control("j", 2, ("a", "b"), "start")]
    assert any("recovering: node 'c' went offline" in e for e in job.events)
    job, _ = J.handle(job, status("c", 2, "failed", version=1), ctx(9))  # late, old plan
    assert job.phase == "running"


def test_rank_failure_and_waiting_for_memory_or_owner():
    job = submit_to_running()
    job, eff = J.handle(job, status("b", 1, "failed", detail="Gloo timeout"), ctx(5))
    assert job.phase == "recovering" and "Gloo timeout" in job.events[-1] and job.awaiting == "retry"
    assert eff == [J.Control("j", 1, ("a", "b", "c"), "cancel")]  # then wait for last-wills
    job, eff = J.handle(job, J.Tick(), ctx(6))
    assert eff == []
    job, eff = J.handle(job, J.Tick(), ctx(7.5))
    assert eff == [J.MakePlan("j", ("a", "b", "c"), 2)]
    job, eff = J.handle(job, J.Planned(None, "b needs 9 GB"), ctx(8))
    assert job.phase == "recovering" and job.awaiting == "retry"
    job, eff = J.handle(job, J.NodeDown("a"), ctx(7, online=("b", "c")))
    assert eff == []
    job, eff = J.handle(job, J.Tick(), ctx(14, online=("b", "c")))
    assert job.awaiting == "retry" and "waiting for the owner" in job.events[-1]
    job, eff = J.handle(job, J.NodeUp("a"), ctx(15))
    assert eff == [J.MakePlan("j", ("a", "b", "c"), 2)]
    job, eff = J.handle(job, J.Tick(), ctx(200))
    assert job.phase == "failed" and "could not recover" in job.error


def test_refused_assignment_excludes_node_until_it_reconnects():
    job, _ = J.new_job("j", SPEC, "t", ctx())
    job, _ = J.handle(job, J.Inspected("a", True, ARCH, 10), ctx(1))
    for n in ("a", "b", "c"):
        job, eff = J.handle(job, J.Profiled(n, {}), ctx(2))
    job, eff = J.handle(job, J.Planned(plan(("a", "b", "c"), 1)), ctx(3))
    job, eff = J.handle(job, J.Acked("b", 1, False, "busy"), ctx(4))
    assert job.phase == "recovering" and eff[-1] == J.MakePlan("j", ("a", "c"), 2)
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
    job, _ = J.handle(job, J.NodeDown("c"), ctx(5, online=("a", "b")))
    job, eff = J.handle(job, J.Command("pause", "p"), ctx(6))
    assert eff[-1].ok and job.want_paused
    job, _ = J.handle(job, J.Planned(plan(("a", "b"), 2)), ctx(7))
    for n in ("a", "b"):
        job, eff = J.handle(job, J.Acked(n, 2, True), ctx(8))
    assert job.phase == "paused" and [e.action for e in eff] == ["start", "pause"]


def test_stall_and_ack_timeouts_recover():
    job = submit_to_running()
    job, _ = J.handle(job, J.Tick(), ctx(40))
    assert job.phase == "recovering" and "no progress" in job.events[-1]


def test_schedule_runs_one_job_at_a_time():
    first = submit_to_running()
    second, _ = J.new_job("k", {**SPEC, "name": "k"}, "t2", ctx(10))
    second, _ = J.handle(second, J.Inspected("a", True, ARCH, 10), ctx(11))
    for n in ("a", "b", "c"):
        second, eff = J.handle(second, J.Profiled(n, {}), ctx(12))
    second, eff = J.handle(second, J.Planned(plan(("a", "b", "c"), 1)), ctx(13, busy=True))
    assert second.phase == "queued" and second.accepted and kinds(eff) == ["Respond"]
    table = {"j": first, "k": second}
    assert J.schedule(table, ctx(14)) == (table, [])
    table["j"] = replace(first, phase="completed")
    table, eff = J.schedule(table, ctx(15))
    assert table["k"].phase == "planning" and eff == [J.MakePlan("k", ("a", "b", "c"), 1)]


def test_restart_reissues_what_was_awaited():
    job, _ = J.new_job("j", SPEC, "t", ctx())
    again, eff = J.restart(job, ctx(50))
    assert eff == [J.Inspect("j", "a")] and again.deadline == 60
    running = submit_to_running()
    again, eff = J.restart(running, ctx(50))
    assert eff == [] and again.phase == "running" and again.deadline == 80
    assigning = replace(running, phase="assigning", awaiting="acks", waiting=("b",))
    again, eff = J.restart(assigning, ctx(50))
    assert eff == [J.Assign("j", running.plan, 0)] and again.waiting == ("a", "b", "c")


def test_plan_preview_answers_and_ends():
    job, _ = J.new_job("p", SPEC, "t9", ctx(), respond_to="plan/preview")
    job, _ = J.handle(job, J.Inspected("a", True, ARCH, 10), ctx(1))
    for n in ("a", "b", "c"):
        job, eff = J.handle(job, J.Profiled(n, {}), ctx(2))
    job, eff = J.handle(job, J.Planned(plan(("a", "b", "c"), 1)), ctx(3))
    assert job.phase == "completed" and eff == [J.Respond("plan/preview", "t9", True,
                                                          {"plan": plan(("a", "b", "c"), 1)})]
