"""The per-segment layout as data: coverage, quanta, the head-tied form, parsing (no torch)."""

import pytest

from xronos.protocol.layout import QUANTA, Layout, LayoutError, Sizes

GPT2M = Sizes(attn=16, mlp=4096, vocab=50257)


def test_ranges_are_contiguous_per_kind():
    lay = Layout(attn=(8, 0, 8), mlp=(1024, 2048, 1024), vocab=(0, 49984, 273))
    assert lay.world_size == 3
    assert [lay.range("attn", r) for r in range(3)] == [(0, 8), (8, 8), (8, 16)]
    assert lay.range("vocab", 2) == (49984, 50257)
    lay.check(GPT2M)
    assert "attn 8/0/8" in lay.describe()


@pytest.mark.parametrize("lay, message", [
    (Layout(attn=(8, 7), mlp=(2048, 2048), vocab=(25000, 25257)), "attn: counts \\[8, 7\\] sum to 15, but the model has 16 attention units"),
    (Layout(attn=(8, 8), mlp=(2000, 2096), vocab=(25024, 25233)), "mlp: the cut after rank 0 falls at 2000, not a multiple of the MLP columns quantum 32"),
    (Layout(attn=(8, 8), mlp=(2048, 2048), vocab=(25000, 25257)), "vocab: the cut after rank 0 falls at 25000"),
])
def test_check_names_the_kind_and_the_numbers(lay, message):
    with pytest.raises(LayoutError, match=message):
        lay.check(GPT2M)


def test_world_size_and_engine_level_checks():
    lay = Layout(attn=(8, 8), mlp=(2000, 2096), vocab=(25000, 25257))
    lay.check(GPT2M, quanta=None)  # the engine takes any cut
    with pytest.raises(LayoutError, match="layout has 2 ranks but the world has 3"):
        lay.check(GPT2M, world_size=3, quanta=None)


def test_the_last_holder_of_a_kind_takes_the_remainder():
    # 50257 = 1570 * 32 + 17: cuts on multiples of 32, the rank holding the end has the 17.
    lay = Layout.from_quanta((5, 5, 6), (40, 40, 48), (0, 1000, 571), GPT2M)
    assert lay.vocab == (0, 32000, 18257) and lay.mlp == (1280, 1280, 1536)
    lay.check(GPT2M)
    # ... also when later ranks hold nothing of it.
    Layout(attn=(8, 8, 0), mlp=(2048, 2048, 0), vocab=(32000, 18257, 0)).check(GPT2M)


def test_tied_layout_is_the_papers_unit_cut_on_the_quantum():
    lay = Layout.tied((5, 4, 4, 3), GPT2M)
    assert lay.mlp == (1280, 1024, 1024, 768)  # 256 columns per head
    lay.check(GPT2M)
    assert all(c % QUANTA["vocab"] == 0 for c in lay.vocab[:-1])
    assert Layout.tied((5, 4, 4, 3), GPT2M, quanta=None).vocab[0] == round(50257 * 5 / 16)
    with pytest.raises(LayoutError, match="sum to the model's 16 attention units"):
        Layout.tied((5, 4), GPT2M)


def test_parse_the_cli_form_and_refuse_malformed_ones():
    lay = Layout.parse("attn=4,12;mlp=1024,3072;vocab=32000,18257")
    assert lay.attn == (4, 12) and lay.vocab == (32000, 18257)
    assert Layout.parse(lay.to_text()) == lay
    for bad, message in [("attn=4,12;mlp=1024,3072", "missing vocab"),
                         ("attn=4,12;mlp=1024;vocab=1,2", "one count per rank"),
                         ("attn=4,x;mlp=1,2;vocab=1,2", "attn must be comma-separated integers"),
                         ("attn=4,-1;mlp=1,2;vocab=1,2", "attn counts must be >= 0"),
                         ("heads=4;mlp=1;vocab=1", "expected kind=c1,c2"),
                         ("attn=1;attn=1;mlp=1;vocab=1", "attn given twice")]:
        with pytest.raises(LayoutError, match=message):
            Layout.parse(bad)


def test_wire_form_is_strict():
    with pytest.raises(ValueError):
        Layout(attn=(1, 2), mlp=(1,), vocab=(1, 2))
    with pytest.raises(ValueError):
        Layout.model_validate({"attn": [1], "mlp": [1], "vocab": [1], "heads": [1]})
    assert Layout.model_validate({"attn": [1, 2], "mlp": [3, 4], "vocab": [5, 6]}).mlp == (3, 4)
