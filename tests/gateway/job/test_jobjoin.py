"""A node that joins a running job (`xronos.gateway.job.join`, issue 14), through the pure job state
machine: events in by hand, effects out. The planner is injected (`Ctx.planner`): its predicted
iteration time is a function of the nodes it is given, so each test sets the gain it wants."""

from __future__ import annotations

from dataclasses import replace

import pytest

from xronos.gateway.job import machine as J
from xronos.gateway.job.progress import state_view
from xronos.protocol import messages as m
from xronos.protocol.layout import Sizes

SPEC = m.JobSpec(name="t", owner="a",
                 recipe=m.Recipe(model_dir="/m", data_path="/d.csv", task="classify", batch_size=4, seq_len=16,
                                 lr=1e-4, max_steps=100, export_dir="/out"),
                 checkpoint_interval=10)
ARCH = m.ArchSpec(family="bert", hidden_size=32, num_layers=2, num_heads=6, num_kv_heads=6,
                  intermediate_size=60, vocab_size=120, max_positions=64, num_labels=2, tie_word_embeddings=True)
CAPS = m.Capabilities(node_id="a", hostname="h", arch="x86_64", cpu_model="cpu", cores=2, memory_total=8 << 30,
                      memory_available=4 << 30, torch_version="2", data_host="127.0.0.1", sent_at=1.0)
LAYER = m.LayerProfile(name="blk", kind="blk", partitioned=False, time_s=0.1, time_samples=[], weight_bytes=1,
                       activation_bytes=1, temp_bytes=1)
TO = J.Timeouts(inspect_s=10, profile_s=20, ack_s=10, stall_s=300, recover_s=100, retry_s=5, regroup_s=2)


def plan(nodes, version, seconds):
    n = len(nodes)
    return m.Plan(job_id="j", version=version, strategy="segment", sizes=Sizes(attn=6, mlp=60, vocab=120),
                  entries=[m.PlanEntry(node_id=node, rank=r, attn=6 // n + (r < 6 % n), mlp=60 // n + (r < 60 % n),
                                       vocab=120 // n + (r < 120 % n),
                                       predicted_compute_s=seconds, predicted_memory=1.0, memory_cap=2.0)
                           for r, node in enumerate(nodes)],
                  predicted_iteration_s=seconds, ideal_iteration_s=seconds, comm_s=0.0)


def planner(per_node=None, fail_with=None):
    """Predicted seconds: 1/N (every node as fast), or `per_node[N]`; ValueError for `fail_with` nodes."""
    def plans(job, nodes, version, ctx):
        if fail_with is not None and len(nodes) == fail_with:
            raise ValueError("node 'c' would need 900 MiB of 512")
        return plan(nodes, version, (per_node or {}).get(len(nodes), 1.0 / len(nodes)))
    return plans


def ctx(now, online=("a", "b", "c"), plans=None, join=J.JoinPolicy()):
    return J.Ctx(now=now, online=frozenset(online), timeouts=TO, planner=plans or planner(), join=join)


def report(node, rid, **changes):
    r = m.ProfileReport(node_id=node, request_id=rid, job_id="j", capabilities=CAPS.model_copy(
        update={"node_id": node}), arch=ARCH, task="classify", batch_size=4, seq_len=16, threads=1, sizes=ARCH.sizes(),
        num_blocks=2, layers=[LAYER], profile_seconds=1.0, created_at=1.0)
    return r.model_copy(update=changes)


def metric(node, rank, step, version=1, iteration_s=1.0):
    return J.Metrics(m.IterationMetrics(job_id="j", plan_version=version, node_id=node, rank=rank, step=step, epoch=0,
                                        loss=1.0, compute_s=0.5, comm_s=0.01, idle_s=0.02, iteration_s=iteration_s,
                                        voluntary_ctx_switches=1, involuntary_ctx_switches=0, peak_rss=1))


def status(node, rank, st="running", version=1, **kw):
    return J.Status(m.NodeJobStatus(node_id=node, job_id="j", plan_version=version, rank=rank, status=st,
                                    step=kw.pop("step", 0), epoch=0, sent_at=1.0, **kw))


