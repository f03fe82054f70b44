"""The fastest parallelism per job (issue 36): every strategy the planner can run, side by side, on
cells where the choice matters, in the virtual clock.

    .venv/bin/python -m xronos.bench.choice [--cells lora-a,full-a,lora-c,eight] [--iters 8 --warmup 3]
        [--repeats 1] [--out bench/results]
    .venv/bin/python -m xronos.bench.choice --replan bench/results/choice-X.json [--charge blocking]

Each cell profiles its emulated boxes once (`strategies.profile_devices`: the LoRA job's profile
for a LoRA cell), then plans and trains, one after another, every strategy a job may ask for —
`auto` (the planner's pick among TP `segment`, speed-weighted `dp` and DP×TP meshes), `segment`
(TP only, today's default before `auto`), `dp` (data parallelism only), `uniform` (Megatron's even
TP) and `paper` (the paper's head-tied greedy) — through the same `launch_local` ranks a job's
engine runs (`RunConfig.shares` for a data-parallel plan). A strategy whose plan exceeds a cap is
reported with the planner's reason, never run; a plan equal to one already measured in the cell
(auto's pick, usually) takes that run's numbers and says so. With `--repeats R` every distinct plan
runs R times, round by round in a rotated order (a slow minute of the host falls on every plan
alike), and the table gives the median run and the repeats' spread.

Columns: the plan (its candidate's label), predicted and measured iteration (virtual seconds:
rank 0's median after the warm-up; every rank leaves an iteration together), the prediction's
error, the iteration relative to `segment` (TP only), the strategy's own ideal bound (TP: the
continuous per-segment balance under the caps; DP: fractional rows; a mesh: its prediction) and
the wall seconds the run took on this host. The cells:

- `lora-a` / `lora-c`: LoRA r=8 (q_proj, v_proj) on a SmolLM2-360M shape (8 of 32 blocks, batch 16 x 64, a
  classification head as the grid's), whose frozen base fits every box, on Set-A / Set-C.
- `lora-qwen-a`: the LoRA cell's job (`bench/lora_cell.py`): LoRA r=8 on a Qwen2.5-1.5B shape (7 of
  28 blocks, batch 8 x 256) on Set-A under the grid's caps, where TP holds the attention in two
  KV-head groups over three boxes.
- `full-a`: full fine-tuning of a Llama-3.2-1B shape (6 of 16 blocks) on Set-A under the grid's
  memory caps (parameters kept): a whole replica does not fit a Pi 5, TP does;
- `eight`: the LoRA job on an eight-box fleet (two MiniPCs, two LattePandas, four Pi 5s), where
  groups are worth forming.
- `overlap-a` (issue #37): full fine-tuning of a GPT-2-medium shape (6 of 24 blocks, 8 x 64) on
  Set-A, where TP's activation all-reduces are a large share of the iteration; run it with
  `--strategies segment,segment+bwd,segment+c2,segment+c4,segment+auto`: the TP plan with its
  all-reduces overlapped with compute (`segment+bwd`, `+cN` forced; `+on`/`+auto` the planner's
  pick, `gateway/plan/overlapcost.py`), each predicted and measured like the rest. The ideal bound
  stays the one without overlap. Each mode runs on the layout the planner chose with it
  (`choose.with_overlap`); `segment+MODE@off` runs it on the layout planned without overlap.
  `segment+trial` runs auto's plan with its overlap trial (`Plan.trial`, a job's with `overlap`
  `auto`): the ranks measure auto's mode and the next likeliest against each other, keep the
  fastest (moving to its own layout if it has one), and run the others' warm-up and iterations
  after the trial, measured as theirs are; its predicted figure is the planner's forecast for the
  mode kept (`OverlapTrial.forecasts`, the median repeat's), and the table then lists each
  trial's medians and the mode it kept.
- `overlap-demo` (issue #37): the same on `xronos demo`'s boxes (N100, Pi 5, Pi 4 at 0.9, 0.5 and
  0.3 host cores) and model (MiniLM, full fine-tuning, 8 x 64).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

STRATEGIES = ("auto", "segment", "dp", "uniform", "paper")
# TP `segment` with its all-reduces overlapped with compute (issue #37): `segment+MODE`, MODE one of
# bwd (forced), cN (forced N chunks), on (the planner's fastest overlapping mode) or auto
# (its fastest mode, none among them); each planned with its layout (`choose.with_overlap`), or,
# with `@off`, on the layout planned without overlap (as the planner did before 2026-12-07).
# `--strategies` picks any of these and STRATEGIES.
_MODES = ("segment+bwd", "segment+c2", "segment+c4", "segment+on", "segment+auto")
# `segment+trial`: auto's plan with its overlap trial (`Plan.trial`, node/rank/trial.py): the ranks
# measure auto's mode and the next likeliest against each other, then run the kept one; measured
# over the iterations after the trial (the run is the trial's steps longer).
OVERLAPPED = _MODES + tuple(f"{m}@off" for m in _MODES) + ("segment+trial",)


def overlap_args(strat: str) -> tuple[str, dict]:
    """A bench strategy as the planner's strategy and its overlap keywords (`choose_reports`)."""
    base, _, mode = strat.partition("+")
    if not mode:
        return base, {}
    mode, at, layout = mode.partition("@")
    if at and layout != "off":
        raise ValueError(f"strategy {strat!r}: @off (the layout planned without overlap) or nothing")
    joint = {"joint": False} if at else {}
    from xronos.gateway.plan.overlapcost import mode_of

    if mode in ("on", "auto", "trial"):
        return base, {"overlap": "auto" if mode == "trial" else mode, **joint}
    try:
        forced = mode_of(mode)
    except ValueError:
        forced = None
    if forced is None or not forced.on:
        raise ValueError(f"strategy {strat!r}: overlap mode bwd, cN, on or auto")
    return base, {"overlap": "on", "chunks": forced.chunks, **joint}
