"""An engine says what it can do (`Engine.capabilities`); the lifecycle asks instead of probing."""

from __future__ import annotations

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


def test_the_data_parallel_engine_keeps_checkpoints_and_refuses_a_live_reshard_as_a_layout() -> None:
    from xronos.node.rank.dpengine import DPEngine
    from xronos.protocol.layout import LayoutError

    assert DPEngine.capabilities == Capabilities(live_reshard=False, checkpoints=True)
    # A re-shard word reaching a data-parallel run is refused like a layout it cannot take
    # (LayoutError: the lifecycle tells the sink and the run goes on), not a crash.
    with pytest.raises(LayoutError, match="does not re-shard live"):
        DPEngine().reshard(None, None, 3)
