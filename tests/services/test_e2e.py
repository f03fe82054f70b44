"""End to end over a real broker: a gateway and three node processes run a job; the exported
model equals `xronos run` for the same spec and plan; the gateway is killed mid-job and restarted
without losing anything; a node killed mid-job is survived from the last checkpoint."""

from __future__ import annotations

import time

import pytest

from jobkit import job_spec, make_case, runkit
from stack import Stack
from xronos.cli.main import main as xronos
from xronos.protocol import messages as m

pytestmark = pytest.mark.slow


def _load(path):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(str(path))


def _wait_step(stack: Stack, job_id: str, at_least: int, timeout: float = 180.0) -> m.JobState:
    seen: list[m.JobState] = []

    def on_state(s: m.JobState) -> None:
        seen.append(s)
        if s.step >= at_least or s.phase in ("completed", "failed", "cancelled"):
            raise StopIteration

    try:
        stack.client.follow(job_id, on_state, timeout=timeout)
    except StopIteration:
        pass
    return seen[-1]


def test_job_end_to_end_survives_gateway_restart_and_equals_xronos_run(stack, tmp_path):
    model, data = make_case(stack.allowed, rows=80)
    stack.gateway()
    for n in ("n0", "n1", "n2"):
        stack.node(n)
    stack.wait_nodes(3)
    # The reference is the plan's one layout: no live re-balancing here (test_e2e_rebalance has it).
    # The job overlaps its all-reduces with compute in two chunks (the reference does not:
    # only the timing may differ).
    spec = job_spec(model, data, stack.allowed / "export", owner="n0", max_steps=24, checkpoint_interval=8,
                    strategy="segment", rebalance=False, overlap="on", chunks=2)
    spec.pop("schema_version")
    accepted = stack.client.request("job/submit", 300.0, spec=m.JobSpec(**spec))
    job_id, plan = accepted["job_id"], accepted["plan"]
    assert accepted["total_steps"] == 24 and plan["entries"][0]["node_id"] == "n0"
    assert plan["overlap"] == {"backward": True, "chunks": 2}, plan

    state = _wait_step(stack, job_id, 4)
    assert state.phase == "running", stack.logs()
    stack.kill("gateway")  # SIGKILL: its last-will says offline; the nodes keep training
    time.sleep(1.0)
    stack.gateway()
    final = stack.client.follow(job_id, lambda s: None, timeout=240)
    assert final.phase == "completed", (final, stack.logs())
    assert any("gateway restarted" in e for e in final.events)
    assert final.step == 24 and final.eval_metric_name == "accuracy" and final.eval_metric is not None
    # Metrics published while no gateway listened are gone; the aggregate covers the rest.
    assert set(final.idle_ratio) <= {e["node_id"] for e in plan["entries"]}
    # The owner removes a completed job's checkpoints once its rank has exited (the export is written)
    ckpt = stack.dir / "n0" / "jobs" / job_id / "checkpoint"
    deadline = time.monotonic() + 60
    while any(p.exists() for p in (ckpt, ckpt.with_name("checkpoint.prev"))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ckpt.exists() and not ckpt.with_name("checkpoint.prev").exists(), stack.logs()

    units = final.plan.layout()
    ref = tmp_path / "ref"
    assert xronos(runkit.run_argv(model, data, "classify", units, ref, steps=24, lr=1e-4, seed=3,
                                  extra=("--eval-fraction", "0.2", "--dropout", "0"))) == 0
    max_abs, rel = runkit.compare(_load(stack.allowed / "export"), _load(ref))
    assert max_abs <= 5e-4 and rel <= 1e-5


def test_node_killed_mid_job_is_survived_from_the_last_checkpoint(stack):
    model, data = make_case(stack.allowed, rows=80)
    stack.gateway()
    for n in ("n0", "n1", "n2"):
        stack.node(n)
    stack.wait_nodes(3)
    spec = job_spec(model, data, stack.allowed / "export", owner="n0", max_steps=40, checkpoint_interval=10,
                    batch_size=8)
    spec.pop("schema_version")
    accepted = stack.client.request("job/submit", 300.0, spec=m.JobSpec(**spec))
    job_id = accepted["job_id"]
    victim = accepted["plan"]["entries"][-1]["node_id"]
    assert victim != "n0"
    state = _wait_step(stack, job_id, 22)
    assert state.phase == "running", stack.logs()
    stack.kill(victim)
    final = stack.client.follow(job_id, lambda s: None, timeout=300)
    assert final.phase == "completed", (final, stack.logs())
    assert [e.node_id for e in final.plan.entries] != [e["node_id"] for e in accepted["plan"]["entries"]]
    assert victim not in {e.node_id for e in final.plan.entries}
    recovered = [e for e in final.events if "recovering" in e]
    # The plan that replaced the one the victim was in, not "plan v2": a clean-clone CI run found a
    # "plan v2 ... resume from step 0" in a job killed at step 30 — most likely an earlier recovery
    # at the job's start (under load a rank may fail there), whose plan resumed from step 0.
    replaced = f"plan v{state.plan.version + 1} ("
    resumed = [e for e in final.events if "resume from step" in e and replaced in e]
    assert recovered and resumed, final.events
    resume_step = int(resumed[0].rsplit("resume from step ", 1)[1])
    # At most one checkpoint interval lost — or two when the kill lands while the owner writes the
    # newest checkpoint: the gateway then names the one before it, which the owner keeps
    # (`checkpoint.prev`; seen once in a clean-clone CI: resumed from 20 at step 30).
    assert resume_step >= (state.step // 10) * 10 - 10, final.events
