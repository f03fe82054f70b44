"""The fuzzer (issue 15's Done-when): thousands of hostile payloads against the real gateway and a
real node (`xronos gateway|node` processes) on a real Mosquitto, loopback only, while a real job
trains; then both are restarted over retained poison. Bounded: a seeded generator
(XRONOS_FUZZ_SEED, default 15) and a fixed count (XRONOS_FUZZ_PAYLOADS, default 10,000).

Passes when: no service process died, both restarted and came up, every normal request (a
barrier after each batch, to the gateway and to the node) was answered, no unexpected exception
was caught by a guard (the services log those as `*.internal_error`/`dispatch.handler_error`),
the real job completed exactly once and is still there, exactly once, after the restart, no
retained command was acted on after it, and the node reported the impostor the fuzz played on its
capabilities topic. The figures (payloads per topic, refusals per reason)
are printed and written to the test's tmp dir as fuzz-report.json.
"""

from __future__ import annotations

import json
import os
import queue
import random
import time
from collections import Counter
from pathlib import Path

import paho.mqtt.client as paho
import pytest

from brokers import mosquitto_path, start_mosquitto
from fuzzkit import FAKES, Fuzzer, announce_fakes
from jobkit import job_spec, make_case
from xronos.cli.localstack import LocalStack
from xronos.protocol import messages as m
from xronos.protocol.codec import encode
from xronos.protocol.layout import Layout
from xronos.protocol.topics import TopicTable

pytestmark = pytest.mark.slow
SEED = int(os.environ.get("XRONOS_FUZZ_SEED", "15"))
PAYLOADS = int(os.environ.get("XRONOS_FUZZ_PAYLOADS", "10000"))
BATCH = 250
BASE = "fz"
INTERNAL = {"gateway.internal_error", "node.internal_error", "dispatch.internal_error", "dispatch.handler_error",
            "mqtt.connect_hook_failed"}


