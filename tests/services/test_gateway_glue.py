"""The gateway service over the in-memory FakeBus: the whole submit → run → complete exchange with
scripted nodes, restart from the persisted table, and a battery of bad payloads."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import msgpack
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "protocol"))
from protocol_samples import ARCH, CAPS, LAYERS  # noqa: E402

from xronos.gateway.config import GatewayConfig  # noqa: E402
from xronos.gateway.job import machine as J  # noqa: E402
from xronos.gateway.service import GatewayService  # noqa: E402
from xronos.protocol import messages as m  # noqa: E402
from xronos.protocol.codec import decode, encode  # noqa: E402
from fakebus import FakeBroker  # noqa: E402
from xronos.protocol.topics import TopicTable  # noqa: E402

T = TopicTable()
NODES = ("a", "b", "c")
SPEC = m.JobSpec(name="Glue Test", owner="a",
                 recipe=m.Recipe(model_dir="/m", data_path="/d.csv", task="causal-lm", batch_size=4, seq_len=64,
                                 lr=1e-4, max_steps=10, export_dir="/out", weight_decay=0.05, max_grad_norm=None),
                 checkpoint_interval=5, reserve_mb=0, rebalance=True, strategy="segment")  # not the defaults: they travel


class Harness:
    # offline_grace_s 0: a node's "offline" reaches its jobs at once (the grace has its own tests below).
    def __init__(self, tmp: Path, broker: FakeBroker | None = None, offline_grace_s: float = 0.0,
                 reconnect_max_s: int = 30, **cfg):
        self.broker = broker or FakeBroker()
        self.cfg = GatewayConfig(state_dir=tmp / "gw", homeassistant={"enabled": True}, **cfg,
                                 rendezvous_port_min=40000, rendezvous_port_max=40009,
                                 offline_grace_s=offline_grace_s,
                                 broker={"reconnect_max_s": reconnect_max_s, "keepalive": 1})
        self.gw = GatewayService(self.cfg, self.broker.bus("gw", will=(T.build("gateway.availability"),
                                                                        "offline", True)),
                                 timeouts=J.Timeouts(inspect_s=5, ack_s=5, stall_s=60, recover_s=60, retry_s=0.0))
        self.client = self.broker.bus("client")
        self.client.subscribe("#")
        self.client.start()
        self.gw.start()

    def pump(self, n: int = 50):
        for _ in range(n):
            self.gw.step(0)

    def seen(self, key: str) -> list[tuple[dict, object]]:
        out = []
        for topic, payload in self.client.drain():
            found = T.match(topic)
            if found and found[0].key == key:
                out.append((found[1], decode(topic, payload)))
        return out

    def node_says(self, msg, node: str):
        topic, _ = T.topic_for(msg, node_id=node)
        self.client.publish(topic, encode(msg), retain=T.entry_for(msg, {"node_id": node}).retained)

    def request(self, name: str, payload: bytes | dict):
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.client.publish(f"xronos/gateway/request/{name}", data)
        self.pump()
        return [p for _, p in self.responses(name)]

    def responses(self, name: str):
        return [(t, decode(t, p)) for t, p in self.client.drain() if t == f"xronos/gateway/response/{name}"]


def announce(h: Harness, nodes=NODES):
    for n in nodes:
        h.client.publish(T.build("node.availability", node_id=n), "online", retain=True)
        h.node_says(CAPS.model_copy(update={"node_id": n, "memory_available": 8 << 30}), n)
    h.pump()


def report(node: str, rid: str, job_id: str) -> m.ProfileReport:
    caps = CAPS.model_copy(update={"node_id": node, "memory_available": 8 << 30})
    return m.ProfileReport(node_id=node, request_id=rid, job_id=job_id, capabilities=caps, arch=ARCH,
                           task="causal-lm", batch_size=4, seq_len=64, threads=1, sizes=ARCH.sizes(), num_blocks=2,
                           layers=LAYERS, profile_seconds=1.0, created_at=1.0)


def submit_to_inspection(h: Harness, txn: str = "t1") -> m.InspectRequest:
    """SPEC submitted (answer deferred): the inspection request its owner "a" got."""
    h.client.drain()
    h.client.publish("xronos/gateway/request/job/submit",
                     json.dumps({"transaction": txn, "spec": SPEC.model_dump(mode="json")}).encode())
    h.pump()
    (params, insp), = h.seen("node.inspect_request")
    assert params["node_id"] == "a" and insp.spec == SPEC
    return insp


def submit_until_assigned(h: Harness) -> tuple[str, list[m.Assignment]]:
    insp = submit_to_inspection(h)
    h.node_says(m.InspectReport(node_id="a", request_id=insp.request_id, job_id=insp.job_id, ok=True, arch=ARCH,
                                train_rows=40, eval_rows=4, total_steps=10), "a")
    h.pump()
    reqs = h.seen("node.profile_request")
    assert sorted(p["node_id"] for p, _ in reqs) == list(NODES)
    # The profile times the job's optimizer as the trainer will run it.
    assert {r.key for _, r in reqs} == {SPEC.recipe.profile_key()}  # the job recipe's decay, clipping, LoRA
    for params, req in reqs:
        h.node_says(report(params["node_id"], req.request_id, req.job_id), params["node_id"])
    h.pump()
    msgs = h.client.drain()
    resp = [decode(t, p) for t, p in msgs if t.endswith("response/job/submit")]
    assert resp[0].status == "ok" and resp[0].transaction == "t1", resp
    assigned = [decode(t, p) for t, p in msgs if t.endswith("/assignment")]
    return insp.job_id, assigned


def test_submit_plan_assign_run_complete(tmp_path):
    h = Harness(tmp_path)
    announce(h)
    job_id, assigned = submit_until_assigned(h)
    assert [a.rank for a in assigned] == [0, 1] or len(assigned) >= 1
    assert assigned[0].node_id == "a" and assigned[0].rank == 0  # the owner is rank 0
    assert {a.rendezvous_port for a in assigned} <= set(range(40000, 40010))
    assert sum(assigned[0].layout.attn) == 2 and sum(assigned[0].layout.mlp) == ARCH.intermediate_size
    for a in assigned:
        h.node_says(m.AssignmentAck(job_id=job_id, plan_version=a.plan_version, node_id=a.node_id, accepted=True),
                    a.node_id)
    h.pump()
    starts = h.seen("node.control")
    assert {p["node_id"] for p, c in starts if c.action == "start"} == {a.node_id for a in assigned}
    for step in (1, 2, 3):
        for a in assigned:
            h.node_says(m.IterationMetrics(job_id=job_id, plan_version=1, node_id=a.node_id, rank=a.rank,
                                           step=step, epoch=0, loss=1.0, compute_s=0.1, comm_s=0.01, idle_s=0.01,
                                           iteration_s=0.12, voluntary_ctx_switches=1, involuntary_ctx_switches=0,
                                           peak_rss=1), a.node_id)
    h.pump()
    h.gw._flush(force=True)
    states = [s for _, s in h.seen("job.state")]
    assert states[-1].phase == "running" and states[-1].step == 3 and states[-1].eta_s is not None
    h.node_says(m.NodeJobStatus(node_id="a", job_id=job_id, plan_version=1, rank=0, status="completed", step=10,
                                epoch=0, export_dir="/out", sent_at=1.0), "a")
    h.pump()
    h.gw._flush(force=True)
    assert [s for _, s in h.seen("job.state")][-1].phase == "completed"
    assert json.loads((tmp_path / "gw" / "jobs.json").read_text())["jobs"][0]["phase"] == "completed"
    ha_state = json.loads(h.broker.retained["xronos/gateway/state"])
    assert ha_state["phase"] == "completed" and ha_state["job_id"] == job_id


def test_refusals_answered_at_submit(tmp_path):
    h = Harness(tmp_path)
    announce(h, ("b",))
    h.client.drain()
    (resp,) = h.request("job/submit", {"transaction": "x", "spec": SPEC.model_dump(mode="json")})
    assert resp.status == "error" and "owner node 'a' is offline" in resp.error and resp.transaction == "x"
    announce(h, ("a",))
    insp = submit_to_inspection(h, "y")
    h.node_says(m.InspectReport(node_id="a", request_id=insp.request_id, job_id=insp.job_id, ok=False,
                                error="spec.data_path '/d.csv' is outside the allowed directories"), "a")
    h.pump()
    (_, resp), = h.responses("job/submit")
    assert resp.status == "error" and "outside the allowed directories" in resp.error


def _profiled(h: Harness, spec: m.JobSpec) -> tuple[m.InspectRequest, m.Response]:
    """`spec` submitted, inspected by its owner "a" and profiled by every node: the inspection
    request and the answer."""
    h.client.publish("xronos/gateway/request/job/submit",
                     json.dumps({"transaction": "r", "spec": spec.model_dump(mode="json")}).encode())
    h.pump()
    (_, insp), = h.seen("node.inspect_request")
    h.node_says(m.InspectReport(node_id="a", request_id=insp.request_id, job_id=insp.job_id, ok=True, arch=ARCH,
                                train_rows=40, eval_rows=4, total_steps=10), "a")
    h.pump()
    for params, req in h.seen("node.profile_request"):
        h.node_says(report(params["node_id"], req.request_id, req.job_id), params["node_id"])
    h.pump()
    (_, resp), = h.responses("job/submit")
    return insp, resp


def test_infeasible_plan_refused(tmp_path):
    h = Harness(tmp_path)
    announce(h)
    _, resp = _profiled(h, SPEC.model_copy(update={"reserve_mb": 9000}))
    assert resp.status == "error" and resp.error.startswith("plan cannot fit"), resp


def test_a_job_without_reserve_takes_the_gateways(tmp_path):
    """gateway.toml's reserve_mb is what a job that names none keeps free on each node (8 GiB here)."""
    h = Harness(tmp_path, reserve_mb=8192)
    announce(h)
    insp, resp = _profiled(h, SPEC.model_copy(update={"reserve_mb": None}))
    assert insp.spec.reserve_mb == 8192  # filled in at the submit, before any node sees the job
    assert resp.status == "error" and "minus reserve_mb 8,192 MiB" in resp.error, resp


