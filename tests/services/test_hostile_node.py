"""Issue 15's classes of hostile input against a node: its MQTT topics (over the FakeBus), its
paths, its rank process's events, and the owner's shard server and the other Gloo exchanges
(against a scripted peer, no real process group). One regression test per class."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
from pydantic import ValidationError

from jobkit import job_spec, make_case
from nodekit import msgs, pump, replies
from xronos.node.rank import streaming
from xronos.node.agent import service as S
from xronos.node.agent.requests import MAX_PENDING_WORK
from xronos.node.agent.config import NodeConfig
from xronos.node.agent.service import NodeService
from xronos.node.rank.checkpoint import read_meta
from xronos.node.rank.local import free_port
from xronos.node.rank.messages import read_event
from xronos.node.rank.process import RankProcess
from xronos.node.models.export import gather_full
from xronos.node.models.specs import TensorSpec
from xronos.node.tp.layout import ShardLayout
from xronos.protocol import messages as m
from xronos.protocol.codec import encode
from xronos.protocol.layout import Layout
from fakebus import FakeBroker
from xronos.protocol.topics import TopicTable

T = TopicTable()


@pytest.fixture
def node(tmp_path):
    broker = FakeBroker()
    (tmp_path / "allowed").mkdir()
    cfg = NodeConfig(node_id="n0", state_dir=tmp_path / "allowed" / "state", allowed_dirs=[tmp_path / "allowed"],
                     data_host="127.0.0.1", threads=1)
    will = (T.build("node.availability", node_id="n0"), "offline", True)
    svc = NodeService(cfg, broker.bus("n0", will=will))
    client = broker.bus("gw")
    client.subscribe("#")
    client.start()
    svc.start()
    # Its own `online` and capabilities come back to it first: then it hears only what a test sends.
    pump(svc, until=lambda: svc.availability.confirmed and svc.owncaps.confirmed)
    yield svc, client, broker, tmp_path
    svc.work.shutdown(wait=True)


def inspect(svc, client, spec, rid="r1", timeout=120.0) -> m.InspectReport:
    client.drain()
    svc.bus.publish(T.build("node.inspect_request", node_id="n0"),
                    encode(m.InspectRequest(request_id=rid, job_id="j", spec=m.JobSpec(**spec))))
    deadline = time.monotonic() + timeout
    got: list[m.InspectReport] = []
    while time.monotonic() < deadline and not got:
        svc.step(0.05)
        got = [r for r in msgs(client, "node.inspect_report") if r.request_id == rid]
    (report,) = got
    return report


def assignment(tmp, **changes) -> m.Assignment:
    spec = m.JobSpec(**job_spec(tmp / "allowed" / "m", tmp / "allowed" / "d.csv", tmp / "allowed" / "o", owner="n0"))
    fields = dict(job_id="j", plan_version=1, node_id="n0", rank=0, world_size=2, rendezvous_host="127.0.0.1",
                  rendezvous_port=free_port(),  # a fixed port inside the ephemeral range collided once in CI
                  group_key="ab" * 32,
                  layout=Layout(attn=(6, 6), mlp=(64, 36), vocab=(32, 5)), spec=spec)
    return m.Assignment(**{**fields, **changes})


# --- paths -----------------------------------------------------------------------------------
def test_job_directory_comes_from_a_checked_id(node):
    svc, client, broker, tmp = node
    payload = assignment(tmp).model_dump(mode="json")
    svc.bus.publish(T.build("node.assignment", node_id="n0"), msgpack.packb({**payload, "job_id": "../../../etc"}))
    (err,) = replies(svc, client, "node.error")
    assert "job_id" in err.message and svc.assignment is None
    for bad in ("..", ".", "a/b", "", "x\0"):
        with pytest.raises(ValueError, match="job_id"):
            S.job_dir(tmp, bad)
    assert S.job_dir(tmp, "ok-1.2") == (tmp / "jobs" / "ok-1.2").resolve()


def test_an_export_may_not_overwrite_the_base_model_or_a_jobs_checkpoint(node):
    svc, client, broker, tmp = node
    model, data = make_case(tmp / "allowed", rows=40)
    ckpt = svc.state_dir / "jobs" / "other-job" / "checkpoint"
    for export, why in ((model, "would overwrite spec.recipe.model_dir"), (model / "sub", "would overwrite spec.recipe.model_dir"),
                        (tmp / "allowed", "would overwrite spec.recipe.model_dir"), (ckpt, "keeps its jobs' checkpoints"),
                        (data, "would overwrite spec.recipe.data_path")):
        report = inspect(svc, client, job_spec(model, data, export, owner="n0"), rid=f"r{abs(hash(str(export)))}")
        assert not report.ok and why in report.error, (export, report.error)
    ok = inspect(svc, client, job_spec(model, data, tmp / "allowed" / "exports" / "x", owner="n0"), rid="good")
    assert ok.ok, ok.error
    # The owner checks its assignment the same way.
    a = assignment(tmp, spec=m.JobSpec(**job_spec(model, data, model, owner="n0")))
    svc.bus.publish(T.build("node.assignment", node_id="n0"), encode(a))
    (ack,) = replies(svc, client, "node.ack")
    assert not ack.accepted and "would overwrite spec.recipe.model_dir" in ack.reason


def test_checkpoint_index_names_are_confined(node):
    svc, client, broker, tmp = node
    model, data = make_case(tmp / "allowed", rows=40)
    outside = tmp / "outside"
    outside.mkdir()
    shutil.move(str(model / "model.safetensors"), outside / "model.safetensors")
    from safetensors import safe_open
    with safe_open(str(outside / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    index = model / "model.safetensors.index.json"
    spec = job_spec(model, data, tmp / "allowed" / "out", owner="n0")
    index.write_text(json.dumps({"weight_map": {k: "../../outside/model.safetensors" for k in names}}))
    report = inspect(svc, client, spec, rid="dotdot")
    assert not report.ok and "not a plain relative name" in report.error
    index.write_text(json.dumps({"weight_map": {k: str(outside / "model.safetensors") for k in names}}))
    report = inspect(svc, client, spec, rid="abs")
    assert not report.ok and "not a plain relative name" in report.error
    (model / "model-00001.safetensors").symlink_to(outside / "model.safetensors")
    index.write_text(json.dumps({"weight_map": {k: "model-00001.safetensors" for k in names}}))
    report = inspect(svc, client, spec, rid="symlink")
    # refused where the model directory's links are checked, before the index is read
    assert not report.ok and "outside the allowed directories" in report.error
    assert "'model-00001.safetensors'" in report.error


# --- retained commands, queues, the rank process -------------------------------------------------
def test_retained_assignments_and_controls_are_ignored_and_cleared(tmp_path):
    broker = FakeBroker()
    (tmp_path / "allowed").mkdir()
    a = assignment(tmp_path, rank=1, spec=m.JobSpec(**job_spec(tmp_path / "m", tmp_path / "d", tmp_path / "o",
                                                                owner="n9")))
    gw = broker.bus("gw")
    gw.start()
    gw.publish(T.build("node.assignment", node_id="n0"), encode(a), retain=True)
    gw.publish(T.build("node.control", node_id="n0"), encode(m.JobStart(job_id="j", plan_version=1)), retain=True)
    gw.publish("xronos/node/n0/set", b'{"participate": false}', retain=True)
    cfg = NodeConfig(node_id="n0", state_dir=tmp_path / "state", allowed_dirs=[tmp_path / "allowed"],
                     data_host="127.0.0.1", threads=1)
    svc = NodeService(cfg, broker.bus("n0"))
    svc.start()
    try:
        for _ in range(10):
            svc.step(0.01)
        assert svc.assignment is None and svc.child is None and svc.participate
        assert svc.dispatcher.errors["retained_command"] == 3  # assignment, control, Home Assistant's set
        assert not {"xronos/node/n0/assignment", "xronos/node/n0/control", "xronos/node/n0/set"} & set(broker.retained)
    finally:
        svc.work.shutdown(wait=True)


def test_pending_work_is_bounded_and_a_repeated_request_runs_once(node):
    PENDING = MAX_PENDING_WORK
    svc, client, broker, tmp = node
    gate = threading.Event()
    svc.work.submit(gate.wait)  # the worker thread is busy
    client.drain()
    spec = m.JobSpec(**job_spec("/etc", "/etc/passwd", "/tmp/x", owner="n0"))  # refused at once when run
    try:
        for i in list(range(PENDING + 3)) + [0, 1]:
            svc.bus.publish(T.build("node.inspect_request", node_id="n0"),
                            encode(m.InspectRequest(request_id=f"q{i}", job_id="j", spec=spec)))
            svc.step(0.01)
        busy = [r for r in msgs(client, "node.inspect_report") if not r.ok and r.error.startswith("busy")]
        assert sorted(r.request_id for r in busy) == [f"q{i}" for i in range(PENDING,
                                                                               PENDING + 3)]
    finally:
        gate.set()
    done: list[m.InspectReport] = []
    deadline = time.monotonic() + 60
    while len(done) < PENDING and time.monotonic() < deadline:
        svc.step(0.05)
        done += msgs(client, "node.inspect_report")
    assert sorted(r.request_id for r in done) == [f"q{i}" for i in range(PENDING)]  # each once
    assert all("outside the allowed directories" in r.error for r in done)


class PipeLines:
    """The events pipe's lines, as a `ChildProcess` has read them (what a rank process wrote)."""

    def __init__(self, lines):
        self.lines = lines

    def drain_lines(self):
        out, self.lines = self.lines, []
        return out