def running(spec=SPEC, plans=None):
    """A job running on a and b (c offline), 5 steps done at 1 s each, its restart measured: 8 s."""
    job, _ = J.new_job("j", spec, "t1", ctx(0, ("a", "b")))
    rid = job.requests[0][0]
    job, _ = J.handle(job, J.Inspected(m.InspectReport(node_id="a", request_id=rid, job_id="j", ok=True, arch=ARCH,
                                                       train_rows=400, eval_rows=4, total_steps=100)), ctx(1, ("a", "b")))
    for rid, node in job.requests:
        job, eff = J.handle(job, J.Profiled(node, rid, report(node, rid)), ctx(2, ("a", "b"), plans))
    assert [type(e).__name__ for e in eff] == ["Respond", "Assign"] and job.assigned_at == 2
    for n in job.plan_nodes:
        job, _ = J.handle(job, J.Acked(n, 1, True), ctx(4, ("a", "b")))
    assert job.phase == "running" and job.plan_nodes == ("a", "b")
    for step in range(1, 6):
        for r, n in enumerate(job.plan_nodes):
            job, _ = J.handle(job, metric(n, r, step), ctx(9 + step, ("a", "b")))
    assert job.restart_s == 8.0 and job.assigned_at is None  # t=2 assignment, t=10 rank 0's first metrics
    return job


def comes_online(job, node="c", now=20, **kw):
    """NodeUp, then the profile it asks for."""
    job, eff = J.handle(job, J.NodeUp(node), ctx(now, **kw))
    assert [type(e).__name__ for e in eff] == ["Profile"] and job.requests == ()  # apart from other phases
    (rid, asked), = eff[0].requests
    assert asked == node and job.join_requests == ((rid, node),)
    assert "profiling it for the job's next plan" in job.events[-1]
    return J.handle(job, J.Profiled(node, rid, report(node, rid)), ctx(now + 1, **kw))


def test_a_node_that_comes_online_is_taken_at_the_next_checkpoint():
    job, eff = comes_online(running())
    assert eff == [] and job.join_plan is not None and job.join_plan_nodes == ("a", "b", "c")
    assert job.join_plan.version == 2 and job.join_after == 0 and "c" in job.profiles
    taken = job.events[-1]
    # 1/2 -> 1/3 s predicted: -33 %; over the 90 steps after step 10 at the measured 1 s: ~30 s
    # saved against the measured 8 s restart plus the iteration redone.
    assert "node 'c' taken for plan v2 at the checkpoint of step 10: predicted 0.5 -> 0.333 s/iteration" in taken
    assert "(33.3% faster)" in taken and "~30.0 s saved over 90 steps" in taken and "~9.0 s (measured" in taken
    assert job.last_replan_reason in taken and job.replans == 0
    job, eff = J.handle(job, status("b", 1, checkpoint_step=10), ctx(30))  # only the owner's checkpoint counts
    assert eff == [] and job.phase == "running"
    job, eff = J.handle(job, status("a", 0, checkpoint_step=10, step=10), ctx(31))
    assert eff[0] == J.Control("j", 1, ("a", "b"), "cancel")
    assert isinstance(eff[1], J.Assign) and eff[1].resume_step == 10 and eff[1].plan.version == 2
    assert [e.node_id for e in eff[1].plan.entries] == ["a", "b", "c"]
    assert job.phase == "assigning" and job.join_plan is None and job.recoveries == 0 and job.replans == 1
    assert job.last_replan_reason == "node 'c' joins: plan v1 -> v2, predicted 0.5 -> 0.333 s/iteration"
    assert any(e.endswith("node 'c' joins: plan v1 -> v2, predicted 0.5 -> 0.333 s/iteration; resuming from step 10")
               for e in job.events)
    for n in ("a", "b", "c"):
        job, eff = J.handle(job, J.Acked(n, 2, True), ctx(33))
    assert job.phase == "running" and eff == [J.Control("j", 2, ("a", "b", "c"), "start")]
    view = state_view(job)
    assert view.replans == 1 and "joins" in view.last_replan_reason and view.plan.version == 2
    # The restart is measured again under the new plan: assigned at 31, rank 0's first metrics at 40.
    job, _ = J.handle(job, metric("a", 0, 11, version=2), ctx(40))
    assert job.restart_s == 9.0


def test_not_taken_when_the_gain_is_below_the_bar():
    job, _ = comes_online(running(plans=planner({2: 0.5, 3: 0.49})), plans=planner({2: 0.5, 3: 0.49}))
    assert job.join_plan is None and job.replans == 0
    assert "node 'c' not taken: predicted 0.5 -> 0.49 s/iteration (2.0% faster): the bar is 5% faster" in job.events[-1]
    assert job.last_replan_reason in job.events[-1]
    job, eff = J.handle(job, status("a", 0, checkpoint_step=10), ctx(31))
    assert eff == [] and job.phase == "running" and job.plan_version == 1


