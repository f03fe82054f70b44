"""Issue 11's grid rules: strategy names, depth, memory caps scaled with the model kept, infeasible
plans shown (never timed), identical layouts measured once."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from xronos.bench import harness
from xronos.bench import strategies as st
from xronos.bench.grid import STANDARD, summary_markdown
from xronos.bench.harness import CellSpec, mem_scale_of, memory_shortfall, run_strategies
from xronos.bench.pp_plan import InfeasiblePipeline
from xronos.bench.results import summarize
from xronos.bench.cellreport import markdown
from xronos.bench.scenarios import GIB, RUNTIME_RESERVE, get_scenario
from xronos.bench.workloads import kept_fraction, kind_parameters, parameter_count, realistic_blocks, shape_config
from xronos.protocol.layout import Layout, Sizes


def test_strategy_names_and_planner_mapping(monkeypatch) -> None:
    from xronos.gateway.plan import planner

    assert st.STRATEGIES == ("xronos", "xronos-paper", "uniform", "xronos-lora", "uniform-lora", "pp", "pp-lora",
                             "hf-tp")
    assert st.TP_STRATEGIES == {"xronos": "segment", "xronos-paper": "paper", "uniform": "uniform",
                                "xronos-lora": "segment", "uniform-lora": "uniform"}
    assert [st.planner_strategy(s) for s in st.TP_STRATEGIES] == ["segment", "paper", "uniform", "segment", "uniform"]
    assert [st.profile_key(s) for s in ("xronos", "uniform-lora", "pp", "pp-lora")] == ["tp", "tp-lora", "pp", "pp-lora"]
    assert set(st.TP_STRATEGIES.values()) <= set(planner.STRATEGIES)


def test_grid_depth_and_side_by_side() -> None:
    assert realistic_blocks("gpt2-medium") == 6 and realistic_blocks("roberta-base") == 6
    assert realistic_blocks("tinyllama-1.1b") == 6  # max(6, ceil(22 / 4))
    het = [c for c in STANDARD if c.scenario != "homo"]
    assert {(c.scenario, c.model) for c in het} >= {("set-a", "gpt2-medium"), ("set-b", "gpt2-medium"),
                                                    ("set-c", "gpt2-medium"), ("set-a", "roberta-base")}
    assert any(shape_config(c.model, None).get("num_key_value_heads", 0) < shape_config(c.model, None).get(
        "num_attention_heads", 0) for c in het)  # a GQA LLaMA cell
    for c in het:
        assert c.blocks >= realistic_blocks(c.model) and c.mem_scale == "kept"
        assert {"xronos", "xronos-paper", "uniform", "pp"} <= set(c.strategies)
    assert any("hf-tp" in c.strategies for c in STANDARD if c.scenario == "homo")


def test_tinyllama_is_the_public_config() -> None:
    cfg = shape_config("tinyllama-1.1b", None)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["vocab_size"]) == (2048, 22, 32, 4, 5632, 32000)
    assert parameter_count(cfg) == pytest.approx(1.1e9 - 65.5e6, rel=0.02)  # 1.1 B with the LM head


def test_kind_parameters_split_the_model() -> None:
    cfg = shape_config("gpt2-medium", 2)
    parts = kind_parameters(cfg)
    h, inner = 1024, 4096
    assert parts["attn"] == 2 * (h * 3 * h + 3 * h + h * h)  # c_attn with bias, c_proj's weight
    assert parts["mlp"] == 2 * (h * inner + inner + inner * h)
    assert parts["vocab"] == 50257 * h
    assert sum(parts.values()) == parameter_count(cfg)


def test_memory_caps_scale_with_the_model_kept() -> None:
    f = kept_fraction("gpt2-medium", 6)
    assert f == pytest.approx(parameter_count(shape_config("gpt2-medium", 6))
                              / parameter_count(shape_config("gpt2-medium", None)))
    assert 0.3 < f < 0.4 and kept_fraction("gpt2-medium", None) == 1.0
    caps = get_scenario("set-a").memory_caps(f)  # MiniPC 16 GB, two Pi 5 8 GB
    assert caps[1] == int(RUNTIME_RESERVE + f * (8 * GIB - RUNTIME_RESERVE))
    assert caps[0] == int(RUNTIME_RESERVE + f * (16 * GIB - RUNTIME_RESERVE))
    assert caps[1] > 2.5 * GIB  # not the 1 GiB Pi 5 that a fixed 1/8 gave, which mis-planned
    assert get_scenario("set-a").memory_caps(None) == [None] * 3
    spec = CellSpec("set-a", "gpt2-medium", blocks=6)
    assert spec.mem_scale == "kept" and mem_scale_of(spec) == pytest.approx(f)
    assert mem_scale_of(dataclasses.replace(spec, mem_scale=0.25)) == 0.25
    assert mem_scale_of(dataclasses.replace(spec, mem_scale=None)) is None
    with pytest.raises(ValueError, match="mem-scale"):
        mem_scale_of(dataclasses.replace(spec, mem_scale=2.0))
    with pytest.raises(ValueError, match="mem_scale"):
        get_scenario("set-a").memory_caps(0)


def test_a_model_too_big_for_every_strategy_is_reported_not_refused() -> None:
    sc = get_scenario("set-a")
    cfg = shape_config("mobilellama-1.4b", None)
    short = memory_shortfall(CellSpec("set-a", "mobilellama-1.4b"), sc, cfg, sc.memory_caps(1 / 8))
    assert short and "needs at least" in short and "GiB" in short
    # Scaled caps: the full model on the real devices fits (22 GiB of state, 32 GiB of RAM).
    assert memory_shortfall(CellSpec("set-a", "mobilellama-1.4b"), sc, cfg, sc.memory_caps(1.0)) is None


# -- run_strategies with the planner and the launches replaced ------------------------------------
SIZES = Sizes(attn=4, mlp=128, vocab=64)


def _plan(layout: Layout, feasible: bool = True):
    rows = tuple(SimpleNamespace(node_id=f"r{d}", rank=d, predicted_compute_s=1.0, predicted_memory=3 * GIB,
                                 memory_cap=2 * GIB, over_cap=not feasible and d == 1)
                 for d in range(layout.world_size))

    @dataclasses.dataclass
    class Result:
        strategy: str
        predicted_iteration_s: float = 1.0
        ideal_compute_s: float = 0.9
        feasible: bool = True

        @property
        def layout(self):
            return layout

    r = Result("x", feasible=feasible)
    r.rows = rows
    return r


def _ranks(layout: Layout) -> dict:
    it = {"iteration_s": 1.0, "compute_s": 0.8, "comm_s": 0.1, "idle_s": 0.1, "data_s": 0.0,
          "voluntary_ctx_switches": 1, "involuntary_ctx_switches": 1, "peak_rss": 2**30}
    return {"ranks": [{"device": d, "units": layout.attn[d], "attn": layout.attn[d], "mlp": layout.mlp[d],
                       "vocab": layout.vocab[d], "iterations": [it] * 3} for d in range(layout.world_size)]}


def _doc(strategies: dict) -> dict:
    return {"spec": {"cell_name": "c", "warmup": 1, "batch_size": 8, "seq_len": 32, "lr": 2e-5, "iters": 3,
                     "micro_batches": 8, "bandwidth_mbit": 1000.0},
            "environment": {"cpu_model": "x", "cores": 2, "torch": "t", "cgroup_version": 1,
                            "loadavg_start": [0, 0, 0], "loadavg_end": [0, 0, 0]},
            "scenario": {"name": "set-a", "devices": [{"name": n, "speed": s} for n, s in
                                                      [("MiniPC", 1.5), ("Pi", 1), ("Pi", 1)]],
                         "shares": [0.45, 0.3, 0.3], "memory_caps": [6 * GIB, 3 * GIB, 3 * GIB],
                         "mem_scale": 0.361, "mem_scale_basis": "parameters kept / parameters of the full model",
                         "runtime_reserve": RUNTIME_RESERVE, "ideal_ratio_to_uniform_from_speeds": 0.857},
            "model": {"name": "gpt2-medium", "blocks": 6, "paper_blocks": 24, "parameters": 128e6,
                      "full_parameters": 355e6},
            "strategies": strategies}


def test_infeasible_plans_are_shown_not_timed_and_equal_layouts_run_once(monkeypatch, tmp_path: Path) -> None:
    tied = Layout.tied((2, 1, 1), SIZES)
    even = Layout.tied((2, 1, 1), SIZES)  # uniform happens to give the same layout here
    over = Layout(attn=(2, 1, 1), mlp=(32, 64, 32), vocab=(32, 0, 32))
    plans = {"xronos": _plan(tied), "uniform": _plan(even), "xronos-paper": _plan(over, feasible=False)}
    launched = []
    monkeypatch.setattr(st, "profile_devices", lambda ctx, tp, pp, **kw: {})
    monkeypatch.setattr(st, "tp_plan", lambda ctx, profiles, s: plans[s])
    monkeypatch.setattr(st, "run_tp", lambda ctx, layout, tag: launched.append(tag) or _ranks(layout))
    def pp_plan(ctx, profiles, strategy):
        raise InfeasiblePipeline("no cut fits: stage 0 needs 4 GiB")

    monkeypatch.setattr(st, "pp_plan", pp_plan)
    monkeypatch.setattr(harness, "_tp_unavailable", lambda model_dir: None)
    spec = CellSpec("set-a", "gpt2-medium", ("xronos", "xronos-paper", "uniform", "pp"), blocks=6)
    ctx = SimpleNamespace(model_dir=tmp_path, caps=[6 * GIB, 3 * GIB, 3 * GIB])
    out = run_strategies(spec, get_scenario("set-a"), {"model_type": "gpt2"}, ctx, {})
    assert launched == ["xronos"]  # paper over a cap: not run; uniform: xronos' layout, reused
    assert "r1 needs 3.00 GiB, cap 2.00 GiB" in out["xronos-paper"]["infeasible"]
    assert out["xronos-paper"]["plan"]["layout"] == {"attn": [2, 1, 1], "mlp": [32, 64, 32], "vocab": [32, 0, 32]}
    assert out["uniform"]["same_layout_as"] == "xronos" and "raw" in out["uniform"]
    assert "stage 0 needs 4 GiB" in out["pp"]["infeasible"]
    doc = summarize(_doc(out))
    assert "xronos-paper" not in doc["summary"] and doc["summary"]["uniform"]["same_layout_as"] == "xronos"
    md = markdown(doc)
    assert "| xronos-paper | INFEASIBLE: plan exceeds the memory caps" in md
    assert "attn 2/1/1; mlp 32/64/32; vocab 32/0/32" in md  # the infeasible plan's layout, shown
    assert "(same layout as xronos: measured once)" in md
    assert "**0.361** x (device RAM" in md and "128.0 of 355.0 M" in md
    grid = summary_markdown([doc], None, 60.0)
    assert "| infeasible |" in grid and "Infeasible (plan over a memory cap; not timed)" in grid
    assert "(= xronos)" in grid
    from xronos.bench.plots import cell_plots

    assert set(cell_plots(doc)) >= {"iteration", "idle"}  # renders with untimed strategies
    json.dumps(doc)


def test_tp_plan_uses_the_emulated_caps() -> None:
    from xronos.bench.plan_speed import synthetic_report

    report = synthetic_report("dev", units=16, num_blocks=2).model_dump(mode="json")
    profiles = {"MiniPC": {"tp": report, "tp-lora": report}, "Pi": {"tp": report, "tp-lora": report}}
    ctx = st.Ctx(Path("."), Path("."), Path("."), {}, [0.45, 0.3], [8 * GIB, 8 * GIB], ["MiniPC", "Pi"],
                 8, 32, 8, 3, 2e-5, 0, bandwidth_mbit=1000.0)
    for s in st.TP_STRATEGIES:
        plan = st.tp_plan(ctx, profiles, s)
        assert [r.node_id for r in plan.rows] == ["r0 MiniPC", "r1 Pi"]
        assert all(r.memory_cap == pytest.approx(8 * GIB - RUNTIME_RESERVE) for r in plan.rows)
        assert st.over_cap(plan) is None
        assert plan.layout.world_size == 2
    tiny = dataclasses.replace(ctx, caps=[RUNTIME_RESERVE + 1, RUNTIME_RESERVE + 1])
    with pytest.raises(st.Infeasible):
        st.tp_plan(tiny, profiles, "xronos")
    assert "plan exceeds the memory caps" in st.over_cap(st.tp_plan(tiny, profiles, "uniform"))


def test_tp_plan_with_a_measured_runtime_plans_against_the_cgroup_cap_itself() -> None:
    """A profile that measured the process predicts the whole resident set, so the planner's cap
    is the one the kernel enforces (no runtime reserve taken off), and the predicted peak holds
    the runtime."""
    from xronos.bench.plan_speed import synthetic_report

    base = synthetic_report("dev", units=16, num_blocks=2)
    report = base.model_copy(update={"runtime_bytes": 300 << 20}).model_dump(mode="json")
    profiles = {"MiniPC": {"tp": report}, "Pi": {"tp": report}}
    ctx = st.Ctx(Path("."), Path("."), Path("."), {}, [0.45, 0.3], [8 * GIB, 8 * GIB], ["MiniPC", "Pi"],
                 8, 32, 8, 3, 2e-5, 0, bandwidth_mbit=1000.0)
    plan = st.tp_plan(ctx, profiles, "xronos")
    assert all(r.memory_cap == pytest.approx(8 * GIB) for r in plan.rows)
    old = st.tp_plan(ctx, {k: {"tp": base.model_dump(mode="json")} for k in profiles}, "xronos")
    assert all(r.predicted_memory > o.predicted_memory + (299 << 20) for r, o in zip(plan.rows, old.rows))
