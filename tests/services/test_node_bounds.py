"""No request can take a box down (issue 38), over the FakeBus with the real node service and its
real child processes: a profile over the box's cores or memory is refused with the numbers before
anything starts; a profile whose child outgrows its limit anyway fails alone with the reason; a
cancel does not hold the control loop while the rank is stopped."""

from __future__ import annotations

import os
import time

import pytest

from nodekit import pump, replies
from xronos.node.agent.config import NodeConfig
from xronos.node.agent.service import NodeService
from xronos.node.box import limits
from xronos.node.box.capabilities import memory, usable_cores
from xronos.node.rank.local import free_port
from xronos.protocol import messages as m
from xronos.protocol.codec import decode, encode
from fakebus import FakeBroker
from xronos.protocol.layout import Layout
from xronos.protocol.topics import TopicTable

T = TopicTable()
MiB = 1 << 20
TINY = m.ArchSpec(family="gpt2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=256,
                  vocab_size=1000, max_positions=256, tie_word_embeddings=True)
WIDE_VOCAB = TINY.model_copy(update={"vocab_size": 50257})


def start(tmp_path, reserve_mb: int = 0) -> tuple[NodeService, object]:
    broker = FakeBroker()
    cfg = NodeConfig(node_id="n0", state_dir=tmp_path / "state", allowed_dirs=[tmp_path], data_host="127.0.0.1",
                     threads=1, reserve_mb=reserve_mb)
    svc = NodeService(cfg, broker.bus("n0", will=(T.build("node.availability", node_id="n0"), "offline", True)))
    client = broker.bus("gw")
    client.subscribe("#")
    client.start()
    svc.start()
    pump(svc, until=lambda: svc.availability.confirmed and svc.owncaps.confirmed)
    client.drain()
    return svc, client


@pytest.fixture
def node(tmp_path):
    svc, client = start(tmp_path)
    yield svc, client
    svc.shutdown()


def ask_profile(svc, client, rid: str, timeout: float = 60.0, arch: m.ArchSpec = TINY,
                **fields) -> m.ErrorResponse | m.ProfileReport:
    key = m.ProfileKey(task="causal-lm", batch_size=fields.pop("batch_size"), seq_len=fields.pop("seq_len"))
    req = m.ProfileRequest(request_id=rid, job_id="j", arch=arch, key=key, **fields)
    svc.bus.publish(T.build("node.profile_request", node_id="n0"), encode(req))
    got: list = []

    def answered() -> bool:
        for topic, payload in client.drain():
            found = T.match(topic)
            if found and found[0].key in ("node.error", "node.profile_report") and payload:
                msg = decode(topic, payload)
                if isinstance(msg, m.ProfileReport) or rid in msg.message:
                    got.append(msg)
        return bool(got)

    pump(svc, until=answered, timeout=timeout)
    return got[0]


def test_a_profile_over_the_cores_is_refused_with_the_numbers(node):
    svc, client = node
    cores = usable_cores()
    started = limits.LIVE.started
    err = ask_profile(svc, client, "r1", batch_size=2, seq_len=16, threads=cores + 1)
    assert isinstance(err, m.ErrorResponse) and err.code == "profile_failed"
    assert err.message == f"r1: threads {cores + 1} asked, but this box has {cores} usable cores"
    assert limits.LIVE.started == started  # refused before any child started


def test_a_profile_over_the_memory_is_refused_with_need_and_capacity(node):
    svc, client = node
    # the schema's largest batch, on a 64-wide model with GPT-2's vocabulary
    started = limits.LIVE.started
    err = ask_profile(svc, client, "r2", arch=WIDE_VOCAB, batch_size=4096, seq_len=256)
    assert isinstance(err, m.ErrorResponse) and err.code == "profile_failed"
    assert err.message.startswith("r2: batch_size 4096 x seq_len 256: the profile needs about ")
    assert "MiB available, less reserve_mb 0)" in err.message
    need = int(err.message.split("needs about ")[1].split(" MiB")[0].replace(",", ""))
    assert need * MiB > memory()[1]
    assert limits.LIVE.started == started


