"""The heap probe's depth growth from repeated draws (pure: the child processes are faked)."""

from __future__ import annotations

from xronos.node.measure import heapprobe

MiB = 1 << 20


def fake_probe(draws: dict[int, list[float]], calls: list[int]):
    """measure_in_child stand-in: per depth, the next draw's slack (MiB) in order."""
    def probe(job: dict, threads: int) -> dict[str, int]:
        calls.append(job["blocks"])
        return {"slack": int(draws[job["blocks"]].pop(0) * MiB), "span": 1, "in_use_peak": 1}
    return probe


def test_growth_is_taken_between_the_medians_of_three_draws_per_depth(monkeypatch):
    """Draws of the spread measured on RoBERTa-base's smallest width (26.8-41.4 MiB at one block,
    63.5-89.5 at four: bench/results/mem-peak-v9.md) with one outlier per depth: the first pair
    alone gives 57 and 9 MiB per block (main's profile would carry that), the medians 36 and 17."""
    calls: list[int] = []
    monkeypatch.setattr(heapprobe, "measure_in_child", fake_probe({1: [57, 34, 36], 4: [84, 99, 87]}, calls))
    one, growth = heapprobe.slack_per_depth({"layout": {}}, 1)
    assert calls == [1, 4, 1, 4, 1, 4]  # interleaved, each in its own process
    assert one == 36 * MiB
    assert growth == round((87 - 36) * MiB / 3)


def test_growth_is_never_negative_and_a_probe_without_mallinfo_measures_nothing(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(heapprobe, "measure_in_child", fake_probe({1: [50, 52, 51], 4: [40, 45, 60]}, calls))
    assert heapprobe.slack_per_depth({}, 1) == (51 * MiB, 0)
    monkeypatch.setattr(heapprobe, "measure_in_child", lambda job, threads: {})
    assert heapprobe.slack_per_depth({}, 1) == (0, 0)
