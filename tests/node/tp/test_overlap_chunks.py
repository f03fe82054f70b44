"""Forward chunking's settings and its exactness in a world of one (in process; across real Gloo
ranks: tests/node/models/test_overlap_equivalence.py)."""

from __future__ import annotations

import pytest
import torch

from xronos.node.models.loading import init_random
from xronos.node.models.registry import family_by_name
from xronos.node.tp.group import TPGroup
from xronos.node.tp.layout import ShardLayout
from xronos.node.tp.overlap import check_chunks

ARCH = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48, vocab_size=61,
            max_positions=64, num_labels=None, tie_word_embeddings=False)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "2", None])
def test_a_chunk_count_that_is_not_a_positive_integer_is_refused_naming_it_and_the_batch(bad):
    with pytest.raises(ValueError, match=rf"chunks must be a positive integer, got {bad!r} \(batch size 8\)"):
        check_chunks(bad, 8)


def test_a_chunk_count_that_leaves_a_chunk_without_a_row_is_refused():
    assert check_chunks(8, 8) == 8 and check_chunks(1, 1) == 1
    with pytest.raises(ValueError, match="chunks 9 leaves a chunk without a row: the batch has 8 rows"):
        check_chunks(9, 8)


def _model(family: str, group: TPGroup):
    fam = family_by_name(family)
    config = fam.config_from_arch({**ARCH, "family": family, "num_kv_heads": ARCH["num_heads"]
                                   if family == "gpt2" else ARCH["num_kv_heads"]})
    layout = ShardLayout.single(fam.sizes(config))
    return init_random(fam.build(config, "causal-lm", layout, group), seed=3)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3"])
def test_chunked_forward_and_backward_are_the_unchunked_ones(family):
    ids = torch.randint(1, ARCH["vocab_size"], (5, 7), generator=torch.Generator().manual_seed(0))
    out = {}
    for chunks in (1, 2, 5):
        group = TPGroup.single()
        model = _model(family, group)
        group.chunks = chunks
        loss = model(ids, labels=ids)
        loss.backward()
        out[chunks] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    for chunks in (2, 5):
        torch.testing.assert_close(out[chunks][0], out[1][0], rtol=1e-6, atol=1e-7)
        for name, g in out[1][1].items():
            torch.testing.assert_close(out[chunks][1][name], g, rtol=1e-5, atol=1e-7, msg=name)
    group = TPGroup.single()
    model = _model(family, group)
    group.chunks = 6
    with pytest.raises(ValueError, match="chunks 6 leaves a chunk without a row: the batch has 5 rows"):
        model(ids, labels=ids)
    for bad in (0, "2"):
        group.chunks = bad
        with pytest.raises(ValueError, match=rf"chunks must be a positive integer, got {bad!r} \(batch size 5\)"):
            model(ids, labels=ids)