class Drained:
    """The node service's rank: its events drained through `RankProcess.drain`, the boundary."""

    def __init__(self, lines):
        self.rank = RankProcess.__new__(RankProcess)
        self.rank.process = PipeLines(lines)

    def drain(self):
        return self.rank.drain()

    def finished(self):
        return False


def test_malformed_rank_events_stop_at_the_boundary(node):
    """Lines that are not events are refused where they arrive (logged, dropped); the loop sees
    only typed events, and the next good one still counts."""
    svc, client, broker, tmp = node
    a = assignment(tmp, rank=1, spec=m.JobSpec(**job_spec(tmp / "m", tmp / "d", tmp / "o", owner="n9")))
    svc.assignment = a
    svc._set_status("accepted", job=a)
    bad = [{"kind": "metrics"}, {"kind": "checkpoint", "step": 10**30}, {"kind": "status"},
           {"kind": "status", "status": "exploded"}, {"kind": "eval", "when": "before"}, {"no kind": 1},
           {"kind": "checkpoint", "step": "7"}, {"kind": "status", "status": "running", "extra": 1}]
    good = {"kind": "status", "status": "running"}
    svc.child = Drained([json.dumps(e) + "\n" for e in bad] + ["not json\n", json.dumps(good) + "\n"])
    client.drain()
    svc.step(0.01)
    assert svc.status.status == "running" and svc.internal_errors == 0
    svc.child = None
    for e in bad:  # each refused by the events' own models, naming what is wrong
        with pytest.raises(ValidationError):
            read_event(json.dumps(e))