@pytest.mark.slow
def test_a_profile_child_past_its_limit_fails_alone_with_the_reason(tmp_path, monkeypatch):
    """The estimate passes (a tiny model), but the box has less room than the child really takes
    (torch alone is ~225 MiB resident, a heap probe beside it as much again): one failed request
    naming the limit, and the node goes on answering."""
    monkeypatch.setenv("XRONOS_PROFILE_HEAP", "always")  # a tiny model on a big host would skip them
    room = 330
    svc, client = start(tmp_path, reserve_mb=memory()[1] // MiB - room)
    try:
        err = ask_profile(svc, client, "r3", timeout=300, batch_size=2, seq_len=16)
        assert isinstance(err, m.ErrorResponse) and err.code == "profile_failed", err
        if set(limits.group_bases()) == {"memory", "pids"}:
            assert "it exceeded its memory limit of" in err.message
        else:
            assert "MemoryError" in err.message or "can't allocate memory" in err.message
        again = ask_profile(svc, client, "r4", arch=WIDE_VOCAB, batch_size=4096, seq_len=256)
        assert "r4: batch_size 4096" in again.message  # still answering
    finally:
        svc.shutdown()


def _accepted_rank1(svc, client, tmp_path) -> m.Assignment:
    """Rank 1 of a two-rank job owned elsewhere, assigned to the node and accepted."""
    spec = m.JobSpec(name="t", owner="other",
                     recipe=m.Recipe(model_dir=str(tmp_path / "m"), data_path=str(tmp_path / "d.csv"),
                                     task="classify", batch_size=2, seq_len=16, lr=1e-4, max_steps=2,
                                     export_dir=str(tmp_path / "o")))
    a = m.Assignment(job_id="j", plan_version=1, node_id="n0", rank=1, world_size=2, rendezvous_host="127.0.0.1",
                     rendezvous_port=free_port(), group_key="ab" * 32,
                     layout=Layout(attn=(6, 6), mlp=(64, 36), vocab=(32, 5)), spec=spec)
    svc.bus.publish(T.build("node.assignment", node_id="n0"), encode(a))
    (ack,) = replies(svc, client, "node.ack")
    assert ack.accepted, ack.reason
    return a


def test_a_cancel_does_not_hold_the_control_loop(node, tmp_path):
    """A rank that does not stop at once (here: waiting at its rendezvous for a peer that never
    comes) is stopped on a thread of its own: the cancel is answered while it is still going."""
    svc, client = node
    a = _accepted_rank1(svc, client, tmp_path)
    ctl = T.build("node.control", node_id="n0")
    svc.bus.publish(ctl, encode(m.JobStart(job_id="j", plan_version=1)))
    pump(svc, until=lambda: svc.child is not None)
    rank = svc.child.proc
    time.sleep(1.0)  # into its rendezvous, where a cancel on stdin is not read until it times out
    svc.bus.publish(ctl, encode(m.JobCancel(job_id="j", plan_version=1)))
    pump(svc, until=lambda: svc.status is not None and svc.status.status == "cancelled")
    assert svc.child is None
    assert rank.poll() is None  # answered while the rank was still within its grace
    deadline = time.monotonic() + 30
    while rank.poll() is None and time.monotonic() < deadline:
        svc.step(0.05)
    assert rank.poll() is not None  # and gone after it, killed with its process group
    with pytest.raises(ProcessLookupError):
        os.killpg(rank.pid, 0)


def test_a_refused_assignment_leaves_the_accepted_ones_spec(node, tmp_path):
    """The rank is built from the spec of the assignment the node holds: a newer version it refuses
    (here its layout does not fit the model's shape) changes neither."""
    svc, client = node
    a = _accepted_rank1(svc, client, tmp_path)
    spec = a.spec
    other = spec.model_copy(update={"recipe": spec.recipe.model_copy(update={"lr": 0.5})})
    # an MLP cut off its quantum: refused after the spec was looked at
    bad = a.model_copy(update={"plan_version": 2, "spec": other,
                               "layout": Layout(attn=(6, 6), mlp=(63, 37), vocab=(32, 5))})
    svc.bus.publish(T.build("node.assignment", node_id="n0"), encode(bad))
    (ack,) = replies(svc, client, "node.ack")
    assert not ack.accepted and "not a multiple of the" in ack.reason, ack.reason
    assert svc.assignment == a and svc.spec == spec