class Client:
    """A plain paho client: publishes the payloads (QoS 1, acknowledged batch by batch) and sees
    everything under the base topic (for the fake nodes and the barriers)."""

    def __init__(self, port: int) -> None:
        self.inbox: queue.Queue[tuple[str, bytes, bool]] = queue.Queue()
        self.c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"fuzzer-{os.getpid()}")
        self.c.max_inflight_messages_set(200)
        self.c.max_queued_messages_set(0)
        self.c.on_message = lambda _c, _u, msg: self.inbox.put((msg.topic, bytes(msg.payload), bool(msg.retain)))
        self.c.connect("127.0.0.1", port, keepalive=30)
        self.c.loop_start()
        self.c.subscribe(f"{BASE}/#", qos=1)
        self.last = None

    def send(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.last = self.c.publish(topic, payload, qos=1, retain=retain)

    def flush(self) -> None:
        if self.last is not None:
            self.last.wait_for_publish(30)

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def _wait(client: Client, fuzzer: Fuzzer | None, until, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            topic, payload, _ = client.inbox.get(timeout=0.2)
        except queue.Empty:
            continue
        if fuzzer is not None:
            fuzzer.observe(topic, payload)
        if until(topic, payload):
            return
    raise TimeoutError(f"no answer within {timeout:.0f} s: {what}")


def barrier(client: Client, fuzzer: Fuzzer | None, k: int, table: TopicTable, timeout: float = 90.0) -> float:
    """A normal request to the gateway and to the node, published after everything so far: their
    answers mean both processed everything before them. Returns the seconds waited."""
    t0 = time.monotonic()
    txn = f"barrier-{k}"
    client.send(table.build("gateway.request.nodes/list"), json.dumps({"transaction": txn}).encode())
    client.send(table.build("node.control", node_id="n0"), encode(m.JobPause(job_id=txn, plan_version=0)))
    got = set()

    def answered(topic: str, payload: bytes) -> bool:
        if topic == table.build("gateway.response", name="nodes/list") and f'"{txn}"' in payload.decode(errors="replace"):
            resp = m.GatewayResponse.model_validate_json(payload)
            assert resp.status == "ok" and any(n["node_id"] == "n0" and n["online"] for n in resp.data["nodes"])
            got.add("gateway")
        if topic == table.build("node.error", node_id="n0") and txn.encode() in payload:
            got.add("node")
        return got == {"gateway", "node"}

    _wait(client, fuzzer, answered, timeout, f"barrier {k} ({sorted(got)} answered)")
    return time.monotonic() - t0


def log_events(path: Path) -> Counter:
    """Counts of the structured log events of one service's log (JSON lines)."""
    counts: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            if "Traceback" in line:
                counts["Traceback"] += 1
            continue
        if isinstance(rec, dict):
            ev = rec.get("event", "")
            counts[ev] += 1
            if ev == "dispatch.bad_input":  # throttled: a line carries the count left out before it
                counts[f"bad_input:{rec.get('reason')}"] += 1 + int(rec.get("suppressed_before", 0))
    return counts


def jobs_of(stack: LocalStack) -> dict[str, tuple[str, bool]]:
    """job id -> (phase, accepted), for every job the gateway keeps (up to the 50 newest)."""
    return {j["job_id"]: (j["phase"], j["accepted"]) for j in stack.client.request("job/status", 30.0)["jobs"]}


@pytest.mark.skipif(mosquitto_path() is None, reason="the fuzzer runs against a real Mosquitto")
def test_fuzz_the_gateway_and_a_node(tmp_path):
    t_start = time.monotonic()
    rng = random.Random(SEED)
    table = TopicTable(BASE)
    broker = start_mosquitto("max_queued_messages 0\n", tmp_dir=tmp_path / "broker")
    allowed = tmp_path / "data"
    allowed.mkdir()
    stack = LocalStack(tmp_path / "stack", broker.host, broker.port, allowed, base=BASE)
    client = Client(broker.port)
    report: dict = {"seed": SEED}
    try:
        stack.gateway()
        stack.node("n0")
        for t, p, r in announce_fakes(table):
            client.send(t, p, r)
        stack.wait_nodes(1 + len(FAKES))
        model, data = make_case(allowed, rows=40)
        spec = job_spec(model, data, allowed / "export", owner="n0", nodes=["n0"], max_steps=30,
                        checkpoint_interval=10)
        spec.pop("schema_version")
        accepted = stack.client.request("job/submit", 300.0, spec=m.JobSpec(**spec))
        real_job = accepted["job_id"]
        fuzzer = Fuzzer(rng, BASE, "n0", real_job)
        t_fuzz = time.monotonic()
        waits, k, real_done = [], 0, None
        while fuzzer.total < PAYLOADS:
            if real_done is None and fuzzer.total >= PAYLOADS // 2:
                # Half the payloads while the real job trains, half while the fake nodes' jobs run.
                real_done = stack.client.follow(real_job, lambda s: None, timeout=300)
            for topic, payload, retain in fuzzer.batch(BATCH):
                client.send(topic, payload, retain)
            if k % 4 == 0:
                for topic, payload, retain in fuzzer.claims(real_job, 1):
                    client.send(topic, payload, retain)
            client.flush()
            waits.append(barrier(client, fuzzer, k, table))
            k += 1
            for name, proc in stack.procs.items():
                assert proc.poll() is None, f"{name} died (exit {proc.returncode}):\n{stack.logs()}"
        report["fuzz_s"] = round(time.monotonic() - t_fuzz, 1)
        report["barriers"] = {"answered": k, "max_wait_s": round(max(waits), 2)}

        final = stack.client.follow(real_job, lambda s: None, timeout=300)
        assert final.phase == "completed" and final.step == 30, (final, stack.logs())
        for t, p, r in announce_fakes(table):  # leave them online (retained) for the restart
            client.send(t, p, r)
        barrier(client, None, 10**6 - 1, table)
        before = jobs_of(stack)
        assert before[real_job] == ("completed", True)

        # Restart both, hard, and leave retained orders behind meanwhile: none may be acted on.
        stack.kill("gateway")
        stack.kill("n0")
        poison = [
            ("gateway/request/job/submit", json.dumps({"transaction": "poison", "spec": spec}).encode()),
            ("gateway/request/job/cancel", json.dumps({"transaction": "poison", "job_id": real_job}).encode()),
            ("gateway/request/plan/preview", json.dumps({"transaction": "poison", "spec": spec}).encode()),
            ("gateway/set", b'{"action": "cancel"}'),
            ("node/n0/control", encode(m.JobCancel(job_id=real_job, plan_version=1))),
            ("node/n0/assignment", encode(m.Assignment(
                job_id="poison", plan_version=1, node_id="n0", rank=0, world_size=1, rendezvous_host="127.0.0.1",
                rendezvous_port=29999, group_key="ab" * 32, layout=Layout(attn=(12,), mlp=(100,), vocab=(37,)),
                spec=m.JobSpec(**spec)))),
            ("node/n0/set", b'{"participate": false}'),
        ]
        for topic, payload in poison:
            client.send(f"{BASE}/{topic}", payload, retain=True)
            fuzzer.counts["retained poison at restart"] += 1
        client.flush()
        stack.gateway()
        stack.node("n0")
        for t, p, r in announce_fakes(table):  # the fuzz may have left them offline
            client.send(t, p, r)
        stack.wait_nodes(1 + len(FAKES))
        barrier(client, None, 10**6, table)
        after = jobs_of(stack)
        # Nothing lost, nothing duplicated (the fake nodes' jobs may have moved on meanwhile), and the
        # real job neither re-run nor cancelled by the retained orders.
        accepted = {j for j, (_, ok) in before.items() if ok}
        assert accepted <= set(after) <= set(before), (before, after)
        assert after[real_job] == ("completed", True)
        nodes = stack.client.request("nodes/list", 30.0)["nodes"]
        assert next(n for n in nodes if n["node_id"] == "n0")["participate"] is True
        for name, proc in stack.procs.items():
            assert proc.poll() is None, f"{name} died after the restart:\n{stack.logs()}"
        # The retained orders are gone from the broker.
        probe = Client(broker.port)
        time.sleep(1.0)
        left = [t for t, _, r in list(probe.inbox.queue) if r and any(t == f"{BASE}/{p}" for p, _ in poison)]
        probe.close()
        assert left == [], left

        gw, node = log_events(stack.dir / "gateway.log"), log_events(stack.dir / "n0.log")
        report.update(
            payloads=fuzzer.total, per_topic=dict(sorted(fuzzer.counts.items())),
            fake_node_jobs={"answers": dict(sorted(fuzzer.answers.items())), "assigned": len(fuzzer.fake_jobs)},
            impostor_reports=fuzzer.impostor_reports,
            crashes=0, restart_failures=0, runtime_s=round(time.monotonic() - t_start, 1),
            jobs_before_restart=before, jobs_after_restart=after,
            gateway_refusals={k: v for k, v in gw.items() if k.startswith("bad_input:")},
            node_refusals={k: v for k, v in node.items() if k.startswith("bad_input:")},
            retained_commands_ignored={"gateway": gw["dispatch.retained_command_ignored"],
                                       "node": node["dispatch.retained_command_ignored"]},
            internal_errors={"gateway": {k: gw[k] for k in INTERNAL | {"Traceback"} if gw[k]},
                             "node": {k: node[k] for k in INTERNAL | {"Traceback"} if node[k]}})
        (tmp_path / "fuzz-report.json").write_text(json.dumps(report, indent=1))
        print("\nfuzz report:", json.dumps(report, indent=1))
        assert fuzzer.total >= PAYLOADS
        # The impostor on the node's capabilities was reported (once: at most one per 10 minutes).
        assert fuzzer.counts["node.capabilities (own, valid)"] > 0 and fuzzer.impostor_reports >= 1, stack.logs()
        assert report["internal_errors"] == {"gateway": {}, "node": {}}, stack.logs()
    finally:
        client.close()
        stack.close()
        broker.stop()