def test_not_taken_when_a_restart_is_not_repaid():
    slow_restart = J.JoinPolicy(restart_s=100.0)
    job, _ = comes_online(running(), join=slow_restart)
    assert job.join_plan is None
    assert ("not taken: predicted 0.5 -> 0.333 s/iteration (33.3% faster) would save ~30.0 s over the 90 steps after "
            "the checkpoint at step 10, not a restart's ~101.0 s (the gateway's join_restart_s)") in job.events[-1]
    # Without a measurement the default stands in, and says so.
    job, _ = comes_online(replace(running(), restart_s=None), now=50, join=J.JoinPolicy(default_restart_s=40.0))
    assert job.join_plan is None and "~41.0 s (a default: not measured)" in job.events[-1]


def test_not_taken_without_a_checkpoint_left_before_the_end():
    job, _ = comes_online(running(spec=SPEC.model_copy(update={"checkpoint_interval": 100})))
    assert job.join_plan is None
    assert ("node 'c' not taken: no checkpoint left to restart from before the job's end (the next would be at "
            "step 100 of 100; checkpoint_interval 100)") in job.events[-1]


def test_not_taken_when_the_planner_cannot_place_it_and_the_job_goes_on():
    job, eff = comes_online(running(), plans=planner(fail_with=3))
    assert eff == [] and job.join_plan is None and job.phase == "running"
    assert "node 'c' not taken: no plan with it: node 'c' would need 900 MiB of 512" in job.events[-1]


def test_not_taken_when_it_cannot_profile():
    job, eff = J.handle(running(), J.NodeUp("c"), ctx(20))
    (rid, _), = eff[0].requests
    late, _ = J.handle(job, J.Profiled("c", "j.99", report("c", "j.99")), ctx(21))  # not the request sent
    assert late == job
    job, _ = J.handle(job, J.Profiled("c", rid, None, "no torch"), ctx(21))
    assert job.join_requests == () and "node 'c' not taken: could not profile: no torch" in job.events[-1]
    job, eff = J.handle(job, J.NodeUp("c"), ctx(22))  # back again later: asked again
    (rid, _), = eff[0].requests
    job, _ = J.handle(job, J.Profiled("c", rid, report("c", rid, seq_len=32)), ctx(23))
    assert "could not profile: its report's seq_len does not match the request" in job.events[-1]


def test_only_a_node_the_job_may_use_and_only_with_rebalance_on():
    named = running(spec=SPEC.model_copy(update={"nodes": ["a", "b"]}))
    assert J.handle(named, J.NodeUp("c"), ctx(20)) == (named, [])
    off = running(spec=SPEC.model_copy(update={"rebalance": False}))
    assert J.handle(off, J.NodeUp("c"), ctx(20)) == (off, [])
    job = running()
    assert J.handle(job, J.NodeUp("b"), ctx(20)) == (job, [])  # already in the plan


def test_a_node_already_profiled_is_considered_at_once():
    job = running()
    job = replace(job, profiles={**job.profiles, "c": report("c", "j.9")})
    job, eff = J.handle(job, J.NodeUp("c"), ctx(20))
    assert eff == [] and job.join_plan_nodes == ("a", "b", "c")


def test_a_newcomer_that_goes_offline_drops_its_request_or_its_join():
    job, eff = J.handle(running(), J.NodeUp("c"), ctx(20))
    (rid, _), = eff[0].requests
    job, _ = J.handle(job, J.NodeDown("c"), ctx(21, ("a", "b")))
    assert job.join_requests == () and job.phase == "running"
    job, _ = J.handle(job, J.Profiled("c", rid, report("c", rid)), ctx(22, ("a", "b")))  # a late answer
    assert job.join_plan is None and "c" not in job.profiles

    job, _ = comes_online(running())
    assert job.join_plan is not None
    job, eff = J.handle(job, J.NodeDown("c"), ctx(25, ("a", "b")))
    assert eff == [] and job.join_plan is None and job.phase == "running"
    assert "join dropped: node 'c' went offline before the checkpoint" in job.events[-1]
    job, eff = J.handle(job, status("a", 0, checkpoint_step=10), ctx(31, ("a", "b")))
    assert eff == [] and job.plan_version == 1


def test_a_newcomer_switched_off_before_the_checkpoint_is_not_assigned():
    job, _ = comes_online(running())
    job, eff = J.handle(job, status("a", 0, checkpoint_step=10), ctx(31, ("a", "b")))  # c: no NodeDown, not usable
    assert eff == [] and job.plan_version == 1 and job.join_plan is None and job.phase == "running"
    assert "join dropped at the checkpoint: node 'c' offline or not participating" in job.events[-1]