# --- the data plane: what a Gloo peer sends ------------------------------------------------------
class ScriptedPeer:
    """A TPGroup stand-in: rank 0 of 2, receiving scripted tensors from rank 1 (in order)."""

    def __init__(self, incoming, rank=0, world_size=2):
        self.incoming, self.sent = list(incoming), []
        self.rank, self.world_size = rank, world_size

    def recv(self, t, src):
        value = self.incoming.pop(0)
        if isinstance(value, torch.Tensor) and value.numel() != t.numel():
            raise AssertionError(f"allocated {t.numel()} elements for a {value.numel()}-element message")
        t.copy_(torch.as_tensor(value, dtype=t.dtype).reshape(t.shape))
        return t

    def send(self, t, dst):
        self.sent.append(t.clone())

    def broadcast(self, t, src):
        value = self.incoming.pop(0)
        t.copy_(torch.as_tensor(value, dtype=t.dtype).reshape(t.shape))
        return t


class OneTensor:
    def read(self, spec):
        full = torch.arange(12.0).reshape(4, 3)
        if spec.full_shape != (4, 3) or spec.hf_name != "w":
            raise ValueError(f"{spec.hf_name}: no such tensor of that shape")
        return spec.take(full)


def _request(spec: dict) -> list:
    data = json.dumps(spec).encode()
    return [torch.tensor([len(data)]), torch.frombuffer(bytearray(data), dtype=torch.uint8)]


