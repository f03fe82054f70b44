"""AdamW's state allocated at build is torch's own lazy state: the steps are bit-identical."""

from __future__ import annotations

import math

import pytest
import torch

from xronos.node.rank.gradnorm import CHUNK, all_finite, squared_norm
from xronos.node.rank.optim import adamw
from xronos.node.rank.optstate import allocate_state


@pytest.mark.parametrize("fused", [True, False])
def test_eager_state_steps_exactly_like_lazy(fused: bool) -> None:
    torch.manual_seed(0)
    a = torch.nn.Linear(16, 8)
    b = torch.nn.Linear(16, 8)
    b.load_state_dict(a.state_dict())
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    allocate_state(ob)
    assert all(set(ob.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in b.parameters())
    x = torch.randn(4, 16)
    for _ in range(3):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad(set_to_none=True)
            m(x).pow(2).sum().backward()
            o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(oa.state[pa][k], ob.state[pb][k]), k
            assert oa.state[pa][k].dtype == ob.state[pb][k].dtype


def test_loaded_state_is_kept() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = adamw([p], lr=1e-3)
    opt.state[p] = {"step": torch.tensor(5.0), "exp_avg": torch.full((3,), 2.0), "exp_avg_sq": torch.ones(3)}
    allocate_state(opt)
    assert float(opt.state[p]["step"]) == 5.0 and float(opt.state[p]["exp_avg"][0]) == 2.0


def test_chunked_squared_norm_matches_the_whole_tensor_sum() -> None:
    g = torch.randn(CHUNK * 2 + 123)
    whole = g.double().pow(2).sum()
    assert squared_norm(g).shape == (1,)
    assert float(squared_norm(g)) == pytest.approx(float(whole), rel=1e-14)
    small = torch.randn(7, 5)
    assert float(squared_norm(small)) == float(small.double().pow(2).sum())


@pytest.mark.parametrize("values, finite", [
    ([1.0, -2.0], True),
    ([3e38] * 8, True),  # the sum overflows, no element does: the elementwise look says finite
    ([1.0, float("nan")], False),
    ([float("inf"), float("-inf")], False),  # a sum of nan, as any non-finite element gives
    ([-3e38, float("-inf")], False),
])
def test_all_finite_is_exact(values, finite):
    assert all_finite([torch.ones(3), torch.tensor(values)]) is finite
    big = torch.zeros(CHUNK + 5)  # a non-finite element in the second chunk
    big[-1:] = torch.tensor(values[-1:])
    assert all_finite([big]) is math.isfinite(values[-1])