def test_a_nodes_own_reserve_is_planned_around(tmp_path):
    """A node's node.toml reserve_mb (Capabilities.reserve_bytes) holds against a job asking for none."""
    h = Harness(tmp_path)
    for n in NODES:
        h.client.publish(T.build("node.availability", node_id=n), "online", retain=True)
        h.node_says(CAPS.model_copy(update={"node_id": n, "memory_available": 8 << 30, "reserve_bytes": 8 << 30}), n)
    h.pump()
    insp, resp = _profiled(h, SPEC)  # reserve_mb 0
    assert insp.spec.reserve_mb == 0
    assert resp.status == "error" and "a keeps 8,192 MiB of its own (node.toml reserve_mb)" in resp.error, resp


def _running(h: Harness) -> tuple[str, list[m.Assignment]]:
    announce(h)
    job_id, assigned = submit_until_assigned(h)
    for a in assigned:
        h.node_says(m.AssignmentAck(job_id=job_id, plan_version=1, node_id=a.node_id, accepted=True), a.node_id)
    h.pump()
    h.node_says(m.NodeJobStatus(node_id="a", job_id=job_id, plan_version=1, rank=0, status="running", step=5,
                                checkpoint_step=5, sent_at=1.0), "a")
    h.pump()
    assert h.gw.jobs[job_id].phase == "running" and len(assigned) >= 2
    return job_id, assigned