HOST_FRACTION = 0.8  # of this host's memory the cells' caps may take together


@dataclass(frozen=True)
class ChoiceCell:
    name: str
    scenario: str
    model: str
    blocks: int
    lora: bool
    seq_len: int = 64
    batch_size: int = 8
    note: str = ""


CELLS = {
    "lora-a": ChoiceCell("lora-a", "set-a", "smollm2-360m", 8, True, batch_size=16, note="LoRA r=8, base fits every box"),
    "full-a": ChoiceCell("full-a", "set-a", "llama-3.2-1b", 6, False, seq_len=32,
                         note="full fine-tuning, a replica does not fit a Pi 5"),
    "lora-qwen-a": ChoiceCell("lora-qwen-a", "set-a", "qwen2.5-1.5b", 7, True, seq_len=256, batch_size=8,
                              note="the LoRA cell's job: LoRA r=8, two KV-head groups over three boxes"),
    "lora-c": ChoiceCell("lora-c", "set-c", "smollm2-360m", 8, True, batch_size=16, note="LoRA r=8, base fits every box"),
    "eight": ChoiceCell("eight", "eight", "smollm2-360m", 8, True, batch_size=16, note="LoRA r=8 on eight boxes"),
    # issue #37: TP whose activation all-reduces are a large share of the iteration
    "overlap-a": ChoiceCell("overlap-a", "set-a", "gpt2-medium", 6, False, seq_len=64,
                            note="full fine-tuning, TP's activation all-reduces a large share"),
    # ... and `xronos demo`'s boxes and model at 8 x 64 tokens (`bench.overlap`'s demo-s64), where a
    # Pi 4 pays a launched call at a third of the N100's speed
    "overlap-demo": ChoiceCell("overlap-demo", "demo", "minilm", 6, False, seq_len=64,
                               note="full fine-tuning of MiniLM on the demo's boxes"),
}


