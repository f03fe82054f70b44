"""A data-parallel job through real node services (`xronos node --config`, two processes) on a real
broker: each node gets an Assignment carrying the plan's shares (rows per data-parallel group),
accepts it (its layout is each group's, not the world's), starts its rank on JobStart, re-splits
its batch live on a JobReshard with shares (bad ones refused by the owner's service, naming the
field), and the job completes with the model single-device transformers training makes; the
owner's retained status, read by the gateway's job machine, makes the new shares the plan's. The
second node has no model and no data: its replica and its rows come from the owner over Gloo."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import paho.mqtt.client as paho
import pytest

from jobkit import job_spec, make_case, runkit
from xronos.node.agent.jobcheck import assignment_problem
from xronos.node.rank.local import free_port
from xronos.protocol import messages as m
from xronos.protocol.codec import decode, encode
from xronos.gateway.job import machine as J
from xronos.protocol.layout import Layout, Sizes
from xronos.protocol.topics import TopicTable

pytestmark = pytest.mark.slow
WHOLE = Layout(attn=(12,), mlp=(100,), vocab=(37,))  # make_case's GPT-2 classifier on one rank


class Nodes:
    """`xronos node` processes n0 (the owner, with the model and data) and n1, and a client."""

    def __init__(self, tmp: Path, broker, allowed: Path) -> None:
        self.base = f"xs{tmp.name[-6:].replace('-', '')}"
        self.table = TopicTable(self.base)
        self.procs, self.logs = [], []
        for n in ("n0", "n1"):
            cfg = tmp / f"{n}.toml"
            dirs = [str(allowed), str(tmp / n)] if n == "n0" else [str(tmp / n)]
            cfg.write_text(f'node_id = "{n}"\nstate_dir = "{tmp / n}"\nallowed_dirs = {json.dumps(dirs)}\n'
                           f'data_host = "127.0.0.1"\nthreads = 1\nreserve_mb = 0\nbase_topic = "{self.base}"\n'
                           f'[broker]\nhost = "{broker.host}"\nport = {broker.port}\n')
            log = tmp / f"{n}.log"
            self.logs.append(log)
            with open(log, "ab") as f:
                self.procs.append(subprocess.Popen([sys.executable, "-m", "xronos.cli.main", "node", "--config",
                                                    str(cfg)], stdout=f, stderr=subprocess.STDOUT))
        self.status: dict[str, m.NodeJobStatus] = {}
        self.acks: dict[str, m.AssignmentAck] = {}
        self.errors: list[m.ErrorResponse] = []
        self.online: set[str] = set()
        self.lock = threading.Lock()
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"t-{time.monotonic_ns()}")
        self.client.on_message = self._on
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        for key in ("node.availability", "node.job", "node.ack", "node.error"):
            for n in ("n0", "n1"):
                self.client.subscribe(self.table.build(key, node_id=n), qos=1)
        self.wait(lambda: self.online == {"n0", "n1"}, 60)

    def _on(self, client, userdata, msg) -> None:
        hit = self.table.match(msg.topic)
        if not hit:
            return
        entry, params = hit
        with self.lock:
            if entry.key == "node.availability":
                if msg.payload == b"online":
                    self.online.add(params["node_id"])
            elif entry.key == "node.job":
                self.status[params["node_id"]] = decode(msg.topic, msg.payload, table=self.table)
            elif entry.key == "node.ack":
                self.acks[params["node_id"]] = decode(msg.topic, msg.payload, table=self.table)
            elif entry.key == "node.error":
                self.errors.append(decode(msg.topic, msg.payload, table=self.table))

    def wait(self, until, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if until():
                    return
            time.sleep(0.05)
        raise TimeoutError("\n".join(log.read_text()[-2000:] for log in self.logs))

    def send(self, node: str, key: str, msg) -> None:
        self.client.publish(self.table.build(key, node_id=node), encode(msg), qos=1).wait_for_publish(10)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.client.loop_stop()
        self.client.disconnect()


def test_an_assignment_with_shares_is_checked_against_each_groups_layout(tmp_path) -> None:
    model, data = make_case(tmp_path)
    spec = m.JobSpec(**job_spec(model, data, tmp_path / "o"))
    a = m.Assignment(job_id="j", plan_version=1, node_id="n0", rank=0, world_size=2, rendezvous_host="127.0.0.1",
                     rendezvous_port=free_port(), group_key="ab" * 32, layout=WHOLE, spec=spec, shares=[3, 1])
    assert assignment_problem(a, spec) is None  # a whole replica per rank: the layout is one group's
    bad = a.model_copy(update={"layout": Layout(attn=(11,), mlp=(100,), vocab=(37,))})
    assert "attn: counts [11] sum to 11, but the model has 12 attention units" in assignment_problem(bad, spec)


def test_a_data_parallel_job_through_two_node_services(tmp_path, mqtt_broker) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    model, data = make_case(allowed)
    spec = m.JobSpec(**job_spec(model, data, allowed / "export", max_steps=12, checkpoint_interval=6))
    nodes = Nodes(tmp_path, mqtt_broker, allowed)
    try:
        port = free_port()
        for rank, n in enumerate(("n0", "n1")):
            nodes.send(n, "node.assignment", m.Assignment(
                job_id="j", plan_version=1, node_id=n, rank=rank, world_size=2, rendezvous_host="127.0.0.1",
                rendezvous_port=port, group_key="ab" * 32, layout=WHOLE, spec=spec, shares=[3, 1]))
        nodes.wait(lambda: len(nodes.acks) == 2, 60)
        assert all(a.accepted for a in nodes.acks.values()), nodes.acks
        # Started and held at the first boundary (the pause follows the start in each node's loop),
        # the owner is ordered re-splits: bad orders are refused by its service (the field named,
        # nothing reaches the ranks), the good one is taken at the boundary before step 5.
        for n in ("n0", "n1"):
            nodes.send(n, "node.control", m.JobStart(job_id="j", plan_version=1))
            nodes.send(n, "node.control", m.JobPause(job_id="j", plan_version=1))
        nodes.wait(lambda: nodes.status.get("n0") is not None and nodes.status["n0"].status == "paused", 120)
        order = {"job_id": "j", "plan_version": 1, "at_step": 5, "layout": WHOLE, "reason": "test"}
        for bad in ({"shares": [2, 3]}, {"shares": [1, 1, 2]}, {"layout": Layout(attn=(6, 6), mlp=(64, 36),
                                                                                  vocab=(32, 5)), "shares": [1, 3]}):
            nodes.send("n0", "node.control", m.JobReshard(**{**order, **bad}))
        nodes.send("n1", "node.control", m.JobReshard(**order, shares=[1, 3]))  # not the owner
        nodes.wait(lambda: len(nodes.errors) == 4, 60)
        details = " | ".join(e.message for e in nodes.errors)  # n0's and n1's, in any order
        for why in ("shares [2, 3] sum to 5 rows, the batch has 4",
                    "shares [1, 1, 2] name 3 data-parallel groups, the job has 2",
                    "differs from the job's attn=12;mlp=100;vocab=37: a data-parallel job keeps its layout live",
                    "only the owner (rank 0) takes it"):
            assert details.count(why) == 1, (why, details)
        nodes.send("n0", "node.control", m.JobReshard(**order, shares=[1, 3]))
        for n in ("n0", "n1"):
            nodes.send(n, "node.control", m.JobResume(job_id="j", plan_version=1))
        nodes.wait(lambda: all(nodes.status.get(n) is not None and nodes.status[n].status in ("completed", "failed")
                               for n in ("n0", "n1")), 300)
        assert [nodes.status[n].status for n in ("n0", "n1")] == ["completed", "completed"], nodes.status
        owner = nodes.status["n0"]
        assert owner.step == 12 and owner.checkpoint_step == 6
        assert owner.reshard_shares == [1, 3] and owner.reshard_layout == WHOLE and owner.reshard_bytes == 0
        assert owner.reshard_step == 5 and owner.reshard_refused is None
    finally:
        nodes.close()
    # The gateway's job machine hears the owner's retained status: the plan's shares follow.
    plan = m.Plan(job_id="j", version=1, strategy="dp", sizes=Sizes(attn=12, mlp=100, vocab=37), shares=[3, 1],
                  entries=[m.PlanEntry(node_id=n, rank=r, attn=12, mlp=100, vocab=37, predicted_compute_s=0.1,
                                       predicted_memory=1.0, memory_cap=2.0) for r, n in enumerate(("n0", "n1"))],
                  predicted_iteration_s=0.1, ideal_iteration_s=0.1, comm_s=0.0)
    job = replace(J.new_job("j", spec, None, J.Ctx(now=0.0, online=frozenset({"n0", "n1"})))[0], phase="running",
                  plan=plan, plan_version=1, accepted=True, total_steps=12)
    job, _ = J.handle(job, J.Status(owner), J.Ctx(now=1.0, online=frozenset({"n0", "n1"})))
    assert job.plan.shares == [1, 3] and job.last_reshard_step == owner.reshard_step
    from transformers import AutoModelForSequenceClassification

    rows = [{"text": t, "label": i % 2} for i, t in enumerate(runkit.texts(40))]  # make_case's
    r = spec.recipe
    reference, _ = runkit.reference_train(model, rows, "classify", steps=12, batch_size=r.batch_size, lr=r.lr,
                                          seed=r.seed, shuffle=True, n_train=32)
    exported = AutoModelForSequenceClassification.from_pretrained(str(allowed / "export"))
    max_abs, rel = runkit.compare(exported, reference)
    assert max_abs <= 5e-4 and rel <= 1e-5, (max_abs, rel)