def test_node_loss_then_gateway_restart(tmp_path):
    h = Harness(tmp_path)
    job_id, assigned = _running(h)
    # The gateway dies (no clean disconnect) and comes back with the same state directory.
    h.gw.bus.kill()
    assert h.broker.retained["xronos/gateway/availability"] == b"offline"
    h2 = Harness(tmp_path, h.broker)
    h2.pump()
    job = h2.gw.jobs[job_id]
    assert job.phase == "running" and job.checkpoint_step == 5 and "gateway restarted" in job.events[-1]
    victim = assigned[-1].node_id  # not the owner: _running saw a plan of two nodes or more
    h2.client.publish(T.build("node.availability", node_id=victim), "offline", retain=True)
    h2.pump()
    job = h2.gw.jobs[job_id]
    assert job.phase in ("recovering", "assigning") and job.recoveries == 1
    again = [a for _, a in h2.seen("node.assignment")]
    assert again and all(a.plan_version == 2 and a.resume_step == 5 and a.node_id != victim for a in again)


def test_the_wills_of_a_broker_shutting_down_do_not_re_plan_a_running_job(tmp_path):
    """Mosquitto publishes every client's last will when it shuts down: the gateway hears every
    node go offline, then loses the broker itself. Back, the nodes say online again: the job runs on."""
    h = Harness(tmp_path, offline_grace_s=0.5, reconnect_max_s=1)  # nodes get 1 + 1 s after a reconnect
    job_id, assigned = _running(h)
    for n in NODES:  # the wills, then the gateway's own connection closes
        h.client.publish(T.build("node.availability", node_id=n), "offline", retain=True)
    h.pump()
    h.gw.bus.kill()
    time.sleep(0.7)  # past the short grace: still nothing while the gateway is disconnected
    h.pump()
    assert h.gw.jobs[job_id].phase == "running" and h.gw.jobs[job_id].plan_version == 1
    h.gw.bus.reconnect()  # the broker is back; the nodes are not yet (their back-off)
    h.pump()
    time.sleep(0.7)
    h.pump()
    assert h.gw.jobs[job_id].phase == "running", h.gw.jobs[job_id].events
    for n in NODES:
        h.client.publish(T.build("node.availability", node_id=n), "online", retain=True)
    h.pump()
    time.sleep(1.5)  # past the settle time too: the withdrawn "offline"s never count
    h.pump()
    job = h.gw.jobs[job_id]
    assert job.phase == "running" and job.plan_version == 1 and job.recoveries == 0, job.events
    assert not [c for _, c in h.seen("node.control") if c.action != "start"]  # no plan was cancelled


