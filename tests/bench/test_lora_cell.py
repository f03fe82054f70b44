"""Issue 17's LoRA cell: its specs, LoRA's memory in the harness's necessary condition, the LoRA
strategy planned over the LoRA profiles and never sharing a full fine-tuning run."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from xronos.bench import harness
from xronos.bench import strategies as st
from xronos.bench.harness import CellSpec, cell_caps, lora_of, memory_shortfall, model_state_bytes, run_strategies
from xronos.bench.lora_cell import CELLS, FIT_MODEL, LORA_MODEL, markdown, rows
from xronos.bench.results import summarize
from xronos.bench.scenarios import GIB, RUNTIME_RESERVE, get_scenario
from xronos.bench.workloads import kept_fraction, lora_parameters, parameter_count, realistic_blocks, shape_config
from xronos.protocol.layout import Layout

from test_cells import SIZES, _doc, _plan, _ranks


def test_the_cells_are_set_a_at_the_grid_depth_and_scale() -> None:
    lora, fit = CELLS
    assert (lora.scenario, lora.model, lora.blocks) == ("set-a", LORA_MODEL, realistic_blocks(LORA_MODEL))
    assert lora.blocks == 7 and lora.mem_scale == "kept" and lora.strategies == ("xronos", "xronos-lora", "uniform-lora", "pp-lora")
    assert (fit.scenario, fit.model, fit.blocks, fit.mem_scale) == ("set-a", FIT_MODEL, 8, "kept")
    assert fit.strategies == ("xronos",)
    assert lora.seq_len == fit.seq_len == 256
    assert lora.cell_name == "set-a_qwen2.5-1.5b_s256_b7_lora8" and fit.cell_name == "set-a_smollm2-360m_s256_b8"
    cfg = shape_config(LORA_MODEL, None)  # the published Qwen2.5-1.5B: 1.54 B with its tied LM head
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (
        1536, 28, 2, 151936)
    assert parameter_count(cfg) == pytest.approx(1.54e9, rel=0.01)


def test_lora_parameters_are_the_adapters_and_the_head() -> None:
    cfg = shape_config(LORA_MODEL, 2)
    h, kv = 1536, 256  # 2 KV heads of 128
    frozen, trained = lora_parameters(cfg, 8, ("q_proj", "v_proj"))
    adapters = 2 * 8 * ((h + h) + (h + kv))  # A [r, in] + B [out, r] per adapted layer, 2 blocks
    head = 2 * h  # score [2, hidden], no bias
    assert trained == adapters + head
    assert frozen + head == parameter_count(cfg)
    _, all7 = lora_parameters(cfg, 4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    inter = 8960
    assert all7 == 2 * 4 * (2 * (h + h) + 2 * (h + kv) + 3 * (h + inter)) + head


def test_lora_memory_is_what_the_necessary_condition_checks() -> None:
    """Full fine-tuning: 16 B per parameter; LoRA: the frozen base at 4 B, adapters and head at 16 B."""
    spec = CELLS[0]
    cfg = shape_config(spec.model, spec.blocks)
    frozen, trained = lora_parameters(cfg, 8, ("q_proj", "v_proj"))
    full, _ = model_state_bytes(spec, cfg, "xronos")
    lora, what = model_state_bytes(spec, cfg, "xronos-lora")
    assert full == 16 * parameter_count(cfg) and lora == 4 * frozen + 16 * trained
    assert lora < full / 3.9 and "LoRA r=8 on q_proj,v_proj" in what
    # Caps where full fine-tuning's state cannot fit but LoRA's can: each strategy is judged on its own.
    sc = get_scenario("set-a")
    caps = [int(3 * RUNTIME_RESERVE + (full + lora) / 2) // 3] * 3
    short = memory_shortfall(spec, sc, cfg, caps, "xronos")
    assert short and "weights, grads, AdamW state" in short
    assert memory_shortfall(spec, sc, cfg, caps, "xronos-lora") is None
    assert memory_shortfall(spec, sc, cfg, caps) == short  # the default is full fine-tuning


def test_set_a_scaled_caps_against_each_training_state() -> None:
    """The numbers the cell's tables rest on, computed without running (issue 17's premise checked):
    at the grid's scale Set-A's caps total 12.47 GiB; LoRA's 2.09 GiB of state fits with room, and
    full fine-tuning's 8.36 GiB passes the necessary condition too, so whether it is refused is the
    planner's call over the devices' profiles (per-node caps, activations, transients)."""
    spec = CELLS[0]
    sc, cfg = get_scenario("set-a"), shape_config(spec.model, spec.blocks)
    caps = cell_caps(spec, sc)
    assert kept_fraction(spec.model, spec.blocks) == pytest.approx(0.3634, abs=1e-3)
    assert sum(caps) / GIB == pytest.approx(12.47, abs=0.01)
    assert model_state_bytes(spec, cfg, "xronos")[0] / GIB == pytest.approx(8.36, abs=0.01)
    assert model_state_bytes(spec, cfg, "xronos-lora")[0] / GIB == pytest.approx(2.09, abs=0.01)
    assert memory_shortfall(spec, sc, cfg, caps, "xronos-lora") is None
    assert memory_shortfall(spec, sc, cfg, caps, "xronos") is None


def test_bad_lora_options_are_refused_naming_them() -> None:
    cfg = shape_config(LORA_MODEL, 1)
    assert lora_of(CELLS[0], cfg).targets == ("q_proj", "v_proj")  # peft's default for qwen2
    for bad, match in (({"lora_r": 0}, "lora-r"), ({"lora_r": True}, "lora-r"),
                       ({"lora_targets": ("c_attn",)}, "c_attn"), ({"lora_alpha": -1.0}, "alpha")):
        with pytest.raises(ValueError, match=match):
            lora_of(dataclasses.replace(CELLS[0], **bad), cfg)
        with pytest.raises(ValueError, match=match):  # before anything is written or spawned
            harness.validate(dataclasses.replace(CELLS[0], **bad))
    assert "_lora" not in CellSpec("set-a", LORA_MODEL, ("xronos",), lora_r=0).cell_name  # unused: not checked


def test_the_lora_strategy_plans_on_lora_profiles_and_never_shares_a_full_run(monkeypatch, tmp_path: Path) -> None:
    layout = Layout.tied((2, 1, 1), SIZES)  # the same layout for both: still two runs
    asked, launched = [], []
    monkeypatch.setattr(st, "profile_devices", lambda ctx, tp, pp, want_lora=False, want_pp_lora=False:
                        asked.append((tp, pp, want_lora)) or {})
    monkeypatch.setattr(st, "tp_plan", lambda ctx, profiles, s: _plan(layout))
    monkeypatch.setattr(st, "run_tp", lambda ctx, lay, tag: launched.append(tag) or _ranks(lay))
    monkeypatch.setattr(harness, "_tp_unavailable", lambda model_dir: None)
    spec = CellSpec("set-a", LORA_MODEL, ("xronos", "xronos-lora"), blocks=2)
    ctx = SimpleNamespace(model_dir=tmp_path, caps=[6 * GIB, 3 * GIB, 3 * GIB])
    out = run_strategies(spec, get_scenario("set-a"), {"model_type": "qwen2"}, ctx, {})
    assert launched == ["xronos", "xronos-lora"] and "same_layout_as" not in out["xronos-lora"]
    assert asked == [(True, False, True)]
    only = run_strategies(dataclasses.replace(spec, strategies=("xronos-lora",)), get_scenario("set-a"),
                          {"model_type": "qwen2"}, ctx, {})
    assert asked[-1] == (False, False, True) and "raw" in only["xronos-lora"]  # no full fine-tuning profile
    assert st.profile_key("xronos-lora") == "tp-lora" and st.profile_key("xronos") == "tp"


def test_the_side_by_side_table(monkeypatch) -> None:
    layout = Layout.tied((2, 1, 1), SIZES)
    doc = _doc({"xronos": {"infeasible": "plan exceeds the memory caps: r1 needs 3.1 GiB, cap 2.7 GiB"},
                "xronos-lora": {"plan": {"rows": [{"predicted_memory": GIB, "predicted_compute_s": 0.8, "attn": 1}] * 3,
                                         "predicted_iteration_s": 1.0}, "raw": _ranks(layout)}})
    doc["spec"] |= {"cell_name": CELLS[0].cell_name, "strategies": ["xronos", "xronos-lora"], "scenario": "set-a",
                    "model": LORA_MODEL, "blocks": 7, "lora_r": 8, "lora_alpha": 16.0, "lora_targets": []}
    doc["model"] = {"name": LORA_MODEL, "blocks": 7, "paper_blocks": 28, "config": shape_config(LORA_MODEL, 7)}
    doc = summarize(doc)
    r = rows(doc)
    assert [x["training"] for x in r] == ["full fine-tuning", "LoRA r=8"]
    assert r[0]["result"].startswith("INFEASIBLE: plan exceeds") and r[1]["peak_rss_mib"] == [1024.0] * 3
    md = markdown([doc], 60.0)
    assert "| qwen2.5-1.5b (7/28) | LoRA r=8 (`xronos-lora`) | 2.09 GiB" in md
    assert "| 1024 / 1024 / 1024 |" in md and "INFEASIBLE: plan exceeds the memory caps" in md


def test_the_lora_job_is_compared_with_the_lora_job_only(monkeypatch, tmp_path: Path) -> None:
    """uniform-lora and pp-lora are xronos-lora's baselines (its ratios, its own measured ideal),
    never full fine-tuning's; pp-lora plans over the pipeline's LoRA layer profiles."""
    from test_harness import _doc as _tp_doc

    doc = _tp_doc()
    s = doc["strategies"]
    s["xronos-lora"], s["uniform-lora"] = s.pop("xronos"), s.pop("uniform")
    pp_iters = [{"iteration_s": 4.0, "recv_wait_s": 1.0, "cpu_s": 1.0, "voluntary_ctx_switches": 1,
                 "involuntary_ctx_switches": 1, "peak_rss": 2**30}] * 3
    s["pp-lora"] = {"plan": {"stages": []}, "raw": {"ranks": [{"device": d, "span": [d, d + 1], "iterations": pp_iters}
                                                                for d in range(3)]}}
    s["uniform"] = {"plan": s["uniform-lora"]["plan"], "raw": {"ranks": [
        {**r, "iterations": [{**it, "iteration_s": 1.0} for it in r["iterations"]]} for r in s["uniform-lora"]["raw"]["ranks"]]}}
    doc = summarize(doc)
    r = doc["ratios"]
    assert r["xronos-lora/uniform-lora"] == pytest.approx(1.8 / 2.2) and r["xronos-lora/pp-lora"] == pytest.approx(1.8 / 4.0)
    assert not any(k.startswith("xronos-lora/") and k.split("/")[1] in ("uniform", "pp") for k in r)
    assert "measured_ideal_lora" in doc and "measured_ideal" in doc  # each job fitted on its own runs
    assert doc["measured_ideal_lora"]["compute_s"] != doc["measured_ideal"]["compute_s"]
    assert "xronos-lora/ideal (measured fit)" in r

    asked, planned = [], []
    monkeypatch.setattr(st, "profile_devices", lambda ctx, tp, pp, want_lora=False, want_pp_lora=False:
                        asked.append((tp, pp, want_lora, want_pp_lora)) or {})
    from xronos.bench.pp_plan import PPPlan

    monkeypatch.setattr(st, "pp_plan", lambda ctx, profiles, strat: planned.append(strat) or PPPlan((), 1.0, 1.0, 8))
    monkeypatch.setattr(st, "run_pp", lambda ctx, plan, strat: {"ran": strat})
    monkeypatch.setattr(harness, "_tp_unavailable", lambda model_dir: None)
    spec = CellSpec("set-a", LORA_MODEL, ("pp-lora",), blocks=2)
    ctx = SimpleNamespace(model_dir=tmp_path, caps=[6 * GIB, 3 * GIB, 3 * GIB])
    out = run_strategies(spec, get_scenario("set-a"), {"model_type": "qwen2"}, ctx, {})
    assert asked == [(False, False, False, True)] and planned == ["pp-lora"] and out["pp-lora"]["raw"] == {"ran": "pp-lora"}
