"""Scenarios mirror the paper's sets and fit this machine's cores."""

from __future__ import annotations

import pytest

from xronos.node.emulate.confinement import RankLimits, validate_limits
from xronos.bench.scenarios import SCENARIOS, get_scenario


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_fits_two_cores(name: str) -> None:
    sc = get_scenario(name)
    shares = sc.shares()
    assert sum(shares) <= 1.8 and len(shares) == sc.n
    for scale in (1.0, 0.36, None):  # the real devices' RAM, a 6-of-24-block GPT-2-Medium's scale, no caps
        validate_limits([RankLimits(s, m) for s, m in zip(shares, sc.memory_caps(scale))], 2, None)


def test_paper_sets() -> None:
    assert [d.name for d in get_scenario("set-a").devices] == [
        "ASUS MiniPC", "Raspberry Pi 5", "Raspberry Pi 5"]
    assert get_scenario("set-b").n == 4 and get_scenario("set-c").n == 5
    # The reference figure: the ideal gain over uniform on Set-A is about 0.86.
    assert get_scenario("set-a").ideal_ratio_to_uniform() == pytest.approx(0.857, abs=0.01)
    assert get_scenario("homo").ideal_ratio_to_uniform() == 1.0


def test_unknown_scenario_and_bad_scale_refused() -> None:
    with pytest.raises(ValueError, match="unknown scenario 'set-z'"):
        get_scenario("set-z")
    with pytest.raises(ValueError, match="mem_scale"):
        get_scenario("set-a").memory_caps(0)