def test_shard_server_refuses_a_length_it_would_have_to_allocate(tmp_path):
    peer = ScriptedPeer([torch.tensor([2**40])])  # "my request is a terabyte long"
    with pytest.raises(ValueError, match="announced a shard request of 1099511627776 bytes"):
        streaming.serve_shards(peer, OneTensor())
    peer = ScriptedPeer([torch.tensor([-7])])
    with pytest.raises(ValueError, match="announced a shard request of -7 bytes"):
        streaming.serve_shards(peer, OneTensor())


def test_shard_server_answers_bad_specs_with_an_error_and_goes_on():
    bad = [{"hf_name": "w", "dim": 0, "segments": [[0, 10**12]], "full_shape": [4, 3]},  # beyond the tensor
           {"hf_name": "w", "dim": 5, "segments": [], "full_shape": [4, 3]},
           {"hf_name": "w", "dim": 0, "segments": [[3, 1]], "full_shape": [4, 3]},
           {"hf_name": "w", "dim": None, "segments": [], "full_shape": [2**30, 2**30]},
           {"hf_name": "w", "dim": 0, "segments": [[0, 2]], "full_shape": [4, 3], "extra": 1},
           {"hf_name": ["w"], "dim": 0, "segments": [[0, 2]], "full_shape": [4, 3]}]
    good = {"hf_name": "w", "dim": 0, "segments": [[1, 3]], "full_shape": [4, 3]}
    script = [x for spec in bad for x in _request(spec)] + _request(good) + [torch.tensor([streaming.DONE])]
    peer = ScriptedPeer(script)
    sent = streaming.serve_shards(peer, OneTensor())
    statuses = [t.tolist()[0] for t in peer.sent if t.dtype == torch.int64 and t.numel() == 2]
    assert statuses == [streaming.ERROR] * len(bad) + [streaming.OK]
    assert torch.equal(peer.sent[-1], torch.arange(12.0).reshape(4, 3)[1:3]) and sent == 6 * 4


def test_shared_json_and_error_texts_are_bounded():
    peer = ScriptedPeer([torch.tensor([2**40])], rank=1)
    with pytest.raises(ValueError, match="announced a JSON value of 1099511627776 bytes"):
        streaming.share_json(peer, None)
    peer = ScriptedPeer([torch.tensor([2**40])], rank=1)
    with pytest.raises(ValueError, match="announced a message"):
        streaming._recv_bytes(peer, 0)


def test_gather_refuses_a_peers_segment_table_outside_the_tensor():
    specs = {"w": TensorSpec("w", 0, ((0, 2),), (4, 3))}
    local = {"w": torch.zeros(2, 3)}
    peer = ScriptedPeer([torch.tensor([0, 10**9])])  # rank 1 claims rows 0..1e9 of a 4-row tensor
    with pytest.raises(ValueError, match="rank 1 sent segments"):
        gather_full(local, specs, ShardLayout(attn=(1, 1), mlp=(1, 1), vocab=(1, 1), rank=0), peer)


def test_checkpoint_state_is_checked_naming_the_file(tmp_path):
    (tmp_path / "state.json").write_text(json.dumps({"format": 1, "step": "3", "epoch": 0, "plan_version": 1}))
    with pytest.raises(ValueError, match=r"state.json: field step"):
        read_meta(tmp_path)
    (tmp_path / "state.json").write_text("{")
    with pytest.raises(ValueError, match="state.json: not a readable checkpoint state"):
        read_meta(tmp_path)
    (tmp_path / "state.json").write_text(json.dumps({"format": 1, "step": 3, "epoch": 0, "plan_version": 1}))
    assert read_meta(tmp_path)["step"] == 3 and read_meta(Path(tmp_path / "none")) is None
