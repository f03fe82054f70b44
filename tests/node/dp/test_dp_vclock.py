"""Data parallelism on the emulator's virtual clock: with `auto`, DDP's gradient buckets go
through the group's clock (`clocked`), so each one costs the modelled link and a slow box makes
the others wait for it, in virtual time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ckpts import make_batch, make_checkpoint
from safetensors.torch import save_file
from tp_world import run_world

from xronos.node.emulate.link import Link

WORKER = Path(__file__).with_name("dp_vclock_worker.py")


@pytest.mark.slow
def test_gradient_buckets_meet_the_virtual_clock(tmp_path: Path) -> None:
    ckpt = make_checkpoint("gpt2-lm", tmp_path / "gpt2-lm")
    save_file(make_batch("gpt2-lm", B=6), str(tmp_path / "batch.safetensors"))
    bw, lat = 1e6, 0.01  # a slow link: a bucket's all-reduce (~120 kB) takes ~0.13 virtual seconds
    job = {"ckpt": str(ckpt), "batch": str(tmp_path / "batch.safetensors"), "speeds": [1.0, 0.25],
           "bandwidth_Bps": bw, "latency_s": lat, "shares": [3, 3], "steps": 3}
    run_world(WORKER, 2, job, tmp_path / "out", timeout=180)
    fast, slow = (json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2))
    link = Link(bw, lat)
    for f, s in zip(fast["steps"], slow["steps"]):
        assert fast["mode"] == slow["mode"] == "clocked"
        assert f["buckets"] == s["buckets"] and len(f["buckets"]) >= 1
        grads = [[sp for sp in r["spans"] if sp[1] == "grad"] for r in (f, s)]
        assert [len(g) for g in grads] == [len(f["buckets"])] * 2  # every bucket met the clock, tagged
        for k, nbytes in enumerate(f["buckets"]):
            (_, _, f_start, f_sec), (_, _, s_start, s_sec) = grads[0][k], grads[1][k]
            assert f_start + f_sec == pytest.approx(s_start + s_sec, abs=1e-6)  # both leave together
            # the last to arrive (the slow box) pays the link alone; the fast box waited for it too
            assert s_sec == pytest.approx(link.seconds("all_reduce_sum", nbytes, 2), rel=0.2)
            assert f_sec > s_sec


MESH_WORKER = Path(__file__).with_name("dp_mesh_vclock_worker.py")


@pytest.mark.slow
def test_a_mesh_on_virtual_clocks_leaves_each_collective_together(tmp_path: Path) -> None:
    """A 2x2 DP×TP mesh, four boxes of different speeds: the TP groups' activation all-reduces and
    the DP groups' gradient buckets are collectives of different groups on one clock per rank.
    Every group's ranks must leave each of its collectives at the same virtual time (each group
    keeps its own clock base: `node/dp/mesh.GroupClock`), and a bucket costs at least the link."""
    ckpt = make_checkpoint("gpt2-lm", tmp_path / "gpt2-lm")
    save_file(make_batch("gpt2-lm", B=6), str(tmp_path / "batch.safetensors"))
    job = {"ckpt": str(ckpt), "batch": str(tmp_path / "batch.safetensors"), "speeds": [1.0, 0.3, 0.6, 0.45],
           "bandwidth_Bps": 1e6, "latency_s": 0.01, "shares": [4, 2], "steps": 3,
           "layout": {"attn": [3, 1], "mlp": [96, 32], "vocab": [64, 33]}}
    run_world(MESH_WORKER, 4, job, tmp_path / "out", timeout=180)
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["tp"] for r in ranks] == [[0, 2], [1, 2], [0, 2], [1, 2]]
    assert [r["dp"] for r in ranks] == [[0, 2], [0, 2], [1, 2], [1, 2]]
    assert all(r["mode"] == "clocked" for r in ranks)
    for kind, peers in (("tp", [(0, 1), (2, 3)]), ("dp", [(0, 2), (1, 3)])):
        for a, b in peers:
            for sa, sb in zip(ranks[a]["steps"], ranks[b]["steps"]):
                spans_a, spans_b = ([s for s in st[kind] if s[0] != "mark"] for st in (sa, sb))  # marks: no meeting
                assert len(spans_a) == len(spans_b) > 0 and [s[:2] for s in spans_a] == [s[:2] for s in spans_b]
                for x, y in zip(spans_a, spans_b):
                    assert x[2] + x[3] == pytest.approx(y[2] + y[3], abs=1e-6), (kind, a, b, x, y)
                if kind == "dp":
                    assert all(s[1] == "grad" and s[3] >= 0.01 for s in spans_a)  # the link's latency at least
