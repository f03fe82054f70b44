"""A live re-shard order (the gateway's JobReshard, broadcast by the owner) is checked like an
Assignment before any rank moves: counts that cover the model, and cuts on the kinds' quanta."""

from types import SimpleNamespace

import re

import pytest

from xronos.node.rank.relayout import move
from xronos.node.rank.lifecycle import Reshard
from xronos.protocol.layout import Layout, LayoutError, Sizes

SIZES = Sizes(attn=12, mlp=100, vocab=128)
OLD = Layout(attn=(6, 6), mlp=(64, 36), vocab=(64, 64))


def _collective(*_a, **_k):
    raise AssertionError("a refused layout reached the collective part of the move")


def _move(new: Layout):
    engine = SimpleNamespace(layout=SimpleNamespace(layout=lambda: OLD),
                             family=SimpleNamespace(sizes=lambda config: SIZES), spec_cache=_collective)
    rank = SimpleNamespace(group=SimpleNamespace(world_size=2, rank=0), cfg=None, facts=SimpleNamespace(config={}))
    return move(engine, rank, Reshard(new, "test"), 7)


@pytest.mark.parametrize("new, message", [
    (Layout(attn=(6, 6), mlp=(50, 50), vocab=(64, 64)),
     "mlp: the cut after rank 0 falls at 50, not a multiple of the MLP columns quantum 32"),
    (Layout(attn=(6, 6), mlp=(64, 36), vocab=(100, 28)),
     "vocab: the cut after rank 0 falls at 100, not a multiple of the vocabulary rows quantum 32"),
    (Layout(attn=(6, 5), mlp=(64, 36), vocab=(64, 64)), "attn: counts [6, 5] sum to 11, but the model has 12"),
    (Layout(attn=(4, 4, 4), mlp=(32, 32, 36), vocab=(64, 64, 0)), "layout has 3 ranks, the world 2"),
])
def test_a_bad_order_is_refused_before_anything_moves(new, message):
    with pytest.raises(LayoutError, match=re.escape(message)):
        _move(new)