def test_an_offline_that_stands_through_the_grace_re_plans(tmp_path):
    h = Harness(tmp_path, offline_grace_s=0.3, reconnect_max_s=1)
    job_id, assigned = _running(h)
    time.sleep(2.1)  # past the settle time after the gateway's first connect
    victim = assigned[-1].node_id
    h.client.publish(T.build("node.availability", node_id=victim), "offline", retain=True)
    h.pump()
    assert h.gw.jobs[job_id].phase == "running"  # within the grace
    time.sleep(0.4)
    h.pump()
    job = h.gw.jobs[job_id]
    assert job.phase in ("recovering", "assigning") and job.recoveries == 1, job.events
    assert f"node {victim!r} went offline" in "\n".join(job.events)


def test_retained_states_come_back_after_a_broker_that_forgot_them(tmp_path):
    """Mosquitto without persistence (its default) restarts with no retained message: a finished
    job's state would never change again to come back, and Home Assistant would show nothing."""
    h = Harness(tmp_path)
    job_id, _ = _running(h)
    h.node_says(m.NodeJobStatus(node_id="a", job_id=job_id, plan_version=1, rank=0, status="completed", step=10,
                                epoch=0, export_dir="/out", sent_at=1.0), "a")
    h.pump()
    state_topic = T.build("job.state", job_id=job_id)
    assert json.loads(h.broker.retained[state_topic])["phase"] == "completed"
    h.gw.bus.kill()
    h.broker.retained.clear()  # the broker restarted empty
    h.pump()
    h.gw.bus.reconnect()
    h.pump()
    assert json.loads(h.broker.retained[state_topic])["phase"] == "completed"
    ha_state = json.loads(h.broker.retained["xronos/gateway/state"])
    assert ha_state["phase"] == "completed" and ha_state["job_id"] == job_id
    assert h.broker.retained["xronos/gateway/availability"] == b"online"


BAD = {
    "malformed": b"{not json",
    "unknown field": json.dumps({"transaction": "b1", "bogus": 1}).encode(),
    "wrong version": json.dumps({"transaction": "b2", "schema_version": 7}).encode(),
    "wrong type": json.dumps({"transaction": "b3", "job_id": 5}).encode(),
    "oversized": json.dumps({"transaction": "b4", "pad": "x" * 300_000}).encode(),
    "not an object": b"[1, 2]",
}


@pytest.mark.parametrize("name", list(m.REQUEST_MODELS))
def test_every_request_topic_answers_bad_payloads(tmp_path, name):
    h = Harness(tmp_path)
    announce(h)
    for label, payload in BAD.items():
        h.client.drain()
        answers = h.request(name, payload)
        assert len(answers) == 1 and answers[0].status == "error", (label, answers)
    (ok,) = h.request("nodes/list", {"transaction": "fine"})  # still serving
    assert ok.status == "ok" and [n["node_id"] for n in ok.data["nodes"]] == list(NODES)


