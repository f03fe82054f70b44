"""An engine says what it can do (`Engine.capabilities`); the lifecycle asks instead of probing."""

from __future__ import annotations

import re

import pytest

from xronos.node.rank.lifecycle import Capabilities, Checkpoints, Engine, run
from xronos.node.rank.tpengine import TPEngine
from xronos.node.runconfig import RunConfig
from xronos.protocol.layout import Layout
from xronos.protocol.recipe import Recipe


class Plain(Engine):
    """An engine of the default kind: no checkpoints, no live re-shard."""


def test_a_run_that_needs_checkpoints_refuses_an_engine_without_them_before_joining() -> None:
    recipe = Recipe(model_dir="/nowhere", data_path="/nowhere.csv", task="classify", batch_size=2, seq_len=8,
                    lr=1e-4, max_steps=2)
    cfg = RunConfig(recipe=recipe, layout=Layout(attn=(12,), mlp=(64,), vocab=(37,)),
                    rendezvous_port=1)  # nothing listens there: a join would fail, not this check
    with pytest.raises(ValueError, match="Plain keeps no checkpoints"):
        run(cfg, Plain(), weights=None, checkpoints=Checkpoints("/tmp/x", 1))


def test_what_the_engines_declare() -> None:
    assert Plain.capabilities == Capabilities(live_reshard=False, checkpoints=False)
    assert Plain().last_move() is None
    assert TPEngine.capabilities == Capabilities(live_reshard=True, checkpoints=True)
    assert TPEngine().last_move() is None and TPEngine().lora is None  # before any build or move


def _dp_rank(shares=(2, 2)):
    """A data-parallel engine between two steps, as `relayout.resplit` sees it (its shares, the run's
    settings, the group's clock, the rows channel): pure bookkeeping, no group."""
    from types import SimpleNamespace

    from xronos.node.dp.mesh import Mesh
    from xronos.node.rank.dpengine import DPEngine

    recipe = Recipe(model_dir="/m", data_path="/d.csv", task="classify", batch_size=4, seq_len=8, lr=1e-4,
                    max_steps=20)
    cfg = RunConfig(recipe=recipe, layout=WHOLE, shares=shares)
    engine = DPEngine()
    engine.shares = tuple(shares)
    engine.mesh = Mesh(None, None, tuple(shares))  # its groups are not asked
    rank = SimpleNamespace(cfg=cfg, group=SimpleNamespace(now=lambda: 0.0), data=SimpleNamespace(shares=tuple(shares)))
    return engine, rank


WHOLE = Layout(attn=(12,), mlp=(64,), vocab=(37,))


def test_the_data_parallel_engine_re_splits_live_and_refuses_what_it_cannot_take() -> None:
    import dataclasses

    from xronos.node.rank.dpengine import DPEngine
    from xronos.node.rank.lifecycle import Reshard
    from xronos.node.rank.relayout import resplit
    from xronos.protocol.layout import LayoutError

    assert DPEngine.capabilities == Capabilities(live_reshard=True, checkpoints=True)
    for word, why in (
        (Reshard(WHOLE, "r"), "re-shard at step 3: a data-parallel run keeps its layout live (attn=12;mlp=64;vocab=37)"),
        (Reshard(Layout(attn=(6, 6), mlp=(32, 32), vocab=(32, 5)), "r", (1, 3)),
         "re-split at step 3: layout attn=6,6;mlp=32,32;vocab=32,5 differs from the run's attn=12;mlp=64;vocab=37"),
        (Reshard(WHOLE, "r", (1, 1, 2)), "shares [1, 1, 2] name 3 data-parallel groups, the run has 2"),
        (Reshard(WHOLE, "r", (5, -1)), "shares [5, -1]: rows per group must be integers >= 0"),
        (Reshard(WHOLE, "r", (1, 1)), "shares [1, 1] sum to 2 rows, the batch has 4"),
    ):
        engine, rank = _dp_rank()
        with pytest.raises(LayoutError, match=re.escape(why)):  # the lifecycle tells the sink; the run goes on
            resplit(engine, rank, word, 3)
        assert engine.shares == rank.data.shares == (2, 2)  # nothing changed
    engine, rank = _dp_rank()
    move = resplit(engine, rank, Reshard(WHOLE, "test", (4, 0)), 3)
    assert engine.shares == engine.mesh.shares == rank.data.shares == (4, 0)  # the rows channel follows
    assert dataclasses.astuple(move) == (3, "test", WHOLE.to_text(), WHOLE.to_text(), 0.0, 0, (2, 2), (4, 0))
    # and a tensor-parallel run refuses shares
    with pytest.raises(LayoutError, match=re.escape("shares [1, 3], but the run is tensor-parallel")):
        from xronos.node.rank.relayout import move as tp_move

        tp_move(type("E", (), {"layout": type("L", (), {"layout": lambda self: WHOLE})()})(), rank,
                Reshard(WHOLE, "r", (1, 3)), 3)
