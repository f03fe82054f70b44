"""`bench/overlap.py`'s table: the host CPU the clock charged each rank's calls, beside the ratios."""

from __future__ import annotations

from xronos.bench.overlap import call_cpu, markdown


def _rank(blocking_s: float, launched_s: float) -> dict:
    return {"calls_cpu_s": {"barrier 0 B": 0.0005, "all_reduce_sum 786432 B": blocking_s},
            "flights_cpu_s": {"all_reduce_sum 393216 B": launched_s}, "rows": []}


def test_call_cpu_is_per_rank_in_host_ms_all_reduces_only() -> None:
    got = call_cpu([_rank(0.00092, 0.00115), _rank(0.00118, 0.00124)])
    assert got == [{"blocking": {"all_reduce_sum 786432 B": 0.92}, "launched": {"all_reduce_sum 393216 B": 1.15}},
                   {"blocking": {"all_reduce_sum 786432 B": 1.18}, "launched": {"all_reduce_sum 393216 B": 1.24}}]


def test_the_table_lists_each_ranks_call_cpu_with_its_speed() -> None:
    mode = {"median_s": 0.7, "min_s": 0.69, "max_s": 0.71, "compute_s": 0.5, "exposed_comm_share": 0.3,
            "wall_median_s": 0.6, "n": 4}
    res = {"cell": "demo-s64", "speeds": [0.9, 0.3], "shape": "minilm", "blocks": None, "batch": 8, "seq": 64,
           "modes": ["off", "c2"], "off": mode, "c2": {**mode, "ratio": 1.14},
           "call_cpu_ms": call_cpu([_rank(0.00092, 0.00115), _rank(0.00118, 0.00124)])}
    text = markdown([res], "load 1.0", ["--cells", "demo-s64"], 60.0)
    assert "| demo-s64 | 1 | 1 (0.3) | 786432 B 1.18 | 393216 B 1.24 |" in text
    assert "a box pays it at its speed" in text
    # a wall-clock run has no clock charges: no such table
    assert "Host CPU the clock charged" not in markdown([{k: v for k, v in res.items() if k != "call_cpu_ms"}],
                                                        "load 1.0", [], 60.0)