def test_node_topics_claiming_another_node_are_ignored(tmp_path):
    h = Harness(tmp_path)
    announce(h)
    job_id, assigned = submit_until_assigned(h)
    victim = assigned[0]
    # "b" publishes an ack and a failure in the name of "a", and capabilities for "a".
    h.node_says(m.AssignmentAck(job_id=job_id, plan_version=1, node_id="a", accepted=False, reason="evil"), "b")
    h.node_says(CAPS.model_copy(update={"node_id": "a", "participate": False}), "b")
    h.client.publish(T.build("node.metrics", node_id="b"), msgpack.packb({"garbage": True}))
    h.pump()
    job = h.gw.jobs[job_id]
    assert job.phase == "assigning" and victim.node_id in job.waiting
    assert h.gw.reg["a"].participate and h.gw.dispatcher.errors["rejected"] == 2
    assert h.gw.dispatcher.errors["unknown_field"] + h.gw.dispatcher.errors["missing_field"] >= 1
    (ok,) = h.request("job/status", {"transaction": "s", "job_id": job_id})
    assert ok.status == "ok" and ok.data["job"]["phase"] == "assigning"
    (err,) = h.request("job/pause", {"transaction": "p", "job_id": "nope"})
    assert err.status == "error" and "unknown job" in err.error


def _until_ordered(h, slow_last=5.0):
    """A job assigned and started; per-kind metrics from every rank, its last rank slow, until the
    policy orders a re-shard. Returns (job id, assignments, the (node, JobReshard) orders seen)."""
    from xronos.gateway.plan.rebalance import PolicyConfig

    h.gw.nodes.rebal.config = PolicyConfig(window=3, warmup=1, interval=1, confirm=2, cooldown=50, payback=1000)
    announce(h)
    job_id, assigned = submit_until_assigned(h)
    for a in assigned:
        h.node_says(m.AssignmentAck(job_id=job_id, plan_version=a.plan_version, node_id=a.node_id, accepted=True),
                    a.node_id)
    h.pump()
    h.client.drain()
    n = len(assigned)
    assert n >= 2, assigned
    orders = []
    for step in range(1, 10):
        for a in assigned:
            lay, slow = a.layout, slow_last if a.rank == n - 1 else 1.0
            per = {k: slow * 0.01 * lay.share(k, a.rank) + 0.001 for k in ("attn", "mlp", "vocab")}
            h.node_says(m.IterationMetrics(job_id=job_id, plan_version=1, node_id=a.node_id, rank=a.rank, step=step,
                                           epoch=0, loss=1.0, compute_s=sum(per.values()), comm_s=0.0, idle_s=0.0,
                                           iteration_s=sum(per.values()), voluntary_ctx_switches=0,
                                           involuntary_ctx_switches=0, peak_rss=1,
                                           compute_attn_s=per["attn"], compute_mlp_s=per["mlp"],
                                           compute_vocab_s=per["vocab"], compute_rest_s=0.0), a.node_id)
        h.pump()
        orders += [(p["node_id"], c) for p, c in h.seen("node.control") if c.action == "reshard"]
    return job_id, assigned, orders


def test_live_rebalancing_orders_the_owner_and_follows_its_report(tmp_path):
    """Per-kind compute from every rank feeds the job's policy; a slow last rank gets a JobReshard
    sent to the owner alone; the owner's report of the move makes it the job's plan, shown in the
    JobState and Home Assistant's state, and its measured cost refits the policy's move model."""
    h = Harness(tmp_path)
    job_id, assigned, orders = _until_ordered(h)
    n = len(assigned)
    assert len(orders) == 1, orders
    (node, order), = orders
    old = assigned[0].layout
    assert node == "a" and order.plan_version == 1 and order.layout != old
    assert order.layout.mlp[n - 1] < old.mlp[n - 1] or order.layout.attn[n - 1] < old.attn[n - 1]
    h.gw._flush(force=True)
    state = [s for _, s in h.seen("job.state")][-1]
    assert state.replans == 1 and state.plan.layout() == old  # ordered, not yet moved
    h.node_says(m.NodeJobStatus(node_id="a", job_id=job_id, plan_version=1, rank=0, status="running", step=9,
                                reshard_step=order.at_step, reshard_layout=order.layout, reshard_s=0.1,
                                reshard_bytes=1_000_000, sent_at=2.0), "a")
    h.pump()
    h.gw._flush(force=True)
    state = [s for _, s in h.seen("job.state")][-1]
    assert state.plan.layout() == order.layout and state.last_replan_reason.startswith("cooling down")
    policy = h.gw.nodes.rebal.by_job[job_id][1].policy  # the measured move refits the policy's move model
    assert list(policy.moves) == [(1_000_000, 0.1)]
    assert any(f"re-plan for step {order.at_step}" in e and "faster" in e for e in state.events)
    assert any(f"re-shard applied at step {order.at_step}" in e for e in state.events)
    h.gw.homeassistant.publish_state()
    ha_state = json.loads(h.broker.retained["xronos/gateway/state"])
    assert ha_state["replans"] == 1 and ha_state["last_replan"]


