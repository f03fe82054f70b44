"""The measured-fit ideal (`results.measured_ideal`) is a lower bound on every measured layout and
recovers the balance exactly when the per-kind compute is affine in the counts."""

from __future__ import annotations

import itertools

import pytest

from xronos.bench.results import _balance, _balance_integer, _fits, measured_ideal, summarize

KINDS = ("attn", "mlp", "vocab")
SPEED = [1.5, 1.0, 1.0]  # Set-A
# Per kind: replicated work around the segment (a) and work per unit (b), both at speed 1.
WORK = {"attn": (0.02, 0.05), "mlp": (0.03, 0.0004), "vocab": (0.0, 0.00001)}
TOTALS = {"attn": 16, "mlp": 4096, "vocab": 50257}
KIND_PARAMS = {"attn": 16 * 1000, "mlp": 4096 * 10, "vocab": 50257 * 1}
REST = (0.1, 2e-6)  # the rest: fixed + per parameter held


def truth(d: int, layout: dict[str, list[int]]) -> dict[str, float]:
    s = SPEED[d]
    out = {k: (WORK[k][0] + WORK[k][1] * layout[k][d]) / s for k in KINDS}
    held = sum(KIND_PARAMS[k] / TOTALS[k] * layout[k][d] for k in KINDS)
    out["rest"] = (REST[0] + REST[1] * held) / s
    return out


def summary_of(layout: dict[str, list[int]]) -> dict:
    nodes = []
    for d in range(3):
        t = truth(d, layout)
        nodes.append({"units": layout["attn"][d], **{k: layout[k][d] for k in KINDS},
                      "compute_s": sum(t.values()), "compute_by_kind_s": t, "comm_s": 0.0, "data_s": 0.0})
    return {"nodes": nodes}


LAYOUTS = {
    "xronos": {"attn": [8, 4, 4], "mlp": [1536, 1280, 1280], "vocab": [21536, 14368, 14353]},
    "xronos-paper": {"attn": [8, 4, 4], "mlp": [2048, 1024, 1024], "vocab": [25120, 12576, 12561]},
    "uniform": {"attn": [6, 5, 5], "mlp": [1376, 1376, 1344], "vocab": [16768, 16768, 16721]},
}


def cost(layout: dict[str, list[int]]) -> float:
    """Sum over kinds of the slowest node, plus the slowest rest: what the layout's iteration costs."""
    per = [truth(d, layout) for d in range(3)]
    return sum(max(p[k] for p in per) for k in (*KINDS, "rest"))


def test_per_kind_ideal_is_exact_for_affine_truth_and_below_every_layout() -> None:
    summary = {k: summary_of(v) for k, v in LAYOUTS.items()}
    ideal = measured_ideal(summary, KIND_PARAMS)
    assert ideal["method"] == "per-kind"
    # Every node saw >= 2 distinct counts of every kind: the fits are the truth.
    for k in KINDS:
        for d, (a, b) in enumerate(ideal["fits"][k]):
            assert a == pytest.approx(WORK[k][0] / SPEED[d]) and b == pytest.approx(WORK[k][1] / SPEED[d])
    # Each kind's balance: all nodes finish together, T = (N + sum a/b) / sum 1/b.
    for k in KINDS:
        a, b = WORK[k]
        expect = max(a / min(SPEED), (TOTALS[k] + sum((a / s) / (b / s) for s in SPEED)) / sum(s / b for s in SPEED))
        assert ideal["per_kind_s"][k] == pytest.approx(expect)
    for layout in LAYOUTS.values():
        assert ideal["compute_s"] <= cost(layout) + 1e-12
    # Whole attention units cannot beat the continuous relaxation, and no integer layout beats them.
    assert ideal["compute_s"] <= ideal["compute_whole_heads_s"] <= cost(LAYOUTS["xronos"]) + 1e-12


def test_bound_holds_against_every_integer_attention_split() -> None:
    summary = {k: summary_of(v) for k, v in LAYOUTS.items()}
    ideal = measured_ideal(summary, KIND_PARAMS)
    mlp, vocab = LAYOUTS["xronos"]["mlp"], LAYOUTS["xronos"]["vocab"]
    best = min(cost({"attn": list(h), "mlp": mlp, "vocab": vocab})
               for h in itertools.product(range(17), repeat=3) if sum(h) == 16)
    assert ideal["compute_whole_heads_s"] <= best + 1e-12


def test_single_count_nodes_follow_the_others_ratio_and_never_held_gets_fastest_slope() -> None:
    # Node 0: two counts (a=1, b=0.5: ratio 2); node 1: one count; node 2: never held the kind.
    fits = _fits([[(2, 2.0), (4, 3.0)], [(2, 4.0), (2, 4.0)], [(0, 0.7), (0, 0.7)]])
    assert fits[0] == pytest.approx((1.0, 0.5))
    assert fits[1] == pytest.approx((2.0, 1.0))  # b = 4 / (2 + 2), a = 2 b
    assert fits[2] == pytest.approx((0.7, 0.5))  # its own replicated time, the fastest slope seen
    assert _balance([(0.0, 1.0), (0.0, 1.0)], 4) == pytest.approx(2.0)
    assert _balance([(3.0, 1.0), (0.0, 1.0)], 1) == pytest.approx(3.0)  # the floor: every intercept runs
    assert _balance_integer([(0.0, 1.0), (0.0, 2.0)], 3) == pytest.approx(2.0)  # 2 + 1 units


def test_without_per_kind_metrics_totals_are_balanced_by_parameter_share() -> None:
    summary = {k: summary_of(v) for k, v in LAYOUTS.items()}
    for s in summary.values():
        for n in s["nodes"]:
            del n["compute_by_kind_s"]
    ideal = measured_ideal(summary, KIND_PARAMS)
    assert ideal["method"] == "total" and "compute_whole_heads_s" not in ideal
    assert ideal["compute_s"] <= min(cost(v) for v in LAYOUTS.values())


def test_summary_uses_the_per_kind_ideal_and_reports_whole_heads() -> None:
    def ranks(layout):
        out = []
        for d in range(3):
            t = truth(d, layout)
            it = {"iteration_s": sum(t.values()) + 0.2, "compute_s": sum(t.values()), "comm_s": 0.1,
                  "idle_s": 0.1, "data_s": 0.0, "voluntary_ctx_switches": 1, "involuntary_ctx_switches": 1,
                  "peak_rss": 2**30, **{f"compute_{k}_s": v for k, v in t.items()}}
            out.append({"device": d, "units": layout["attn"][d], **{k: layout[k][d] for k in KINDS},
                        "iterations": [it] * 3})
        return out

    doc = {"spec": {"warmup": 1}, "scenario": {"shares": [0.45, 0.3, 0.3]},
           "model": {"kind_parameters": dict(KIND_PARAMS, replicated=10)},
           "strategies": {k: {"raw": {"ranks": ranks(v)}} for k, v in LAYOUTS.items()}}
    doc = summarize(doc)
    x = doc["summary"]["xronos"]
    assert x["ideal_measured_s"] == pytest.approx(doc["measured_ideal"]["compute_s"] + 0.1)
    assert doc["ratios"]["xronos/ideal (measured fit)"] >= 1.0
    assert doc["ratios"]["xronos/ideal (measured fit)"] >= doc["ratios"]["xronos/ideal (measured fit, whole heads)"]
    assert "xronos/xronos-paper" in doc["ratios"] and "xronos-paper/uniform" in doc["ratios"]
