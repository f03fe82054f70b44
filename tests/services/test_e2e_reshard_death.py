"""End to end over a real broker: a rank dies in the middle of a live re-shard. The job falls back
to the last consolidated checkpoint, as on a node loss, and completes with every step done once.

The re-shard is ordered as the gateway orders one (a JobReshard to the owner); the rank dies by
SIGKILL while its peers wait inside the exchange for its slices: `XRONOS_RESHARD_MARK` has every
rank announce that it entered the move, and `XRONOS_RESHARD_HOLD` keeps rank 1 there a few seconds
(`xronos.node.rank.relayout`: hooks that only signal and wait)."""

from __future__ import annotations

import itertools
import os
import re
import signal
import time
from pathlib import Path

import pytest

from jobkit import job_spec, make_case
from test_e2e import _load, _wait_step
from xronos.protocol import messages as m
from xronos.protocol.layout import Layout, LayoutError

pytestmark = pytest.mark.slow

VICTIM = 1  # the rank killed in the move (not the owner: its node service keeps the checkpoint)


def _marks(mark: Path, rank: int) -> list[Path]:
    return sorted(mark.glob(f"rank{rank}-step*.pid"))



def trading_layout(old: Layout, sizes) -> Layout:
    """A layout every rank of `old` both sends to and receives from (or, failing that, at least
    does one of the two): cuts between ranks moved by a
    few heads and by whole quanta of one other kind (the ranks refuse an order off the quanta, as
    the gateway never sends one)."""
    def moved(kind: str, deltas: tuple[int, ...]) -> tuple[int, ...]:
        counts, total = old.counts(kind), sizes.total(kind)
        cuts = [min(total, max(0, sum(counts[:r + 1]) + d)) for r, d in enumerate(deltas)]
        edges = [0, *cuts, total]
        return tuple(max(0, b - a) for a, b in zip(edges, edges[1:]))

    def trades(new: Layout, rank: int, both: bool) -> bool:
        spans = [(old.range(k, rank), new.range(k, rank)) for k in ("attn", "mlp", "vocab")]
        sends = any(a < min(b, c) or max(a, d) < b for (a, b), (c, d) in spans)
        gets = any(c < min(d, a) or max(c, b) < d for (a, b), (c, d) in spans)
        return (sends and gets) if both else (sends or gets)

    n = old.world_size
    steps = [(-2, -1, 0, 1, 2)] * (n - 1)
    for both in (True, False):  # a rank the plan gave nothing can only receive
        for da in itertools.product(*steps):
            for kind in ("mlp", "vocab"):
                for dk in itertools.product(*steps):
                    new = Layout(**{"attn": moved("attn", da), "mlp": old.mlp, "vocab": old.vocab,
                                    kind: moved(kind, tuple(32 * d for d in dk))})
                    if sum(new.attn) != sizes.attn or not all(trades(new, r, both) for r in range(n)):
                        continue
                    try:
                        new.check(sizes, world_size=n)
                    except LayoutError:
                        continue
                    return new
    raise AssertionError(f"no layout trades with every rank of {old.to_text()}")


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
    job_id = accepted["job_id"]

    # Held at a boundary, the ranks take the order at the boundary where they resume (at_step 0:
    # the first one the owner reaches), whatever the step.
    state = _wait_step(stack, job_id, 7)
    assert state.phase == "running", stack.logs()
    # The plan running now: under load a rank may fail at the job's start, and the job then runs
    # a later plan than the one accepted.
    plan = state.plan
    assert plan is not None
    # Every rank sends and receives something: the victim's peers wait for it in the exchange.
    target = trading_layout(plan.layout(), plan.sizes)
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
    recovered = [e for e in final.events if "recovering: rank" in e and f"resuming from step {last_ckpt}" in e]
    assert recovered, (move_step, final.events)
    resumed = [e for e in final.events if f"plan v{plan.version + 1} (" in e]
    assert resumed and resumed[0].endswith(f"resume from step {last_ckpt}"), final.events
    assert final.plan.version > plan.version
    # The survivors failed inside the move (their peer's socket closed under the exchange).
    v1 = [(stack.dir / n / "jobs" / job_id / f"v{plan.version}" / "rank.log") for n in ("n0", "n1", "n2")]
    assert any("relayout.py" in p.read_text(errors="replace") for p in v1 if p.exists()), stack.logs()
    assert _load(stack.allowed / "export") is not None  # the export loads
