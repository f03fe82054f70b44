"""End to end over a real broker: a rank dies in the middle of a live re-shard. The job falls back
to the last consolidated checkpoint, as on a node loss, and completes with every step done once.

The re-shard is ordered as the gateway orders one (a JobReshard to the owner); the rank dies by
SIGKILL while its peers wait inside the exchange for its slices: `XRONOS_RESHARD_MARK` has every
rank announce that it entered the move, and `XRONOS_RESHARD_HOLD` keeps rank 1 there a few seconds
(`xronos.node.relayout`: hooks that only signal and wait)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from jobkit import job_spec, make_case
from test_e2e import _load, _wait_step
from xronos.protocol import messages as m
from xronos.protocol.layout import Layout

pytestmark = pytest.mark.slow

VICTIM = 1  # the rank killed in the move (not the owner: its node service keeps the checkpoint)


def _marks(mark: Path, rank: int) -> list[Path]:
    return sorted(mark.glob(f"rank{rank}-step*.pid"))


def test_a_rank_killed_mid_reshard_falls_back_to_the_last_checkpoint(stack, monkeypatch, tmp_path):
    mark = tmp_path / "marks"
    mark.mkdir()
    monkeypatch.setenv("XRONOS_RESHARD_MARK", str(mark))  # inherited by the node services and their ranks
    monkeypatch.setenv("XRONOS_RESHARD_HOLD", f"{VICTIM}:20")
    model, data = make_case(stack.allowed, rows=80)
    stack.gateway()
    for n in ("n0", "n1", "n2"):
        stack.node(n)
    stack.wait_nodes(3)
    # The gateway's own policy stays out of it (rebalance off): the one re-shard is the test's order.
    spec = job_spec(model, data, stack.allowed / "export", owner="n0", max_steps=60, checkpoint_interval=5,
                    batch_size=8, nodes=["n0", "n1", "n2"], rebalance=False)
    spec.pop("schema_version")
    accepted = stack.client.request("job/submit", 300.0, spec=m.JobSpec(**spec))
    job_id, plan = accepted["job_id"], m.Plan.model_validate(accepted["plan"])
    # Every rank sends and receives something: the victim's peers wait for it in the exchange.
    target = Layout(attn=(4, 4, 4), mlp=(34, 33, 33), vocab=(13, 12, 12))
    if target == plan.layout():
        target = Layout(attn=(2, 4, 6), mlp=(20, 30, 50), vocab=(7, 10, 20))

    # Held at a boundary, the ranks take the order at the boundary where they resume (at_step 0:
    # the first one the owner reaches), whatever the step.
    state = _wait_step(stack, job_id, 7)
    assert state.phase == "running", stack.logs()
    stack.client.request("job/pause", 60.0, job_id=job_id)
    stack.client.bus.publish_message(m.JobReshard(job_id=job_id, plan_version=plan.version, at_step=0,
                                                  layout=target, reason="test: a move to die in"), node_id="n0")
    time.sleep(1.0)
    stack.client.request("job/resume", 60.0, job_id=job_id)
    deadline = time.monotonic() + 120
    while not _marks(mark, VICTIM) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _marks(mark, VICTIM), ("rank 1 never entered the move", stack.logs())
    entered = _marks(mark, VICTIM)[0]
    move_step = int(re.search(r"step(\d+)", entered.name).group(1))
    os.kill(int(entered.read_text()), signal.SIGKILL)  # the rank process, not its node service

    final = stack.client.follow(job_id, lambda s: None, timeout=300)
    assert final.phase == "completed", (final, stack.logs())
    assert final.step == 60
    assert not any("re-shard applied" in e for e in final.events)  # the move never completed
    # Recovered from the last checkpoint before the move: nothing lost but the steps since it.
    last_ckpt = (move_step // 5) * 5
    recovered = [e for e in final.events if "recovering: rank" in e]
    assert recovered and f"resuming from step {last_ckpt}" in recovered[0], (move_step, final.events)
    resumed = [e for e in final.events if "plan v2" in e]
    assert resumed and resumed[0].endswith(f"resume from step {last_ckpt}"), final.events
    assert final.plan.version >= 2
    # The survivors failed inside the move (their peer's socket closed under the exchange).
    v1 = [(stack.dir / n / "jobs" / job_id / "v1" / "rank.log") for n in ("n0", "n1", "n2")]
    assert any("relayout.py" in p.read_text(errors="replace") for p in v1 if p.exists()), stack.logs()
    assert _load(stack.allowed / "export") is not None  # the export loads
