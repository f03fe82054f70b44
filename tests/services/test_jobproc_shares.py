"""A job with shares, as the node service runs its ranks (`RankProcess`: `python -m
xronos.node.rank.jobrank`, the events pipe, orders on stdin), without MQTT.

Only the owner has the model and the data (the other ranks get paths that do not exist: their
replicas and rows come over Gloo). A pure data-parallel job on three ranks with a 0 share trains,
evaluates and checkpoints; a pause holds every rank at one boundary; re-shard orders the job cannot
take (a new layout: a data-parallel job keeps its layout; shares for another number of groups;
shares off the batch, refused at the boundary by every rank alike) are refused while the job goes
on, and a re-split of its batch (rows 1,0,3 -> 0,3,1: the 0-share group gets rows, another loses
them all) is taken at one boundary. Resumed at its step-10
checkpoint under a DP×TP mesh (two groups of two ranks, another layout, other shares), it ends
where the uninterrupted job does, which is single-device transformers training (shuffled batches,
the held-out tail excluded).
"""

from __future__ import annotations

import json
import os
import time

import pytest

from jobkit import job_spec, make_case, runkit, wait_ranks
from xronos.node.rank import messages as msg
from xronos.node.rank.checkpoint import read_meta
from xronos.node.rank.local import free_port
from xronos.node.rank.process import RankProcess, child_env
from xronos.node.rank.validate import model_sizes
from xronos.node.runconfig import JobRankConfig, RunConfig
from xronos.protocol.layout import Layout
from xronos.protocol.messages import JobSpec

pytestmark = pytest.mark.slow

MESH = Layout(attn=(7, 5), mlp=(32, 68), vocab=(0, 37))  # the case's GPT-2: 12 heads, 100 columns, 37 rows


def start(tmp, spec: dict, layout: Layout, shares, *, resume_step: int = 0, version: int = 1) -> list[RankProcess]:
    port = free_port()
    procs = []
    world = layout.world_size * len(shares)
    for rank in range(world):
        elsewhere = {"model_dir": "/nonexistent/model", "data_path": "/nonexistent/d.csv"}
        own = spec if rank == 0 else {**spec, "recipe": {**spec["recipe"], **elsewhere}}
        job = JobSpec.model_validate_json(json.dumps(own))
        run = RunConfig.for_job(job, layout=layout, rank=rank, host="127.0.0.1", port=port, threads=1,
                                gloo_timeout_s=60.0, shares=tuple(shares))
        cfg = JobRankConfig(job_id="j", plan_version=version, node_id=f"n{rank}", run=run,
                            checkpoint_interval=job.checkpoint_interval, resume_step=resume_step,
                            checkpoint_dir=str(tmp / "ckpt") if rank == 0 else None)
        procs.append(RankProcess(tmp / f"v{version}-rank{rank}", cfg, child_env(1, "lo")))
    return procs


def _load(path):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(str(path))


