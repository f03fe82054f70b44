"""The attention core: the explicit path taken when attention-prob dropout is on must compute
what sdpa computes (checked with a keep probability of 1 - 1e-12), for every mask kind."""

import pytest
import torch

from xronos.node.models.common import Dropout, DropoutStreams, attend, attention_mask_bool


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2, 0])
def test_explicit_attention_path_equals_sdpa(causal, padded, kv_heads):
    g = torch.Generator().manual_seed(0)
    h = 4 if kv_heads else 0
    q = torch.randn(2, h, 6, 8, generator=g)
    k, v = torch.randn(2, 2, kv_heads, 6, 8, generator=g)
    am = torch.ones(2, 6, dtype=torch.long)
    if padded:
        am[0, 4:] = 0
    mask = attention_mask_bool(am, causal)
    assert (mask is None) == (not padded)
    streams = DropoutStreams(rank=0)
    fused = attend(q, k, v, mask, 0.3, Dropout(0.0, streams, partitioned=True), causal)
    explicit_drop = Dropout(1e-12, streams, partitioned=True)  # training module -> explicit path
    explicit = attend(q, k, v, mask, 0.3, explicit_drop, causal)
    assert fused.shape == explicit.shape == (2, 6, h * 8)
    torch.testing.assert_close(explicit, fused, rtol=1e-5, atol=1e-6)


def test_dropout_streams_replicated_same_per_rank_distinct():
    a, b = DropoutStreams(rank=0, seed=5), DropoutStreams(rank=3, seed=5)
    x = torch.ones(1000)
    da, db = Dropout(0.5, a), Dropout(0.5, b)
    assert torch.equal(da(x), db(x))  # replicated stream: same elements dropped on every rank
    pa, pb = Dropout(0.5, a, partitioned=True), Dropout(0.5, b, partitioned=True)
    assert not torch.equal(pa(x), pb(x))  # per-rank stream for partitioned activations
    da.eval()
    assert da(x) is x
    with pytest.raises(ValueError):
        Dropout(1.0, a)
