"""A node refuses an Assignment whose layout cannot run — before it starts a rank — with the kind
and the numbers in its ack; a layout that fits (any count 0) is accepted. Checkpoints record the
layout they were saved under, and a resume checks that it belongs to this model."""

from __future__ import annotations

import time

import pytest

from jobkit import job_spec, make_case
from xronos.node.agent.config import NodeConfig
from xronos.node.agent.jobcheck import assignment_problem, check_layout_cuts
from xronos.node.agent.service import NodeService
from xronos.node.rank.checkpoint import check_saved_layout, saved_layout
from xronos.node.rank.local import free_port
from xronos.protocol import messages as m
from xronos.protocol.codec import decode, encode
from fakebus import FakeBroker
from xronos.protocol.layout import Layout, LayoutError, Sizes
from xronos.protocol.topics import TopicTable

T = TopicTable()
# jobkit's GPT-2 classifier: 12 heads, 100 MLP columns, 37 vocabulary rows.
GOOD = Layout(attn=(0, 12), mlp=(64, 36), vocab=(37, 0))


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("assign")
    (root / "allowed").mkdir()
    model, data = make_case(root / "allowed", rows=12)
    spec = m.JobSpec(**job_spec(model, data, root / "allowed" / "out", owner="n0"))
    return root, spec


def _assignment(spec: m.JobSpec, layout: Layout, rank: int = 0, version: int = 1) -> m.Assignment:
    return m.Assignment(job_id="j", plan_version=version, node_id="n0" if rank == 0 else "n1", rank=rank,
                        world_size=layout.world_size, rendezvous_host="127.0.0.1", rendezvous_port=free_port(),
                        group_key="ab" * 32,
                        layout=layout, spec=spec)


BAD = [  # layout, what the reason names
    (Layout(attn=(4, 7), mlp=(64, 36), vocab=(32, 5)),
     "attn: counts [4, 7] sum to 11, but the model has 12 attention units"),
    (Layout(attn=(4, 8), mlp=(64, 35), vocab=(32, 5)),
     "mlp: counts [64, 35] sum to 99, but the model has 100 MLP columns"),
    (Layout(attn=(4, 8), mlp=(64, 36), vocab=(32, 37)),
     "vocab: counts [32, 37] sum to 69, but the model has 37 vocabulary rows"),
    (Layout(attn=(4, 8), mlp=(50, 50), vocab=(32, 5)),
     "mlp: the cut after rank 0 falls at 50, not a multiple of the MLP columns quantum 32"),
    (Layout(attn=(4, 8), mlp=(64, 36), vocab=(5, 32)),
     "vocab: the cut after rank 0 falls at 5, not a multiple of the vocabulary rows quantum 32"),
]


@pytest.mark.parametrize("layout,reason", BAD)
def test_the_owner_refuses_a_layout_that_does_not_fit_its_model(case, layout, reason) -> None:
    _, spec = case
    got = assignment_problem(_assignment(spec, layout), spec)
    assert got is not None and reason in got and layout.to_text() in got, got


def test_a_fitting_layout_passes_and_other_nodes_check_what_they_can(case) -> None:
    _, spec = case
    assert assignment_problem(_assignment(spec, GOOD), spec) is None
    # A node other than the owner has no model: it checks the quantum, not the sums.
    far = spec.model_copy(update={"model_dir": "/nonexistent/model"})
    assert assignment_problem(_assignment(spec, BAD[0][0], rank=1), far) is None
    assert "quantum 32" in assignment_problem(_assignment(spec, BAD[3][0], rank=1), far)
    with pytest.raises(LayoutError, match="vocab: counts \\[0, 0\\] assign no vocabulary rows"):
        check_layout_cuts(Layout(attn=(1, 1), mlp=(32, 1), vocab=(0, 0)))
    # Negative counts and a layout of the wrong world size never decode.
    with pytest.raises(ValueError):
        Layout(attn=(-1, 13), mlp=(64, 36), vocab=(37, 0))
    with pytest.raises(ValueError, match="layout: 2 ranks for world_size 3"):
        m.Assignment(**{**_assignment(spec, GOOD).model_dump(), "world_size": 3})


def test_the_node_service_acks_the_reason_and_starts_no_rank(case) -> None:
    root, spec = case
    broker = FakeBroker()
    cfg = NodeConfig(node_id="n0", state_dir=root / "state", allowed_dirs=[root / "allowed"],
                     data_host="127.0.0.1", threads=1)
    svc = NodeService(cfg, broker.bus("n0", will=(T.build("node.availability", node_id="n0"), "offline", True)))
    client = broker.bus("gw")
    client.subscribe("#")
    client.start()
    svc.start()
    try:
        acks = []

        def send(a: m.Assignment) -> m.AssignmentAck:
            svc.bus.publish(T.build("node.assignment", node_id="n0"), encode(a))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not acks:
                svc.step(0.05)
                acks.extend(decode(t, p) for t, p in client.drain() if T.match(t) and T.match(t)[0].key == "node.ack")
            return acks.pop()

        bad = send(_assignment(spec, BAD[1][0]))
        assert not bad.accepted and BAD[1][1] in bad.reason
        assert svc.assignment is None and svc.child is None
        good = send(_assignment(spec, GOOD, version=2))
        assert good.accepted and svc.assignment.layout == GOOD and svc.child is None  # started only on "start"
    finally:
        svc.work.shutdown(wait=True)


def test_checkpoint_layout_readers_agree() -> None:
    meta = {"dir": "/ck", "step": 3, "layout": {"attn": [0, 12], "mlp": [64, 36], "vocab": [37, 0]}}
    assert saved_layout(meta) == GOOD
    assert saved_layout({"dir": "/ck", "step": 3}) is None
    check_saved_layout(meta, Sizes(attn=12, mlp=100, vocab=37))  # any layout of this model resumes
    with pytest.raises(ValueError, match="saved under layout .* which does not fit this model"):
        check_saved_layout(meta, Sizes(attn=12, mlp=128, vocab=37))
    with pytest.raises(ValueError, match="is not a layout"):
        saved_layout({"dir": "/ck", "layout": {"attn": [1], "mlp": [1, 2]}})