def _scenario(name: str):
    from xronos.bench.scenarios import LATTE, MINIPC, PI5, Scenario, get_scenario

    if name == "demo":  # `xronos demo`'s boxes: 0.9, 0.5 and 0.3 host cores (speed x PI5_SHARE)
        from xronos.bench.scenarios import PI5_SHARE, Device
        return Scenario("demo", (Device("N100 mini PC", "Intel N100 3.4 GHz", 0.9 / PI5_SHARE, 16),
                                 Device("Raspberry Pi 5", "ARM Cortex-A76 2.4 GHz", 0.5 / PI5_SHARE, 8),
                                 Device("Raspberry Pi 4", "ARM Cortex-A72 1.8 GHz", 0.3 / PI5_SHARE, 4)),
                        "xronos demo's boxes: N100, Raspberry Pi 5, Raspberry Pi 4")
    if name == "eight":
        return Scenario("eight", (MINIPC, MINIPC, LATTE, LATTE, PI5, PI5, PI5, PI5),
                        "eight boxes: two ASUS MiniPCs, two LattePanda Mu, four Raspberry Pi 5")
    return get_scenario(name)


def run_cell(cell: ChoiceCell, iters: int, warmup: int, scratch: str | None = None, repeats: int = 1,
             strategies: tuple[str, ...] = STRATEGIES, stack_s_per_byte: float = 0.0) -> dict:
    from xronos.bench import strategies as st
    from xronos.bench.harness import _param_count, environment
    from xronos.bench.scenarios import GIB, PI5_SHARE, RUNTIME_RESERVE
    from xronos.bench.workloads import kept_fraction, shape_config, write_checkpoint, write_dataset
    from xronos.node.emulate.cgroupfs import find_controller
    from xronos.node.emulate.request import host_memory_bytes

    sc = _scenario(cell.scenario)
    if cell.model == "minilm":  # the demo's model (every block kept), as `bench.overlap` builds it
        from xronos.bench.overlap import MINILM
        config, scale = dict(MINILM), 1.0
    else:
        config, scale = shape_config(cell.model, cell.blocks), kept_fraction(cell.model, cell.blocks)
    caps, scale_note = sc.memory_caps(scale), None
    host = host_memory_bytes()
    if host is not None and sum(caps) > HOST_FRACTION * host:
        # Five or eight boxes' scaled RAM exceeds this host's: every cap is scaled down alike until
        # they fit (the LoRA cells' replicas fit every box either way; the planner says so per cell).
        room = [(d.memory_gb * GIB - RUNTIME_RESERVE) for d in sc.devices]
        fitted = (HOST_FRACTION * host - len(room) * RUNTIME_RESERVE) / sum(room)
        scale_note = (f"memory scale {scale:.3f} (parameters kept) lowered to {fitted:.3f}: the {sc.n} boxes' caps "
                      f"must fit this host's {host / GIB:.1f} GiB together")
        scale, caps = fitted, sc.memory_caps(fitted)
    cpu = find_controller("cpu")
    doc: dict = {"cell": cell.__dict__, "environment": environment(cpu.version if cpu else None),
                 "scenario": sc.describe(), "memory_caps": caps, "mem_scale": scale, "mem_scale_note": scale_note,
                 "parameters": _param_count(config), "strategies": {}}
    if doc["environment"].get("clock") != "virtual":
        raise SystemExit("bench.choice runs on the virtual clock (XRONOS_EMULATOR_CPU=virtual, the default)")
    with tempfile.TemporaryDirectory(prefix="xronos-choice-", dir=scratch) as tmp:
        work = Path(tmp)
        model_dir = write_checkpoint(work / "model", config, seed=0)
        data = write_dataset(work / "data.jsonl", cell.batch_size * (iters + 2), cell.seq_len,
                             config["vocab_size"], seed=0)
        ctx = st.Ctx(work, model_dir, data, config, sc.shares(PI5_SHARE), caps, [d.name for d in sc.devices],
                     cell.batch_size, cell.seq_len, cell.batch_size, iters, 2e-5, 0, bandwidth_mbit=1000.0,
                     lora_r=8, lora_alpha=16.0, lora_targets=("q_proj", "v_proj") if cell.lora else None,
                     stack_s_per_byte=stack_s_per_byte)
        doc["stack_s_per_byte"] = stack_s_per_byte
        t0 = time.perf_counter()
        profiles = st.profile_devices(ctx, want_tp=not cell.lora, want_pp=False, want_lora=cell.lora)
        doc["profiling_s"] = time.perf_counter() - t0
        doc["profiles"] = profiles  # what every plan below came from (the reports, as the nodes' would be)
        key = "tp-lora" if cell.lora else "tp"
        first: dict[str, str] = {}  # plan key -> the first strategy that planned it
        for strat in strategies:
            doc["strategies"][strat] = entry = _plan(ctx, profiles, key, strat)
            if "plan_key" in entry:
                first.setdefault(entry["plan_key"], strat)
                if first[entry["plan_key"]] != strat:
                    entry["same_plan_as"] = first[entry["plan_key"]]
        distinct = list(first.values())
        doc["repeats"] = repeats
        for rnd in range(repeats):  # interleaved: each round every distinct plan once, the order rotated
            k = rnd % len(distinct) if distinct else 0
            for strat in distinct[k:] + distinct[:k]:
                entry = doc["strategies"][strat]
                if "failed" in entry:
                    continue
                t0 = time.perf_counter()
                try:
                    entry.setdefault("runs", []).append(_run(ctx, entry, cell.lora, warmup))
                except Exception as exc:  # a strategy failing (e.g. OOM-killed) is a result, not a crash
                    entry["failed"] = f"{type(exc).__name__}: {exc}"[-2000:]
                entry["wall_s"] = entry.get("wall_s", 0.0) + time.perf_counter() - t0
        for entry in doc["strategies"].values():
            if entry.get("runs"):
                entry["run"] = _median_run(entry["runs"])
        for entry in doc["strategies"].values():
            if entry.get("same_plan_as"):
                entry["run"] = doc["strategies"][entry["same_plan_as"]].get("run")
    doc["environment"]["loadavg_end"] = os.getloadavg()
    return doc


