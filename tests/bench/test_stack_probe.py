"""The network-stack probe's arithmetic, and one tiny run of it through a real netns link and on
loopback (nothing timed is asserted: host timing is the bench's)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from xronos.bench import stack_probe
from xronos.bench.stack_probe import per_byte, progress_of, stack_of, summarise


def test_the_slope_is_least_squares_through_the_origin_and_never_negative():
    assert per_byte([(1e6, 2e-3), (2e6, 4e-3)]) == pytest.approx(2e-9)
    assert per_byte([(1e6, 1e-3), (2e6, 3e-3)]) == pytest.approx((1e6 * 1e-3 + 2e6 * 3e-3) / (1e12 + 4e12))
    assert per_byte([(1e6, -1e-3)]) == 0.0  # loopback's charge covered all the real link took
    for bad in ([], [(0, 1e-3)], [(1e6, float("nan"))]):
        with pytest.raises(ValueError, match="need points of bytes > 0 and finite seconds"):
            per_byte(bad)


def _rows(n: int, alone: list[float], flight: list[float], charges: list[float]) -> dict[str, list[dict]]:
    return {f"alone{n}": [{"wall": w, "burst_thread": 0.020, "charge": 0.0, "blocking": 0.002, "done": None}
                          for w in alone],
            f"flight{n}": [{"wall": w, "burst_thread": 0.0205, "charge": c, "blocking": 0.002 + 0.001 * k,
                            "done": 0.005 if k else None} for k, (w, c) in enumerate(zip(flight, charges))]}


def test_steal_is_the_median_of_paired_differences_and_charge_the_clocks_minimum():
    # the host slowed down in the third pair: paired, it does not show as steal
    rows = _rows(1000, [0.020, 0.021, 0.030], [0.022, 0.0225, 0.0312], [0.4e-3, 0.3e-3, 0.9e-3])
    (s,) = summarise(rows, [1000]).values()
    assert s["steal_s"] == pytest.approx(0.0015)
    assert s["charge_s"] == pytest.approx(0.3e-3) and s["thread_s"] == pytest.approx(0.5e-3)
    assert s["blocking_s"] == pytest.approx(0.003) and s["done_s"] == pytest.approx(0.005)  # never seen: left out


def test_the_stack_is_the_real_links_steal_beyond_loopbacks_charge():
    sizes = [1_000_000, 2_000_000]

    def rank(steal: tuple[float, float], charge: tuple[float, float]) -> dict:
        return {str(n): {"steal_s": s, "charge_s": c, "thread_s": 0.0, "blocking_s": 1e-3, "done_s": 2e-3}
                for n, s, c in zip(sizes, steal, charge)}

    real = [rank((2.5e-3, 4.5e-3), (1e-3, 1.6e-3)), rank((2.3e-3, 4.3e-3), (1e-3, 1.6e-3))]
    loop = [rank((0.7e-3, 1.1e-3), (0.4e-3, 0.4e-3)), rank((0.9e-3, 1.3e-3), (0.4e-3, 0.4e-3))]
    doc = stack_of(real, loop, sizes)
    s = doc["sizes"]["1000000"]
    assert s["real_steal_s"] == pytest.approx(2.4e-3) and s["loop_steal_s"] == pytest.approx(0.8e-3)
    assert s["loop_charge_s"] == pytest.approx(0.4e-3)
    assert doc["stack_s_per_byte"] == pytest.approx(per_byte([(1e6, 2.0e-3), (2e6, 4.0e-3)])) == pytest.approx(2e-9)
    assert doc["progress_s"] == pytest.approx(1e-3)  # seen complete at 2 ms, blocking 1 ms
    never = [{str(n): dict(r[str(n)], done_s=float("nan")) for n in sizes} for r in real]
    unseen = stack_of(never, [{str(n): dict(r[str(n)], done_s=float("nan")) for n in sizes} for r in loop], sizes)
    assert unseen["stack_s_per_byte"] == doc["stack_s_per_byte"]  # the stack's figure does not depend on it
    assert unseen["progress_s"] != unseen["progress_s"]  # nan: no call seen complete, no delay to take


def test_the_progress_delay_is_the_median_lateness_beside_the_busy_core_on_both_links():
    def size(real_done, real_blocking, loop_done, loop_blocking):
        return {"real_done_s": real_done, "real_blocking_s": real_blocking,
                "loop_done_s": loop_done, "loop_blocking_s": loop_blocking}

    # the stack-probe-off.md figures: 5.4, 6.9, 4.5 ms late on the real link, 6.3, 5.5, 5.4 on loopback
    per = {"393216": size(8.80e-3, 3.43e-3, 6.66e-3, 0.37e-3), "786432": size(12.84e-3, 5.93e-3, 6.06e-3, 0.53e-3),
           "1572864": size(17.05e-3, 12.54e-3, 6.33e-3, 0.90e-3)}
    assert progress_of(per) == pytest.approx(statistics.median([5.37e-3, 6.91e-3, 4.51e-3, 6.29e-3, 5.53e-3, 5.43e-3]))
    per["1572864"]["real_done_s"] = float("nan")  # never seen complete during its burst: left out
    assert progress_of(per) == pytest.approx(5.53e-3)
    assert progress_of({"4": size(1e-3, 2e-3, 1e-3, 2e-3)}) == 0.0  # no later than blocking: no delay
    with pytest.raises(ValueError, match="no call in flight was seen complete"):
        progress_of({"4": size(float("nan"), 1e-3, float("nan"), 1e-3)})


def test_bad_sizes_and_reps_are_refused_by_name(capsys):
    for argv, msg in ((["--sizes", "10"], "multiples of 4 bytes"), (["--sizes", "4k"], "comma-separated byte counts"),
                      (["--reps", "2"], "--reps must be at least 5")):
        with pytest.raises(SystemExit):
            stack_probe.main(argv)
        assert msg in capsys.readouterr().err


@pytest.mark.slow
def test_a_tiny_probe_runs_on_the_real_link_and_on_loopback(tmp_path: Path):
    from xronos.bench import netem
    from xronos.node.emulate.confinement import EmulatorError

    try:
        netem.check_available()
    except EmulatorError as exc:
        pytest.skip(f"network namespaces unavailable here: {exc}")
    assert stack_probe.main(["--sizes", "4096,65536", "--reps", "5", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "stack-probe.json").read_text())
    assert len(doc["real"]) == len(doc["loopback"]) == 2 and doc["stack_s_per_byte"] >= 0 and doc["progress_s"] >= 0
    assert set(doc["sizes"]) == {"4096", "65536"} and doc["burst_s"] == pytest.approx(0.020)
    assert "| 65536 |" in (tmp_path / "stack-probe.md").read_text() and "progress_s =" in (tmp_path / "stack-probe.md").read_text()
