import pytest

from xronos.node.tp.layout import ShardLayout, unit_bounds


def test_unit_bounds_spreads_the_remainder_over_the_first_units():
    assert unit_bounds(10, 4) == [0, 3, 6, 8, 10]
    assert unit_bounds(8, 4) == [0, 2, 4, 6, 8]
    assert unit_bounds(2, 4) == [0, 1, 2, 2, 2]
    assert unit_bounds(0, 3) == [0, 0, 0, 0]


@pytest.mark.parametrize("total,H", [(10, 4), (50257, 16), (3072, 12), (7, 7), (5, 1)])
def test_unit_bounds_cover_total_with_near_equal_chunks(total, H):
    b = unit_bounds(total, H)
    sizes = [b[i + 1] - b[i] for i in range(H)]
    assert b[0] == 0 and b[-1] == total and len(b) == H + 1
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_layout_ranges_ratios_and_slices():
    lay = ShardLayout((0, 3, 1), rank=1)
    assert (lay.H, lay.world_size) == (4, 3)
    assert [lay.unit_range(r) for r in range(3)] == [(0, 0), (0, 3), (3, 4)]
    assert lay.unit_range() == (0, 3) and lay.ratio() == 0.75 and lay.ratio(0) == 0.0
    # intermediate 10 on H=4 -> [0, 3, 6, 8, 10]
    assert [lay.slice_of(10, r) for r in range(3)] == [(0, 0), (0, 8), (8, 10)]
    assert ShardLayout.single(12).slice_of(30522) == (0, 30522)


@pytest.mark.parametrize("units,rank", [((), 0), ((0, 0), 0), ((1, -1), 0), ((2, 2), 2), ((1.5, 2), 0)])
def test_bad_layouts_are_refused(units, rank):
    with pytest.raises(ValueError):
        ShardLayout(units, rank)


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        unit_bounds(10, 0)
    with pytest.raises(ValueError):
        ShardLayout((1, 1), 0).unit_range(5)