def _median_run(runs: list[dict]) -> dict:
    """The repeats' median run (by iteration; the lower middle of an even count), with every
    repeat's iteration and their spread (max / min - 1) beside it."""
    its = sorted(r["iteration_s"] for r in runs)
    mid = its[(len(its) - 1) // 2]
    run = dict(next(r for r in runs if r["iteration_s"] == mid))
    run["repeats_s"] = [r["iteration_s"] for r in runs]
    run["spread"] = its[-1] / its[0] - 1 if its[0] > 0 else 0.0
    return run


def _plan(ctx, profiles: dict, key: str, strat: str) -> dict:
    """The strategy's plan over the cell's profiles: its candidates, its layout and shares, or why not."""
    from xronos.bench import strategies as st
    from xronos.gateway.plan.auto import choice_message, choose_reports, with_trial

    loaded, reserve_mb = st.loaded_profiles(ctx, profiles, key, wire_ids=True)
    base, overlap = overlap_args(strat)
    try:
        choice = choose_reports(loaded, base, reserve_mb=reserve_mb, exports=False, batch=ctx.batch_size,
                                bandwidth_Bps=st.planning_bw_bps(ctx), latency_s=st.NOMINAL_LATENCY_S, **overlap)
    except ValueError as exc:  # InfeasiblePlan, DPInfeasible: the planner's own reasons
        return {"infeasible": str(exc)[-2000:]}
    w = choice.winner
    ideal = (w.tp.ideal_iteration_s if w.tp is not None else w.dp.ideal_s if w.dp is not None else w.iteration_s)
    out = {"label": w.label, "why": choice.why, "predicted_s": w.iteration_s, "predicted_compute_s": w.compute_s,
           "predicted_comm_s": w.comm_s, "ideal_s": ideal,
           "candidates": [{"label": c.label, "feasible": c.feasible, "iteration_s": c.iteration_s,
                           "why_not": c.why_not} for c in choice.candidates]}
    if not w.feasible:
        out["infeasible"] = w.why_not
        return out
    plan = choice_message(choice, "bench")
    if strat.endswith("+trial"):
        plan = with_trial(plan, choice, 1 << 30)
        if plan.trial is None:
            out["infeasible"] = "no overlap modes to try (a plan without tensor parallelism over two nodes or more)"
            return out
        out["trial"] = plan.trial.model_dump(mode="json")
    order = [int(e.node_id[1:]) for e in plan.entries]  # "r<d>": the rank's device
    mode = plan.overlap.model_dump(mode="json") if plan.overlap else None
    out.update(layout=plan.layout().model_dump(mode="json"), shares=plan.shares, devices=order, overlap=mode,
               plan_key=f"{plan.layout().to_text()} {plan.shares} {order} {mode}"
               + (f" trial {out['trial']}" if "trial" in out else ""))
    return out


def _run(ctx, entry: dict, lora: bool, warmup: int) -> dict:
    from xronos.bench import strategies as st
    from xronos.node.rank.local import launch_local
    from xronos.node.runconfig import RunConfig
    from xronos.protocol.layout import Layout
    from xronos.protocol.messages import Overlap, OverlapTrial
    from xronos.protocol.recipe import LoraSpec

    metrics = ctx.work / f"metrics-{len(list(ctx.work.glob('metrics-*')))}.json"
    spec = LoraSpec(r=ctx.lora_r, alpha=ctx.lora_alpha, targets=list(ctx.lora_targets)) if lora else None
    shares = tuple(entry["shares"]) if entry["shares"] else None
    trial = OverlapTrial.model_validate_json(json.dumps(entry["trial"])) if entry.get("trial") else None
    if trial is not None:  # the trial's steps first, then the others' run: the same warm-up (after a
        # move to the kept mode's layout, the estimator's windows refill as at a start) and iterations
        ctx, warmup = replace(ctx, iters=ctx.iters + trial.steps), trial.steps + warmup
    cfg = RunConfig(recipe=st.cell_recipe(ctx, lora=spec), layout=Layout.model_validate(entry["layout"]),
                    shares=shares, threads=1, metrics_path=str(metrics), progress=False, gloo_timeout_s=600,
                    overlap=Overlap(**entry["overlap"]) if entry.get("overlap") else None, trial=trial)
    order = entry["devices"]
    with st.confine(ctx, st.limits(ctx, order)) as conf:
        launch_local(cfg, cfg.world_size, wrap=conf.wrap, echo_rank0=False)
    doc = json.loads(metrics.read_text())
    ranks = [r["iterations"][warmup:] for r in doc["ranks"]]
    if not ranks[0]:
        raise ValueError(f"no iteration after the {warmup} warm-up ones")
    med = lambda xs: statistics.median(xs)  # noqa: E731
    kept = (doc.get("overlap_trial") or {}).get("kept")
    forecast = trial.forecast(kept) if trial is not None and kept else None
    return {"clock": doc.get("clock"), "iteration_s": med([it["iteration_s"] for it in ranks[0]]),
            "overlap_trial": doc.get("overlap_trial"),
            # the planner's prediction for the mode the trial kept, on the layout it then ran
            **({"predicted_s": forecast.iteration_s} if forecast is not None else {}),
            "wall_iteration_s": med([it["wall_s"] for it in ranks[0]]),
            "ranks": [{"device": ctx.device_names[d], "compute_s": med([it["compute_s"] for it in r]),
                       "comm_s": med([it["comm_s"] for it in r]), "idle_s": med([it["idle_s"] for it in r])}
                      for d, r in zip(order, ranks)]}


def table(doc: dict) -> str:
    """The cell's strategies side by side (module docstring)."""
    c = doc["cell"]
    tp = (doc["strategies"].get("segment") or {}).get("run")
    lines = [f"### {c['name']}: {c['model']} ({c['blocks']} blocks), {'LoRA r=8' if c['lora'] else 'full fine-tuning'}, "
             f"batch {c['batch_size']} x {c['seq_len']}; {doc['scenario']}",
             "", f"{c['note']}." + (f" ({doc['mem_scale_note']}.)" if doc.get("mem_scale_note") else "")
                 + " Clock: virtual (iteration seconds of the emulated boxes); link 1 Gbit/s modelled"
                 + (f", its network stack's CPU charged at {doc['stack_s_per_byte'] * 1e9:g} ns of a host core a "
                    "byte carried (profiles and runs)" if doc.get("stack_s_per_byte") else "") + ". "
                 f"Profiling {doc.get('profiling_s', 0):.0f} s wall; load at the end "
                 f"{', '.join(f'{x:.1f}' for x in doc['environment']['loadavg_end'])}.", "",
             f"Measured: the median of {doc.get('repeats', 1)} interleaved run(s); least: the fastest of them "
             "(on a shared host interference only adds time); spread: max / min - 1.", "",
             "| strategy | plan | predicted s | measured s | least s | spread | error | error vs least | vs TP only "
             "| ideal bound s | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in doc["strategies"].items():
        run = e.get("run")
        if "infeasible" in e or run is None:
            why = e.get("infeasible") or e.get("failed") or "not run"
            lines.append(f"| {name} | {e.get('label', '-')} | {_f(e.get('predicted_s'))} | - | - | - | - | - | - | - | "
                         f"{why.splitlines()[0][:160]} |")
            continue
        predicted = run.get("predicted_s", e["predicted_s"])  # a trial's: the kept mode's
        err = 100 * (predicted - run["iteration_s"]) / run["iteration_s"]
        rel = f"{run['iteration_s'] / tp['iteration_s']:.2f}" if tp else "-"
        same = f" (= {e['same_plan_as']})" if e.get("same_plan_as") else ""
        spread = f"{100 * run['spread']:.1f}%" if "spread" in run else "-"
        least = min(run.get("repeats_s") or [run["iteration_s"]])
        err_least = 100 * (predicted - least) / least
        kept = (run.get("overlap_trial") or {}).get("kept") if "predicted_s" in run else None
        label = f"{e['label']}{same}" + (f"; the trial kept {kept}" if kept else "")
        lines.append(f"| {name} | {label} | {predicted:.3f} | {run['iteration_s']:.3f} | {least:.3f} | "
                     f"{spread} | {err:+.1f}% | {err_least:+.1f}% | {rel} | {_f(e.get('ideal_s'))} | "
                     f"{e.get('wall_s', 0):.0f} |")
    trials = [(name, r["overlap_trial"]) for name, e in doc["strategies"].items() if not e.get("same_plan_as")
              for r in e.get("runs", []) if r.get("overlap_trial")]
    if trials:
        lines += ["", "Overlap trials (each mode's median iteration over its trial steps, the slowest rank's; "
                  "the kept one ran the measured iterations):", ""]
        lines += [f"- {name}, run {i + 1}: " + ", ".join(f"{k} {v:.3f} s" for k, v in t["seconds"].items())
                  + f"; kept {t['kept']}" for i, (name, t) in enumerate(trials)]
    return "\n".join(lines)


def _f(v) -> str:
    return "-" if v is None or v == float("inf") else f"{v:.3f}"


def replan(doc: dict, charge: str = "launched", joint: bool = True) -> str:
    """A result file's strategies planned again by today's planner over that run's own profiles,
    against the iterations the run measured: what a change of the cost model moves on the same
    profiles and runs (so that host drift between two runs does not enter). `charge="blocking"`
    plans over the profiles without their launched-call probe, so an overlapped call is charged the
    blocking call's CPU, as a profile from before that probe is (`NodeComm.in_flight`).
    `joint=False` keeps every overlap mode on the layout planned without overlap (`@off`)."""
    from types import SimpleNamespace

    if charge not in ("launched", "blocking"):
        raise ValueError(f"charge must be launched or blocking, got {charge!r}")
    c = doc["cell"]
    profiles = doc["profiles"]
    if charge == "blocking":
        profiles = json.loads(json.dumps(profiles))  # a copy, the caller's document untouched
        for per_device in profiles.values():
            for report in per_device.values():
                if report.get("collectives"):
                    report["collectives"].update(launched_seconds=None, launched_small_seconds=None)
    # the scenario's devices in rank order, as `run_cell` profiled them
    ctx = SimpleNamespace(device_names=[d.name for d in _scenario(c["scenario"]).devices], caps=doc["memory_caps"],
                          bandwidth_mbit=1000.0, batch_size=c["batch_size"])
    key = "tp-lora" if c["lora"] else "tp"
    lines = [f"### {c['name']} re-planned, overlapped calls charged the profile's {charge} CPU", "",
             "| strategy | plan | predicted s | measured s | error |", "|---|---|---|---|---|"]
    # what was measured, by plan: a strategy re-planned to another plan is set against that plan's run
    measured = {e["plan_key"]: e["run"] for e in doc["strategies"].values() if e.get("run") and "plan_key" in e}
    for name in doc["strategies"]:
        kept = not joint and "+" in name and "@" not in name
        p = _plan(ctx, profiles, key, f"{name}@off" if kept else name)
        run = measured.get(p.get("plan_key", ""))
        if run is None or "infeasible" in p:
            lines.append(f"| {name} | {p.get('label', '-')} | {_f(p.get('predicted_s'))} | not run | - |")
            continue
        m = run["iteration_s"]
        lines.append(f"| {name} | {p['label']} | {p['predicted_s']:.3f} | {m:.3f} | "
                     f"{100 * (p['predicted_s'] - m) / m:+.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xronos.bench.choice", description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="lora-a,full-a", help=f"comma-separated, of {', '.join(CELLS)}")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--strategies", default=",".join(STRATEGIES),
                    help=f"comma-separated, of {', '.join(STRATEGIES + OVERLAPPED)} (default: {','.join(STRATEGIES)})")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of every distinct plan, interleaved round by round; the median is reported")
    ap.add_argument("--stack-ns", type=float, default=0.0,
                    help="the link's network-stack CPU, ns of a host core per byte carried (bench/stack_probe.py "
                         "measures it on a real link), in the profiles and the runs; 0: none")
    ap.add_argument("--replan", metavar="JSON", help="plan a result file's strategies again over its own profiles and "
                    "print predicted against its measured iterations (nothing is run)")
    ap.add_argument("--charge", choices=("launched", "blocking"), default="launched",
                    help="with --replan: what an overlapped call is charged, the profile's launched-call CPU "
                         "(today's model) or its blocking-call CPU (the model before the launched-call probe)")
    args = ap.parse_args(argv)
    if args.replan:
        try:
            doc = json.loads(Path(args.replan).read_text())
        except (OSError, ValueError) as exc:
            ap.error(f"--replan {args.replan}: {exc}")
        print(replan(doc, args.charge))
        return 0
    if not (args.stack_ns >= 0 and args.stack_ns < float("inf")):
        ap.error(f"--stack-ns must be a finite number >= 0, got {args.stack_ns}")
    names = [n for n in args.cells.split(",") if n]
    unknown = [n for n in names if n not in CELLS]
    if unknown:
        ap.error(f"--cells: unknown {unknown}; known: {', '.join(CELLS)}")
    if not 0 <= args.warmup < args.iters:
        ap.error(f"--warmup {args.warmup} must be >= 0 and below --iters {args.iters}")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    strategies = tuple(x for x in args.strategies.split(",") if x)
    bad = [x for x in strategies if x not in STRATEGIES + OVERLAPPED]
    if bad or not strategies:
        ap.error(f"--strategies: unknown {bad}; known: {', '.join(STRATEGIES + OVERLAPPED)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for n in names:
        doc = run_cell(CELLS[n], args.iters, args.warmup, repeats=args.repeats, strategies=strategies,
                       stack_s_per_byte=args.stack_ns * 1e-9)
        (out / f"choice-{n}.json").write_text(json.dumps(doc, indent=1, default=str))
        text = table(doc)
        (out / f"choice-{n}.md").write_text(text + "\n")
        print(text + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
