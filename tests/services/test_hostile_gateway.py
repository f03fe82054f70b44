"""Issue 15's classes of hostile input against the gateway, one regression test each (over the
in-memory FakeBus; the fuzzer in test_fuzz.py sends thousands more to the real services on a real
Mosquitto). Each of these broke `main` before: a crash of the control loop, a crash loop over
restarts, a job completed or cancelled by the wrong node, unbounded growth."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import msgpack
import pytest

from test_gateway_glue import NODES, SPEC, Harness, T, announce, report, submit_to_inspection, submit_until_assigned
from xronos.gateway.job import machine as J
from xronos.gateway.service import STATE_EVERY_S
from xronos.protocol import messages as m
from xronos.protocol.codec import decode

SURROGATE = '"\\ud800"'  # JSON text of a lone UTF-16 surrogate


def spec_json(**changes) -> dict:
    """The spec's JSON with `changes`, a recipe's field into its recipe."""
    doc = SPEC.model_dump(mode="json")
    recipe = {k: changes.pop(k) for k in list(changes) if k in doc["recipe"]}
    return {**doc, **changes, "recipe": {**doc["recipe"], **recipe}}


def alive(h: Harness) -> None:
    """The gateway still answers a normal request (and never raised out of its loop)."""
    h.client.drain()
    (ok,) = h.request("nodes/list", {"transaction": "alive"})
    assert ok.status == "ok" and ok.transaction == "alive"


def running_job(h: Harness) -> tuple[str, list[m.Assignment]]:
    announce(h)
    job_id, assigned = submit_until_assigned(h)
    for a in assigned:
        h.node_says(m.AssignmentAck(job_id=job_id, plan_version=1, node_id=a.node_id, accepted=True), a.node_id)
    h.pump()
    assert h.gw.jobs[job_id].phase == "running"
    return job_id, assigned


# --- exceptions outside dispatch -----------------------------------------------------------------
def test_lone_surrogate_in_a_transaction_is_answered_without_it(tmp_path):
    h = Harness(tmp_path)
    announce(h)
    payload = ('{"transaction": %s, "job_id": 5}' % SURROGATE).encode()
    (err,) = h.request("job/pause", payload)
    assert err.status == "error" and err.transaction is None and "transaction" in err.error
    alive(h)


@pytest.mark.parametrize("field", ["hostname", "cpu_model", "data_host", "torch_version"])
def test_lone_surrogate_in_a_node_message_is_refused_where_it_arrives(tmp_path, field):
    h = Harness(tmp_path)
    announce(h)
    before = m.Capabilities.model_validate_json(h.broker.retained["xronos/node/a/capabilities"])
    caps = before.model_dump(mode="json")
    text = json.dumps({**caps, field: "PLACEHOLDER"}).replace('"PLACEHOLDER"', SURROGATE)
    h.client.publish(T.build("node.capabilities", node_id="a"), text.encode(), retain=True)
    h.pump()
    assert h.gw.reg["a"].capabilities == before  # the old, valid capabilities stay
    assert h.gw.dispatcher.errors["invalid"] >= 1
    alive(h)
    h2 = Harness(tmp_path, h.broker)  # the retained poison does not break a restart either
    h2.pump()
    alive(h2)


def test_lone_surrogate_in_a_spec_is_refused_at_submit_and_never_stored(tmp_path):
    h = Harness(tmp_path)
    announce(h)
    text = json.dumps({"transaction": "s1", "spec": spec_json(model_dir="PLACEHOLDER")})
    (err,) = h.request("job/submit", text.replace('"PLACEHOLDER"', SURROGATE).encode())
    assert err.status == "error" and "spec.recipe.model_dir" in err.error and "surrogate" in err.error
    assert h.gw.jobs == {}
    h2 = Harness(tmp_path, h.broker)
    h2.pump()
    alive(h2)


def test_a_huge_refusal_reason_does_not_overflow_the_job_state(tmp_path):
    """A refusal quoting a ~200 KiB request made the JobState too large to publish."""
    h = Harness(tmp_path)
    announce(h)
    names = ["a"] + [f"{'x' * 240}{i}" for i in range(800)]
    (err,) = h.request("job/submit", {"transaction": "big", "spec": spec_json(nodes=names)})
    assert err.status == "error" and err.transaction == "big" and len(err.error) <= 4096
    time.sleep(STATE_EVERY_S)
    h.pump(3)  # the next publishing turn: a stored, oversized JobState broke the loop here
    alive(h)
    names = ["a"] + [f"n{'x' * 120}{i}" for i in range(200)]  # within the bounds: refused as offline
    (err,) = h.request("job/submit", {"transaction": "many", "spec": spec_json(nodes=names)})
    assert err.status == "error" and "offline" in err.error and len(err.error) <= 1000
    alive(h)


def test_infinite_iteration_time_is_refused_and_the_state_stays_publishable(tmp_path):
    h = Harness(tmp_path)
    job_id, assigned = running_job(h)
    for a in assigned:
        for step in (1, 2, 3):
            fields = dict(job_id=job_id, plan_version=1, node_id=a.node_id, rank=a.rank, step=step, epoch=0,
                          loss=1.0, compute_s=0.1, comm_s=0.0, idle_s=0.0, iteration_s=float("inf"),
                          voluntary_ctx_switches=0, involuntary_ctx_switches=0, peak_rss=1)
            h.client.publish(T.build("node.metrics", node_id=a.node_id), msgpack.packb(fields))
    h.pump()
    h.gw._flush(force=True)
    state = decode(f"xronos/job/{job_id}/state", h.broker.retained[f"xronos/job/{job_id}/state"])
    assert state.phase == "running" and state.eta_s is None and h.gw.dispatcher.errors["invalid"] >= 3
    alive(h)


@pytest.mark.parametrize("field, value", [("step", "1" + "0" * 400), ("checkpoint_step", "1" + "0" * 30),
                                          ("step", "1e400"), ("sent_at", "Infinity")])
def test_huge_numbers_in_a_node_status_are_refused(tmp_path, field, value):
    h = Harness(tmp_path)
    job_id, assigned = running_job(h)
    status = m.NodeJobStatus(node_id="a", job_id=job_id, plan_version=1, rank=0, status="running", sent_at=1.0)
    text = json.dumps({**status.model_dump(mode="json"), field: "PLACEHOLDER"}).replace('"PLACEHOLDER"', value)
    h.client.publish(T.build("node.job", node_id="a"), text.encode(), retain=True)
    h.pump()
    h.gw._flush(force=True)
    job = h.gw.jobs[job_id]
    assert job.checkpoint_step == 0 and job.phase == "running"
    h.gw.bus.kill()
    h2 = Harness(tmp_path, h.broker)  # the retained status arrives again: no crash loop
    h2.pump()
    assert h2.gw.jobs[job_id].phase == "running"
    alive(h2)


def test_huge_memory_in_capabilities_is_refused_and_submits_are_answered(tmp_path):
    """memory_available = 10**400 raised an OverflowError outside the planner's try: the submit was
    never answered and the job sat in planning."""
    h = Harness(tmp_path)
    announce(h)
    caps = json.loads(h.broker.retained["xronos/node/b/capabilities"])
    text = json.dumps({**caps, "memory_available": "PLACEHOLDER"}).replace('"PLACEHOLDER"', "1" + "0" * 400)
    h.client.publish(T.build("node.capabilities", node_id="b"), text.encode(), retain=True)
    h.pump()
    (nodes,) = h.request("nodes/list", {"transaction": "n"})
    assert next(n for n in nodes.data["nodes"] if n["node_id"] == "b")["memory_available"] == 8 << 30
    job_id, assigned = submit_until_assigned(h)  # answered, planned and assigned
    assert assigned and h.gw.jobs[job_id].phase == "assigning"


def test_an_error_in_one_jobs_handling_fails_that_job_alone(tmp_path, monkeypatch):
    h = Harness(tmp_path)
    job_id, _ = running_job(h)
    other = replace(h.gw.jobs[job_id], job_id="other", phase="queued", accepted=True, created_at=1e12)
    h.gw.jobs["other"] = other
    real = J.handle

    def broken(job, event, ctx):
        if job.job_id == job_id:
            raise ZeroDivisionError("a bug in one job's transition")
        return real(job, event, ctx)

    monkeypatch.setattr(J, "handle", broken)
    h.pump(3)  # ticks
    job = h.gw.jobs[job_id]
    assert job.phase == "failed" and "ZeroDivisionError" in job.error and len(job.error) <= 300
    assert h.gw.jobs["other"].phase != "failed" and h.gw.internal_errors >= 1
    alive(h)


def test_a_job_whose_restart_raises_fails_alone(tmp_path, monkeypatch):
    h = Harness(tmp_path)
    announce(h)
    h.client.publish("xronos/gateway/request/job/submit",
                     json.dumps({"transaction": "t", "spec": SPEC.model_dump(mode="json")}).encode())
    h.pump()
    (job_id,) = h.gw.jobs
    h.gw._flush(force=True)
    h.gw.bus.kill()

    def broken(job, ctx):
        raise RuntimeError("cannot restart this one")

    monkeypatch.setattr(J, "restart", broken)
    h2 = Harness(tmp_path, h.broker)
    h2.pump()
    assert job_id not in h2.gw.jobs  # not accepted yet: refused, answered, not kept
    alive(h2)


# --- retained messages -----------------------------------------------------------------------
def test_a_retained_submit_is_one_job_over_restarts_and_is_cleared(tmp_path):
    h = Harness(tmp_path)
    announce(h)
    h.client.publish("xronos/gateway/request/job/submit",
                     json.dumps({"transaction": "r", "spec": SPEC.model_dump(mode="json")}).encode(), retain=True)
    h.pump()
    assert len(h.gw.jobs) == 1  # the live delivery is a request like any other
    for _ in range(2):
        h.gw._flush(force=True)
        h.gw.bus.kill()
        h = Harness(tmp_path, h.broker)
        h.pump()
        assert len(h.gw.jobs) == 1
    assert "xronos/gateway/request/job/submit" not in h.broker.retained
    assert h.gw.dispatcher.errors["retained_command"] == 0  # already cleared by the first restart


def test_a_retained_command_to_the_gateway_is_not_replayed(tmp_path):
    h = Harness(tmp_path)
    job_id, _ = running_job(h)
    h.client.publish("xronos/gateway/request/job/pause", json.dumps({"job_id": job_id}).encode(), retain=True)
    h.client.publish("xronos/gateway/set", b'{"action": "pause"}', retain=True)
    h.pump()
    assert h.gw.jobs[job_id].phase == "paused"
    h.request("job/resume", {"job_id": job_id})
    assert h.gw.jobs[job_id].phase == "running"
    h.gw._flush(force=True)
    h.gw.bus.kill()
    h2 = Harness(tmp_path, h.broker)
    h2.pump()
    assert h2.gw.jobs[job_id].phase == "running"  # not paused again by a replayed command
    assert "xronos/gateway/request/job/pause" not in h.broker.retained


# --- claims ----------------------------------------------------------------------------------
def test_a_helper_cannot_complete_the_job_as_rank_0(tmp_path):
    h = Harness(tmp_path)
    job_id, assigned = running_job(h)
    helper = next(a for a in assigned if a.rank != 0)
    h.node_says(m.NodeJobStatus(node_id=helper.node_id, job_id=job_id, plan_version=1, rank=0, status="completed",
                                step=10, export_dir="/evil", sent_at=1.0), helper.node_id)
    h.pump()
    job = h.gw.jobs[job_id]
    assert job.phase == "running" and job.export_dir is None


def test_a_node_cannot_cancel_another_nodes_profile_request(tmp_path):
    h = Harness(tmp_path)
    announce(h)
    insp = submit_to_inspection(h)
    h.node_says(m.InspectReport(node_id="a", request_id=insp.request_id, job_id=insp.job_id, ok=True,
                                arch=report("a", "x", "j").arch, train_rows=40, eval_rows=4,
                                total_steps=10), "a")
    h.pump()
    reqs = {p["node_id"]: r for p, r in h.seen("node.profile_request")}
    # c fails a's profile request (and sends a report under a's request id): neither counts.
    h.node_says(m.ErrorResponse(code="profile_failed", message=f"{reqs['a'].request_id}: I say a failed"), "c")
    h.node_says(report("c", reqs["a"].request_id, insp.job_id), "c")
    h.pump()
    for node, req in reqs.items():
        h.node_says(report(node, req.request_id, req.job_id), node)
    h.pump()
    (_, resp), = h.responses("job/submit")
    assert resp.status == "ok" and [e["node_id"] for e in resp.data["plan"]["entries"]] == list(NODES)


# --- growth ----------------------------------------------------------------------------------
def test_refused_submits_are_not_stored(tmp_path):
    h = Harness(tmp_path)
    announce(h, ("b",))  # the owner "a" is offline: every submit is refused
    for i in range(20):
        (err,) = h.request("job/submit", {"transaction": f"t{i}", "spec": SPEC.model_dump(mode="json")})
        assert err.status == "error" and "offline" in err.error
    h.gw._flush(force=True)
    assert h.gw.jobs == {}
    assert not (tmp_path / "gw" / "jobs.json").exists() or \
        json.loads((tmp_path / "gw" / "jobs.json").read_text())["jobs"] == []
    assert not [t for t in h.broker.retained if t.startswith("xronos/job/")]


def test_finished_jobs_are_pruned_after_the_configured_count(tmp_path):
    h = Harness(tmp_path)
    h.gw.cfg = h.gw.cfg.model_copy(update={"history_max_jobs": 2})
    job_id, _ = running_job(h)
    done = h.gw.jobs[job_id]
    for i in range(5):
        h.gw.jobs[f"old-{i}"] = replace(done, job_id=f"old-{i}", phase="completed",
                                           updated_at=time.time() - 100 + i)
    h.gw._unsaved = True
    h.gw._flush(force=True)
    table = json.loads((tmp_path / "gw" / "jobs.json").read_text())["jobs"]
    assert sorted(j["job_id"] for j in table) == sorted([job_id, "old-3", "old-4"])


def test_too_many_unfinished_jobs_are_refused(tmp_path):
    h = Harness(tmp_path)
    h.gw.cfg = h.gw.cfg.model_copy(update={"max_unfinished_jobs": 3})
    announce(h)
    answers = [h.request("job/submit", {"transaction": f"t{i}", "spec": SPEC.model_dump(mode="json")})
               for i in range(5)]
    assert len(h.gw.jobs) == 3  # three being checked (their owner has not answered the inspection)
    refused = [a for a in answers if a]
    assert len(refused) == 2 and all("max_unfinished_jobs" in a[0].error for a in refused)


@pytest.mark.parametrize("field, value", [("model_dir", "/m" + "x" * 5000), ("name", "n" * 300),
                                          ("owner", "a/../b"), ("text_column", "c" * 300)])
def test_spec_strings_are_bounded(tmp_path, field, value):
    h = Harness(tmp_path)
    announce(h)
    (err,) = h.request("job/submit", {"transaction": "s", "spec": spec_json(**{field: value})})
    path = f"spec.recipe.{field}" if field in SPEC.recipe.model_fields else f"spec.{field}"
    assert err.status == "error" and path in err.error and h.gw.jobs == {}


def test_a_submit_refused_after_inspection_does_not_come_back_on_restart(tmp_path):
    """A submit refused by its owner's inspection was saved as "queued" when it was created and
    stayed so on disk: a gateway restart re-inspected it and, the problem fixed meanwhile, ran a
    job its submitter had been told was refused."""
    h = Harness(tmp_path)
    announce(h)
    insp = submit_to_inspection(h, "r")
    h.node_says(m.InspectReport(node_id="a", request_id=insp.request_id, job_id=insp.job_id, ok=False,
                                error="spec.data_path '/d.csv': no such file on the owner"), "a")
    h.pump()
    assert h.gw.jobs == {}
    table = json.loads((tmp_path / "gw" / "jobs.json").read_text())["jobs"]
    assert table == [], f"refused job still on disk: {[(j['job_id'], j['phase']) for j in table]}"


def test_an_unreadable_retained_job_state_is_cleared(tmp_path):
    """Garbage (or a state of another schema version) retained on job/<id>/state, a topic only the
    gateway publishes, was logged on every start and never cleared: `xronos job status --follow`
    failed on it."""
    broker_h = Harness(tmp_path)
    broker_h.client.publish(T.build("job.state", job_id="ghost"), b'{"schema_version": 1}', retain=True)
    broker_h.pump()
    assert T.build("job.state", job_id="ghost") not in broker_h.broker.retained
    alive(broker_h)


def test_a_cleared_availability_takes_the_node_off_the_registry(tmp_path):
    """Retained "online" of nodes that never announced capabilities (a flood, or a buggy fleet) filled
    the registry; clearing them on the broker changed nothing until the gateway restarted. A node
    that announced itself stays online: a cleared retained message is no last will."""
    h = Harness(tmp_path)
    announce(h)
    real = set(h.gw.reg)
    for n in real:
        h.client.publish(T.build("node.availability", node_id=n), b"", retain=True)
    h.pump()
    assert set(h.gw.reg) == real and all(info.online for info in h.gw.reg.values())
    h.gw.reg = {}
    for i in range(5):
        h.client.publish(T.build("node.availability", node_id=f"fake{i}"), "online", retain=True)
    h.pump()
    assert len(h.gw.reg) == 5
    for i in range(5):
        h.client.publish(T.build("node.availability", node_id=f"fake{i}"), b"", retain=True)
    h.pump()
    assert h.gw.reg == {}
    alive(h)


def test_a_new_job_id_never_reuses_a_known_one(tmp_path, monkeypatch):
    """Ids carry 24 random bits; a collision would have replaced the job holding that id."""
    import uuid

    from xronos.gateway.service import core

    h = Harness(tmp_path)
    draws = iter([uuid.UUID("abcdef00" * 4), uuid.UUID("abcdef11" * 4), uuid.UUID("12345600" * 4)])
    monkeypatch.setattr(core.uuid, "uuid4", lambda: next(draws))
    h.gw.jobs["t-abcdef"] = "a known job"  # type: ignore[assignment]
    assert h.gw._new_id("T") == "t-123456"