def test_a_data_parallel_job_pauses_re_splits_live_checkpoints_and_resumes_on_a_mesh(tmp_path):
    model, data = make_case(tmp_path)
    spec = job_spec(model, data, tmp_path / "export", max_steps=20, checkpoint_interval=10)
    procs = start(tmp_path, spec, Layout.single(model_sizes(str(model))), (1, 0, 3))
    seen: list[list] = [[] for _ in procs]
    # the rank's config holds the job's group key: its user's alone, whatever the umask
    assert all(os.stat(tmp_path / f"v1-rank{r}" / "rank.json").st_mode & 0o777 == 0o600 for r in range(len(procs)))

    def pump(until, timeout=180.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, p in enumerate(procs):
                seen[i] += p.drain()
            if until():
                return
            time.sleep(0.02)
        raise TimeoutError([p.tail(800) for p in procs])

    def steps(i):
        return [e.step for e in seen[i] if e.kind == "metrics"]

    pump(lambda: len(steps(2)) >= 2)
    for p in procs:
        p.send(msg.Pause())
    pump(lambda: all(msg.Status(status="paused") in s for s in seen))
    held = steps(0)[-1]
    assert held < 20 and [steps(i)[-1] for i in range(3)] == [held] * 3
    whole = Layout.single(model_sizes(str(model)))

    def refusals():
        return [e.detail for e in seen[0] if e.kind == "reshard_refused"]

    procs[0].send(msg.Reshard(layout=Layout(attn=(4, 4, 4), mlp=(32, 32, 36), vocab=(32, 5, 0)), at_step=0))
    procs[0].send(msg.Reshard(layout=whole, shares=[2, 2], at_step=0))
    pump(lambda: len(refusals()) == 2)
    # Each order the ranks judge at a boundary is sent while they are held at one (a pause), so the
    # job cannot end before it is heard.
    orders = (msg.Reshard(layout=whole, at_step=0),  # a data-parallel job keeps its layout
              msg.Reshard(layout=whole, shares=[1, 1, 1], at_step=0),  # 3 rows, the batch has 4
              msg.Reshard(layout=whole, shares=[0, 3, 1], at_step=0, reason="test"))
    for k, order in enumerate(orders, start=1):
        if k > 1:
            for p in procs:
                p.send(msg.Pause())
            pump(lambda: all(s.count(msg.Status(status="paused")) == k for s in seen))
        procs[0].send(order)
        for p in procs:
            p.send(msg.Resume())
        if k < len(orders):
            pump(lambda: len(refusals()) == 2 + k)
    pump(lambda: all(p.finished() for p in procs))
    owner = seen[0]
    assert all(steps(i) == list(range(1, 21)) for i in range(3))
    why = refusals()
    assert why[:2] == ["layout has 3 ranks, the job 1 per data-parallel group",
                       "shares [2, 2] name 2 data-parallel groups, the job has 3"], why
    assert "a data-parallel run keeps its layout live" in why[2], why
    assert "shares [1, 1, 1] sum to 3 rows, the batch has 4" in why[3], why
    (moved,) = [e for e in owner if e.kind == "resharded"]
    assert moved.shares == [0, 3, 1] and moved.layout == whole and moved.moved_bytes == 0 and moved.reason == "test"
    assert held < moved.step < 20
    assert [e.when for e in owner if e.kind == "eval"] == ["before", "after"]
    assert [e.step for e in owner if e.kind == "checkpoint"] == [10]
    assert owner[-1] == msg.Completed(step=20, epoch=2, export_dir=str(tmp_path / "export"))
    assert all(ev[-1].kind == "completed" for ev in seen)
    # every rank reports the global batch's loss
    assert len({tuple(e.loss for e in ev if e.kind == "metrics") for ev in seen}) == 1
    meta = read_meta(tmp_path / "ckpt")  # saved under the shares of its step
    assert meta["step"] == 10 and meta["shares"] == ([0, 3, 1] if moved.step < 10 else [1, 0, 3])

    # Resume at step 10 on a 2x2 mesh (other shares, a lopsided layout): the same end point.
    spec2 = job_spec(model, data, tmp_path / "export2", max_steps=20, checkpoint_interval=10)
    events = wait_ranks(start(tmp_path, spec2, MESH, (2, 2), resume_step=10, version=2))
    assert [e.step for e in events[0] if e.kind == "metrics"] == list(range(11, 21))
    max_abs, rel = runkit.compare(_load(tmp_path / "export2"), _load(tmp_path / "export"))
    assert max_abs <= 5e-4 and rel <= 1e-5

    rows = [{"text": t, "label": i % 2} for i, t in enumerate(runkit.texts(40))]  # make_case's
    r = spec["recipe"]
    reference, _ = runkit.reference_train(model, rows, "classify", steps=20, batch_size=r["batch_size"], lr=r["lr"],
                                          seed=r["seed"], shuffle=True, n_train=32)
    max_abs, rel = runkit.compare(_load(tmp_path / "export"), reference)
    assert max_abs <= 5e-4 and rel <= 1e-5, (max_abs, rel)
    moved = runkit.compare(_load(model), reference)
    assert moved[1] > 100 * 1e-5, moved