def test_an_order_the_owner_refused_is_dropped_and_the_policy_starts_again_from_the_plan(tmp_path):
    """The order is on disk as soon as it is sent (a restart knows it); the owner's refusal drops
    it, the JobState says why, and the gateway's policy goes back to the layout the ranks run."""
    from xronos.gateway.job.store import JobStore

    h = Harness(tmp_path)
    job_id, assigned, orders = _until_ordered(h)
    (node, order), = orders
    old = assigned[0].layout
    saved = JobStore(h.gw.cfg.state_dir).load()[job_id]
    assert saved.pending_plan is not None and saved.pending_plan.layout() == order.layout and saved.replans == 1
    h.node_says(m.NodeJobStatus(node_id="a", job_id=job_id, plan_version=1, rank=0, status="running", step=9,
                                reshard_refused=f"re-shard at step {order.at_step} refused: test", sent_at=2.0), "a")
    h.pump()
    h.gw._flush(force=True)
    state = [s for _, s in h.seen("job.state")][-1]
    assert state.phase == "running" and state.plan.layout() == old
    assert state.last_replan_reason.startswith("re-shard refused by the ranks, plan kept")
    assert JobStore(h.gw.cfg.state_dir).load()[job_id].pending_plan is None
    a = assigned[0]
    h.node_says(m.IterationMetrics(job_id=job_id, plan_version=1, node_id=a.node_id, rank=0, step=10, epoch=0,
                                   loss=1.0, compute_s=0.1, comm_s=0.0, idle_s=0.0, iteration_s=0.1,
                                   voluntary_ctx_switches=0, involuntary_ctx_switches=0, peak_rss=1,
                                   compute_attn_s=0.01, compute_mlp_s=0.01, compute_vocab_s=0.01,
                                   compute_rest_s=0.0), a.node_id)
    h.pump()
    assert h.gw.nodes.rebal.by_job[job_id][1].policy.layout == old


def test_a_profile_whose_time_falls_with_width_is_used_and_logged(tmp_path):
    from structlog.testing import capture_logs

    h = Harness(tmp_path)
    announce(h)
    insp = submit_to_inspection(h)
    h.node_says(m.InspectReport(node_id="a", request_id=insp.request_id, job_id=insp.job_id, ok=True, arch=ARCH,
                                train_rows=40, eval_rows=4, total_steps=10), "a")
    h.pump()
    i = next(i for i, lay in enumerate(LAYERS) if lay.partitioned and lay.segment == "mlp")
    odd = [*LAYERS[:i], LAYERS[i].model_copy(update={"time_samples": [(0.5, 0.02), (1.0, 0.01)]}), *LAYERS[i + 1:]]
    with capture_logs() as logs:
        for params, req in h.seen("node.profile_request"):
            r = report(params["node_id"], req.request_id, req.job_id)
            h.node_says(r.model_copy(update={"layers": odd}) if params["node_id"] == "b" else r, params["node_id"])
        h.pump()
    (warn,) = [e for e in logs if e["event"] == "profile.time_falls_with_width"]
    assert warn["node"] == "b" and "20.000 ms at share 0.5 but 10.000 ms at share 1" in warn["detail"]
    resp = [decode(t, p) for t, p in h.client.drain() if t.endswith("response/job/submit")]
    assert resp[0].status == "ok"  # planned with it: a warning, not a refusal
    h.gw._flush(force=True)
    topic = T.build("job.state", job_id=insp.job_id)
    events = decode(topic, h.broker.retained[topic]).events  # what `xronos job status` and HA show
    assert any("warning: node b: layer" in e and "time falling with width" in e for e in events), events