def test_completion_or_cancel_while_a_join_waits_ends_the_job_as_usual():
    job, _ = comes_online(running())
    done, eff = J.handle(job, status("a", 0, "completed", step=100, export_dir="/out"), ctx(30))
    assert done.phase == "completed" and eff == [] and J.finished(done).join_plan is None
    cancelled, eff = J.handle(job, J.Command("cancel", "x"), ctx(30))
    assert cancelled.phase == "cancelled" and J.Control("j", 1, ("a", "b"), "cancel") in eff
    assert not any(isinstance(e, J.Assign) for e in eff) and J.finished(cancelled).join_plan is None


def test_a_lost_node_while_a_join_waits_recovers_with_every_online_node():
    job, _ = comes_online(running())
    job, eff = J.handle(job, J.NodeDown("b"), ctx(25, ("a", "c")))
    assert job.phase == "assigning" and job.join_plan is None and job.recoveries == 1 and job.replans == 0
    assert any("join dropped: the job is recovering" in e for e in job.events)
    assert [e.node_id for e in eff[-1].plan.entries] == ["a", "c"] and eff[-1].resume_step == 0


def test_a_pause_or_a_pending_re_shard_at_the_checkpoint():
    job, _ = comes_online(running())
    job = replace(job, pending_plan=job.plan)  # a live re-shard ordered, not applied yet
    job, _ = J.handle(job, J.Command("pause", "p"), ctx(28))
    assert job.phase == "paused" and job.join_plan is not None
    job, eff = J.handle(job, status("a", 0, "paused", checkpoint_step=10, step=10), ctx(30))
    assert job.phase == "assigning" and job.pending_plan is None and job.want_paused
    for n in ("a", "b", "c"):
        job, eff = J.handle(job, J.Acked(n, 2, True), ctx(33))
    assert job.phase == "paused" and [c.action for c in eff] == ["start", "pause"]


def test_a_gateway_restart_keeps_a_join_taken_and_asks_again_for_a_profile_in_flight():
    job, _ = J.handle(running(), J.NodeUp("c"), ctx(20))
    job, eff = J.restart(job, ctx(21))
    assert eff == [] and job.join_requests == () and job.phase == "running"
    job, eff = J.handle(job, J.NodeUp("c"), ctx(22))  # the retained availability, after the restart
    assert [type(e).__name__ for e in eff] == ["Profile"]

    job, _ = comes_online(running())
    job, eff = J.restart(job, ctx(30))
    assert job.join_plan is not None and eff == []
    before = len(job.events)
    job, eff = J.handle(job, J.NodeUp("c"), ctx(31))
    assert eff == [] and len(job.events) == before  # already taken: not again
    job, eff = J.handle(job, status("a", 0, checkpoint_step=10), ctx(32))
    assert isinstance(eff[1], J.Assign) and eff[1].resume_step == 10


def test_a_second_newcomer_is_planned_with_the_first_and_a_worse_plan_leaves_the_first_join_standing():
    four = ("a", "b", "c", "d")
    job, _ = comes_online(running(), online=four)
    taken, _ = comes_online(job, "d", now=25, online=four)
    assert taken.join_plan_nodes == four and taken.join_newcomers == ("c", "d")
    assert "nodes 'c', 'd' taken for plan v2" in taken.events[-1]
    kept, _ = comes_online(job, "d", now=25, online=four, plans=planner(fail_with=4))
    assert kept.join_plan_nodes == ("a", "b", "c")
    assert kept.events[-1].endswith("; the join of node 'c' taken before stands")


def test_the_gateway_config_bounds_the_join_settings(tmp_path):
    from xronos.gateway.config import ConfigError, load_config

    path = tmp_path / "gateway.toml"
    path.write_text("join_min_gain = 0.1\njoin_restart_s = 12.5\n")
    cfg = load_config(path, env={})
    assert (cfg.join_min_gain, cfg.join_restart_s) == (0.1, 12.5)
    path.write_text("join_min_gain = 1.5\n")
    with pytest.raises(ConfigError, match="join_min_gain"):
        load_config(path, env={})
    path.write_text("join_restart_s = -1\n")
    with pytest.raises(ConfigError, match="join_restart_s"):
        load_config(path, env={})


def test_a_newcomer_whose_profile_looks_disturbed_says_so_on_the_timeline():
    job, _ = J.handle(running(), J.NodeUp("c"), ctx(20))
    (rid, _), = job.join_requests
    warnings = ("node c: layer 'blk.mlp' took 4.000 ms at share 0.25 but 3.000 ms at share 1: ...", "second")
    job, _ = J.handle(job, J.Profiled("c", rid, report("c", rid), warnings=warnings), ctx(21))
    assert any(e.endswith(f"warning: {warnings[0]} (and 1 more layers)") for e in job.events), job.events
    assert job.join_plan is not None  # still used
