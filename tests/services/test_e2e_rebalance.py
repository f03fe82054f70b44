"""End to end over a real broker, live re-balancing (issue 14): two node processes as emulated boxes
run a job planned while both had the same speed (strategy `uniform`: the profiles are taken while
the two boxes, the services and anything else on a 2-core machine contend, and a segment plan
from them was once 9/3 heads; the live policy re-plans with the segment planner either way, and
what is under test is that it follows a slowed box); then one box loses most of its speed (as when
a box's own work starts), the gateway's policy re-plans from the measured
per-kind compute, the owner moves every rank at one boundary, and the job completes with an export
equal to `xronos run` with the same layouts from the same steps (`--reshard-at`): the move is exact."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jobkit import job_spec, runkit
from stack import Stack
from test_e2e import _load, _wait_step
from xronos.cli.main import main as xronos
from xronos.node.emulate.confinement import Confinement, EmulatorError, RankLimits
from xronos.protocol import messages as m
from xronos.protocol.layout import Layout

pytestmark = pytest.mark.slow

APPLIED = re.compile(r"re-shard applied at step (\d+): (\S+)")


def make_case(tmp, rows=80):
    """A GPT-2 classifier large enough that a box's CPU share shows in its measured compute
    (H = 192, 12 heads, 768 MLP columns: tens of milliseconds a step), and a labelled CSV."""
    return runkit.wide_classifier(tmp, 192, 768, rows)


@pytest.fixture
def boxes():
    try:
        # The virtual clock (node/emulate): a box's speed, not a CFS quota. Under a quota the first
        # re-plan moved work *to* the slowed box in 2 of 6 runs of this test (a quota banks time
        # while a rank waits, so its short segments can run at full core speed: its MLP looked fast).
        conf = Confinement([RankLimits(0.9), RankLimits(0.9)], top_weight=True, cpu_mode="virtual")
        conf.__enter__()
    except EmulatorError as exc:
        pytest.skip(f"no writable cgroup cpu controller here: {exc}")
    yield conf
    conf.close()


def block_weights(layout: Layout, rank: int) -> int:
    """The weights rank holds in a block of make_case's model (H = 192, head dim 16)."""
    return layout.attn[rank] * 4 * 192 * 16 + layout.mlp[rank] * 2 * 192  # q|k|v + out; in + out


def submit_on_two_boxes(stack: Stack, boxes: Confinement, **job) -> tuple[Path, Path, dict]:
    """The case's model and data, the gateway and nodes n0, n1 in the boxes' ranks 0 and 1, and a
    job of `job` (job_spec's fields) on them, owned by n0: (model, data, the submit's answer)."""
    model, data = make_case(stack.allowed, rows=80)
    stack.gateway()
    for rank, n in enumerate(("n0", "n1")):
        stack.node(n, wrap=lambda pid, rank=rank: boxes.add(rank, pid))
    stack.wait_nodes(2)
    spec = job_spec(model, data, stack.allowed / "export", owner="n0", checkpoint_interval=1000, batch_size=8,
                    nodes=["n0", "n1"], rebalance=True, **job)
    spec.pop("schema_version")
    return model, data, stack.client.request("job/submit", 300.0, spec=m.JobSpec(**spec))


def test_a_slowed_box_is_re_planned_live_and_the_export_equals_xronos_run(tmp_path, mqtt_broker, boxes):
    data_dir = tmp_path / "owner-data"
    data_dir.mkdir()
    stack = Stack(tmp_path, mqtt_broker, data_dir, base=f"xr{tmp_path.name[-6:].replace('-', '')}")
    try:
        model, data, accepted = submit_on_two_boxes(stack, boxes, max_steps=120, strategy="uniform")
        job_id, first = accepted["job_id"], m.Plan.model_validate(accepted["plan"]).layout()
        assert [e["node_id"] for e in accepted["plan"]["entries"]] == ["n0", "n1"] and first.attn == (6, 6)
        state = _wait_step(stack, job_id, 6)
        # Not "no re-plan yet": the state may first arrive some steps late, and at equal speeds the
        # policy may already have moved a little on the boxes' measured noise (a full suite run saw
        # a first move at step 13, "11.6 % faster").
        assert state.phase == "running", stack.logs()
        boxes.set_share(1, 0.12)  # n1 now computes at an eighth of a core's speed
        final = stack.client.follow(job_id, lambda s: None, timeout=400)
        assert final.phase == "completed", (final, stack.logs())
    finally:
        stack.close()

    assert final.replans >= 1 and final.last_replan_reason, final.events
    assert any("re-plan for step" in e and "faster" in e for e in final.events), final.events
    applied = [(int(s), Layout.parse(t)) for e in final.events for s, t in APPLIED.findall(e)]
    assert len(applied) == final.replans, final.events
    assert applied[-1][1] == final.plan.layout() != first
    # The policy follows the slowed box: in the end n1 holds less than it started with. Counted in
    # block weights held, not per kind: a per-kind measurement may still favour one kind (under a
    # CPU quota a first move of attn 6,6 -> 5,7 with mlp 384,384 -> 608,160 was seen; a real box
    # slows down as a whole; `bench/results/demo-idle.md`). Not the *first* move: the new speed
    # reaches n1's clock up to half a second after set_share, and in 2 runs of 13 a small move
    # towards n1 came before it, on the two boxes' measured noise at equal speed. The move
    # model then read that move's fixed cost as a slow link and never moved the work back
    # (`refit.fit_move`; test_rebalance's small-first-move case).
    assert block_weights(applied[-1][1], 1) < block_weights(first, 1), (first, applied)

    ref = tmp_path / "ref"
    at = [a for s, lay in applied for a in ("--reshard-at", f"{s}:{lay.to_text()}")]
    assert xronos(runkit.run_argv(model, data, "classify", first, ref, steps=120, batch_size=8, lr=1e-4, seed=3,
                                  extra=("--eval-fraction", "0.2", "--dropout", "0", *at))) == 0
    max_abs, rel = runkit.compare(_load(stack.allowed / "export"), _load(ref))
    assert max_abs <= 5e-4 and rel <= 1e-5
