"""TP primitives in a real 3-process Gloo world with a 0-unit rank and a lopsided split, and their
world-of-one behaviour in process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tp_world import run_world

from xronos.node.tp.group import TPGroup
from xronos.node.tp.layers import RowParallelLinear, Split, VocabParallelEmbedding, vocab_parallel_cross_entropy
from xronos.node.tp.layout import ShardLayout
from xronos.node.tp.mappings import copy_to_tp, reduce_from_tp

WORKER = Path(__file__).with_name("prim_worker.py")


def test_primitives_in_a_lopsided_gloo_world(tmp_path):
    # H = 4: rank 0 holds nothing, rank 1 all but one unit, rank 2 one unit.
    run_world(WORKER, 3, {"units": [0, 3, 1]}, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("ok*")) == ["ok0", "ok1", "ok2"]


def test_world_of_one_is_plain_torch():
    g = TPGroup.single()
    x = torch.randn(3, 4, requires_grad=True)
    assert copy_to_tp(x, g) is x and reduce_from_tp(x, g) is x
    logits = torch.randn(6, 9, requires_grad=True)
    targets = torch.tensor([1, 2, -100, 8, 0, 3])
    loss = vocab_parallel_cross_entropy(logits, targets, 0, g)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, targets)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(logits.grad, ref_logits.grad)
    assert g.timings == []


def test_zero_width_layers_give_exact_zeros_and_empty_gradients():
    g = TPGroup.single()
    row = RowParallelLinear(Split.of((0, 0), 4), 5, g)
    with torch.no_grad():
        row.bias.fill_(0.5)
    x = torch.randn(2, 3, 0, requires_grad=True)
    y = row(x)
    assert torch.equal(y, torch.full((2, 3, 5), 0.5))
    y.sum().backward()
    assert row.weight.grad.shape == (5, 0) and x.grad.shape == (2, 3, 0)
    emb = VocabParallelEmbedding(7, 4, ShardLayout(attn=(1, 1), mlp=(1, 1), vocab=(0, 7), rank=0), g)
    assert emb.weight.shape == (0, 4)
    out = emb(torch.tensor([[1, 6]]))
    assert torch.equal(out, torch.zeros(1, 2, 4))
    out.sum().backward()
    assert emb.weight.grad.shape == (0, 4)


def test_group_validates_its_world():
    with pytest.raises(ValueError):
        TPGroup(None, 0, 2)
    with pytest.raises(ValueError):
        TPGroup(None, 3, 2)
