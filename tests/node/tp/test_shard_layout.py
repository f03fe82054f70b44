import pytest

from xronos.node.tp.layout import ShardLayout
from xronos.protocol.layout import LayoutError, Sizes

SIZES = Sizes(attn=4, mlp=10, vocab=7)


def test_each_kind_has_its_own_ranges():
    lay = ShardLayout(attn=(0, 3, 1), mlp=(6, 0, 4), vocab=(2, 2, 3), rank=1)
    assert lay.world_size == 3
    assert [lay.range("attn", r) for r in range(3)] == [(0, 0), (0, 3), (3, 4)]
    assert [lay.range("mlp", r) for r in range(3)] == [(0, 6), (6, 6), (6, 10)]
    assert lay.range("vocab") == (2, 4) and lay.count("mlp") == 0 and lay.share("attn") == 0.75
    lay.check(SIZES)
    assert ShardLayout.single(SIZES).range("vocab") == (0, 7)


def test_tied_layout_follows_the_attention_share_exactly():
    lay = ShardLayout.tied((1, 3), Sizes(attn=4, mlp=12, vocab=10), 0)
    assert (lay.mlp, lay.vocab) == ((3, 9), (2, 8))


@pytest.mark.parametrize("kw", [
    dict(attn=(), mlp=(), vocab=(), rank=0),
    dict(attn=(0, 0), mlp=(1, 1), vocab=(1, 1), rank=0),
    dict(attn=(1, -1), mlp=(1, 1), vocab=(1, 1), rank=0),
    dict(attn=(2, 2), mlp=(1, 1), vocab=(1, 1), rank=2),
    dict(attn=(1.5, 2), mlp=(1, 1), vocab=(1, 1), rank=0),
    dict(attn=(1, 1), mlp=(1, 1, 1), vocab=(1, 1), rank=0),
])
def test_bad_layouts_are_refused(kw):
    with pytest.raises(ValueError):
        ShardLayout(**kw)


def test_a_layout_that_misses_the_model_names_the_kind():
    with pytest.raises(LayoutError, match="mlp: layout \\[6, 0, 3\\] sums to 9, but the model has 10 MLP columns"):
        ShardLayout(attn=(0, 3, 1), mlp=(6, 0, 3), vocab=(2, 2, 3), rank=0).check(SIZES)
    with pytest.raises(ValueError):
        ShardLayout(attn=(1, 1), mlp=(1, 1), vocab=(1, 1), rank=0).range("attn", 5)
