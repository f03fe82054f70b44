"""One benchmark cell: a scenario x a model shape x several strategies, measured side by side.

`validate` refuses bad input before anything is written or spawned: unknown scenario, model or
strategy names, shares the machine cannot enforce, a memory scale out of range, a network rate this
machine cannot emulate (not root, no iproute2, no namespaces). `run_cell` then writes the checkpoint
and data to a scratch directory, profiles each distinct device in its cgroup, plans and runs each
strategy (each rank behind its emulated link, under its memory cap), and returns the result
document (raw numbers, plans, summaries, environment). A model that cannot fit the caps at all, or
a plan over a cap, is a result (`infeasible`), not an error. Nothing is written to the results
directory here (see `results.write`).
"""

from __future__ import annotations

import math
import os
import platform
import tempfile
import time
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path

import structlog

from xronos.bench import netem
from xronos.bench import strategies as st
from xronos.node.emulate.cgroupfs import find_controller, usable_cores
from xronos.node.emulate.confinement import (
    Confinement, RankLimits, host_memory_bytes, validate_limits, validate_virtual,
)
from xronos.node.emulate.cpumode import default_cpu_mode, default_estimator
from xronos.bench.scenarios import DEFAULT_MEM_SCALE, KEPT, PI5_SHARE, Scenario, get_scenario
from xronos.bench.workloads import (
    PAPER_BLOCKS, get_shape, kept_fraction, kind_parameters, lora_parameters, parameter_count, shape_config,
    write_checkpoint, write_dataset,
)
from xronos.protocol.recipe import LoraSpec

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class CellSpec:
    scenario: str
    model: str
    strategies: tuple[str, ...] = ("xronos", "uniform", "pp", "hf-tp")
    iters: int = 6
    warmup: int = 2
    seq_len: int = 32
    blocks: int | None = None
    batch_size: int = 8
    micro_batches: int = 8
    # Memory caps: "kept" (parameters kept / full model: the cell binds memory when the full model
    # would on the real devices), a number in (0, 1], or None (no caps). See scenarios.py.
    mem_scale: float | str | None = DEFAULT_MEM_SCALE
    unit_share: float = PI5_SHARE
    # Every rank's link rate, emulated with network namespaces + tc (bench/netem.py); the paper's
    # LAN is 1 Gbit/s. 0 = plain loopback (no limit).
    bandwidth_mbit: float = netem.PAPER_RATE_MBIT
    lr: float = 2e-5
    # The LoRA strategies' adapters (`xronos-lora`, `uniform-lora`, `pp-lora`): rank, alpha, target
    # modules (peft's names; empty: the family's default, peft's). Full fine-tuning ignores them.
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ()
    seed: int = 0
    name: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def cell_name(self) -> str:
        blocks = f"b{self.blocks}" if self.blocks else "full"
        lora = f"_lora{self.lora_r}" if self.has_lora else ""
        return self.name or (f"{self.scenario}_{self.model}_s{self.seq_len}_{blocks}{lora}"
                             f"{network_suffix(self.bandwidth_mbit)}")

    @property
    def has_lora(self) -> bool:
        return any(s in st.LORA_STRATEGIES for s in self.strategies)


def network_suffix(rate_mbit: float) -> str:
    """The paper's 1 Gbit/s is the standard; any other network is in the cell's name, so that its
    result never overwrites a standard cell's."""
    if rate_mbit == netem.PAPER_RATE_MBIT:
        return ""
    return f"_{rate_mbit:g}mbit" if rate_mbit else "_loopback"


def _param_count(config: dict) -> int:
    return parameter_count(config)


def mem_scale_of(spec: CellSpec) -> float | None:
    """The cell's memory scale as a number: "kept" = parameters kept / parameters of the full model
    (`workloads.kept_fraction`), a number as given, None = no caps."""
    if spec.mem_scale == KEPT:
        return kept_fraction(spec.model, spec.blocks)
    if spec.mem_scale is None:
        return None
    v = spec.mem_scale
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0 < v <= 1):
        raise ValueError(f"--mem-scale must be a number in (0, 1], {KEPT!r} or 'none', got {v!r}")
    return float(v)


def cell_caps(spec: CellSpec, sc: Scenario | None = None) -> list[int | None]:
    return (sc or get_scenario(spec.scenario)).memory_caps(mem_scale_of(spec))


def validate(spec: CellSpec) -> tuple[Scenario, dict]:
    sc = get_scenario(spec.scenario)
    config = shape_config(spec.model, spec.blocks)
    unknown = [s for s in spec.strategies if s not in st.STRATEGIES]
    if unknown or not spec.strategies:
        raise ValueError(f"unknown strategies {unknown or '(none given)'}; known: {', '.join(st.STRATEGIES)}")
    if len(set(spec.strategies)) != len(spec.strategies):
        raise ValueError(f"strategies listed twice: {list(spec.strategies)}")
    for name in ("iters", "warmup", "seq_len", "batch_size", "micro_batches"):
        v = getattr(spec, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "warmup" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
    if spec.has_lora:
        lora_of(spec, config)  # refuses a bad rank, alpha or target naming what is wrong
    if spec.iters <= spec.warmup:
        raise ValueError(f"--iters {spec.iters} must exceed the {spec.warmup} warm-up iterations")
    max_pos = config.get("n_positions") or config.get("max_position_embeddings")
    if spec.seq_len > max_pos - 2:
        raise ValueError(f"--seq-len {spec.seq_len} exceeds what {spec.model} can take ({max_pos - 2})")
    if spec.batch_size % spec.micro_batches and any(s in st.PP_STRATEGIES for s in spec.strategies):
        raise ValueError(f"batch {spec.batch_size} does not split into {spec.micro_batches} micro-batches")
    if not (spec.unit_share > 0 and math.isfinite(spec.unit_share)):
        raise ValueError(f"unit share must be > 0, got {spec.unit_share}")
    check_bandwidth(spec.bandwidth_mbit)
    # Can this machine enforce the shares and caps? (EmulatorError is a ValueError.)
    caps = cell_caps(spec, sc)
    lims = [RankLimits(s, c, d.name) for s, c, d in zip(sc.shares(spec.unit_share), caps, sc.devices)]
    virtual = default_cpu_mode() == "virtual"
    if virtual:
        # speeds, and the caps against this host's memory (they are real), before the cgroup check
        validate_virtual(lims, host_memory_bytes())
        if not spec.bandwidth_mbit:
            raise ValueError("--bandwidth-mbit 0 (plain loopback) means nothing on the virtual clock, which "
                             "models the link: give the link's rate (Mbit/s > 0)")
    cpu = find_controller("cpu")
    if cpu is None:
        Confinement(lims)  # raises the emulator's own "no writable controller" message
    from xronos.node.emulate.cgroupfs import cpu_limit_of

    if not virtual:
        validate_limits(lims, usable_cores(), cpu_limit_of(cpu))
    if any(c is not None for c in caps) and find_controller("memory") is None:
        raise ValueError("memory caps asked for (--mem-scale) but no writable cgroup memory controller")
    if spec.bandwidth_mbit and not virtual:
        netem.check_available()  # builds and removes a one-rank network: refuses naming what failed
    return sc, config


def lora_of(spec: CellSpec, config: dict):
    """The cell's LoraSettings on its model's family (ValueError naming a bad rank, alpha, target)."""
    from xronos.node.models.registry import family_by_name

    family = family_by_name(config["model_type"])  # the families are named as transformers' model types
    if isinstance(spec.lora_r, bool) or not isinstance(spec.lora_r, int) or spec.lora_r < 1:
        raise ValueError(f"--lora-r must be a positive integer, got {spec.lora_r!r}")
    return family.lora_settings(LoraSpec(r=spec.lora_r, alpha=spec.lora_alpha, targets=list(spec.lora_targets) or None))


def model_state_bytes(spec: CellSpec, config: dict, strategy: str) -> tuple[int, str]:
    """Bytes of fp32 training state a strategy needs, and what they are. Full fine-tuning: weights,
    gradients and two AdamW moments, 16 B per parameter. LoRA: the frozen base's weights only,
    4 B per parameter, and 16 B per trained parameter (the adapters and the classification head)."""
    if strategy in st.LORA_STRATEGIES:
        lora = lora_of(spec, config)
        frozen, trained = lora_parameters(config, lora.r, lora.targets)
        return 4 * frozen + 16 * trained, (f"LoRA r={lora.r} on {','.join(lora.targets)}: {frozen / 1e6:.1f} M frozen "
                                           f"at 4 B, {trained / 1e6:.2f} M trained at 16 B, runtime")
    return 16 * _param_count(config), "weights, grads, AdamW state, runtime"


def memory_shortfall(spec: CellSpec, sc: Scenario, config: dict, caps: list[int | None],
                     strategy: str = "xronos") -> str | None:
    """Why `strategy` cannot fit the caps, or None. Its training state (`model_state_bytes`: 16 B
    per parameter for full fine-tuning; LoRA's frozen base at 4 B) spread perfectly, plus each
    rank's runtime: a necessary condition, whatever the plan. A strategy that fails it is reported
    infeasible (not an error: it is a result)."""
    if not all(c is not None for c in caps):
        return None
    state, what = model_state_bytes(spec, config, strategy)
    need = state + len(caps) * st.RUNTIME_RESERVE
    if need <= sum(caps):
        return None
    return (f"{spec.model} with {config.get('n_layer') or config.get('num_hidden_layers')} blocks needs at "
            f"least {need / 2**30:.2f} GiB ({what}) but the emulated caps of "
            f"{sc.name} total {sum(caps) / 2**30:.2f} GiB ({[round(c / 2**30, 2) for c in caps]})")


def check_bandwidth(rate_mbit: float) -> None:
    """The value only (0 = loopback); whether the machine can emulate it is `netem.check_available`."""
    bad = isinstance(rate_mbit, bool) or not isinstance(rate_mbit, (int, float)) or not (
        math.isfinite(rate_mbit) and rate_mbit >= 0)
    if bad:
        raise ValueError(f"--bandwidth-mbit must be a number >= 0 (0 = loopback), got {rate_mbit!r}")
    if rate_mbit:
        netem.validate_rate(rate_mbit)


def environment(cpu_version: int | None) -> dict:
    import torch
    import transformers

    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), platform.processor())
    return {"cpu_model": model, "cores": usable_cores(), "machine": platform.machine(),
            "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cgroup_version": cpu_version,
            "cpu_emulation": default_cpu_mode(), "clock": "virtual" if default_cpu_mode() == "virtual" else "wall",
            "estimator": default_estimator() if default_cpu_mode() == "virtual" else None,
            "loadavg_start": os.getloadavg(), "started_at": time.time()}


def run_cell(spec: CellSpec, scratch: str | None = None) -> dict:
    sc, config = validate(spec)
    cpu = find_controller("cpu")
    env = environment(cpu.version if cpu else None)
    env["network"] = (f"modelled on the virtual clock: {spec.bandwidth_mbit:g} Mbit/s, "
                      f"{st.NOMINAL_LATENCY_S * 1e3:g} ms a call" if env["clock"] == "virtual"
                      else netem.describe(spec.bandwidth_mbit))
    scale, caps = mem_scale_of(spec), cell_caps(spec, sc)
    doc: dict = {"spec": asdict(spec) | {"cell_name": spec.cell_name}, "environment": env,
                 "scenario": {"name": sc.name, "note": sc.note, "devices": [asdict(d) for d in sc.devices],
                              "shares": sc.shares(spec.unit_share), "memory_caps": caps,
                              "mem_scale": scale, "mem_scale_basis": _scale_basis(spec),
                              "runtime_reserve": st.RUNTIME_RESERVE,
                              "ideal_ratio_to_uniform_from_speeds": sc.ideal_ratio_to_uniform()},
                 "model": {"name": spec.model, "blocks": spec.blocks or PAPER_BLOCKS[spec.model],
                           "paper_blocks": PAPER_BLOCKS[spec.model], "config": config,
                           "parameters": _param_count(config),
                           "full_parameters": _param_count(shape_config(spec.model, None)),
                           "kind_parameters": kind_parameters(config)},
                 "strategies": {}}
    # Full fine-tuning and LoRA need different memory: each strategy is checked on its own.
    short = {s: why for s in spec.strategies if (why := memory_shortfall(spec, sc, config, caps, s))}
    for s, why in short.items():  # a result, not an error: the strategy cannot run, the cell says why
        log.warning("bench.strategy_infeasible", cell=spec.cell_name, strategy=s, reason=why)
    doc["strategies"] = {s: {"infeasible": why, "wall_s": 0.0} for s, why in short.items()}
    runnable = dataclasses.replace(spec, strategies=tuple(s for s in spec.strategies if s not in short))
    if runnable.strategies:
        with tempfile.TemporaryDirectory(prefix="xronos-bench-", dir=scratch) as tmp:
            ctx = cell_context(spec, sc, config, caps, Path(tmp))
            doc["strategies"] |= run_strategies(runnable, sc, config, ctx, doc)
        doc["strategies"] = {s: doc["strategies"][s] for s in spec.strategies}  # the spec's order
    env["loadavg_end"] = os.getloadavg()
    env["finished_at"] = time.time()
    return doc


def cell_context(spec: CellSpec, sc: Scenario, config: dict, caps: list[int | None], work: Path) -> st.Ctx:
    """The cell's checkpoint and data in `work` (rows for `spec.iters` steps) and what every strategy
    run needs to know about it."""
    model_dir = write_checkpoint(work / "model", config, seed=spec.seed)
    rows = spec.batch_size * (spec.iters + 2)
    data = write_dataset(work / "data.jsonl", rows, spec.seq_len, get_shape(spec.model)["vocab_size"], seed=spec.seed)
    return st.Ctx(work, model_dir, data, config, sc.shares(spec.unit_share), caps, [d.name for d in sc.devices],
                  spec.batch_size, spec.seq_len, spec.micro_batches, spec.iters, spec.lr, spec.seed,
                  bandwidth_mbit=spec.bandwidth_mbit, lora_r=spec.lora_r, lora_alpha=spec.lora_alpha,
                  lora_targets=spec.lora_targets or None)


def _scale_basis(spec: CellSpec) -> str:
    if spec.mem_scale == KEPT:
        return "parameters kept / parameters of the full model"
    return "no caps" if spec.mem_scale is None else "given (--mem-scale)"


def run_strategies(spec: CellSpec, sc: Scenario, config: dict, ctx: st.Ctx, doc: dict) -> dict:
    """Profile the devices (into doc), then run every strategy; a failing one is recorded, not fatal.

    A strategy whose plan exceeds a memory cap is recorded as infeasible with the plan and the
    numbers (`infeasible`), never timed. A TP strategy whose layout equals one already measured in
    this cell is not run again: it gets that run's numbers and says so (`same_layout_as`), so two
    identical plans never show run-to-run noise as a difference."""
    want_tp = any(s in st.TP_STRATEGIES and s not in st.LORA_STRATEGIES for s in spec.strategies)
    want_lora = any(s in st.TP_STRATEGIES and s in st.LORA_STRATEGIES for s in spec.strategies)
    tp_reason = _tp_unavailable(ctx.model_dir) if want_tp or want_lora else None
    want_hf_caps = "hf-tp" in spec.strategies and any(c is not None for c in ctx.caps)
    t0 = time.perf_counter()
    profiles = st.profile_devices(ctx, (want_tp or want_hf_caps) and tp_reason is None, "pp" in spec.strategies,
                                  want_lora=want_lora and tp_reason is None,
                                  want_pp_lora="pp-lora" in spec.strategies)
    doc["profiling_s"] = time.perf_counter() - t0
    doc["profiles"] = profiles
    out: dict[str, dict] = {}
    measured: dict[str, str] = {}  # layout text -> the strategy that measured it
    for strat in spec.strategies:
        log.info("bench.strategy", cell=spec.cell_name, strategy=strat)
        entry: dict = {}
        t0 = time.perf_counter()
        try:
            if strat in st.TP_STRATEGIES:
                if tp_reason:
                    raise _NotRun(tp_reason)
                entry["planner_strategy"] = st.planner_strategy(strat)
                plan = st.tp_plan(ctx, profiles, strat)
                entry["plan"] = _plan_dict(plan)
                why = st.over_cap(plan)
                if why:
                    raise st.Infeasible(why)
                # the same layout trains something else with LoRA: never shared across the two
                key = f"{st.profile_key(strat)} {plan.layout.to_text()}"
                if key in measured:
                    entry["same_layout_as"] = measured[key]
                    entry["raw"] = out[measured[key]]["raw"]
                else:
                    entry["raw"] = st.run_tp(ctx, plan.layout, strat)
                    measured[key] = strat
            elif strat in st.PP_STRATEGIES:
                from xronos.bench.pp_plan import InfeasiblePipeline

                try:
                    plan = st.pp_plan(ctx, profiles, strat)
                except InfeasiblePipeline as exc:
                    raise st.Infeasible(str(exc)) from None
                entry["plan"] = _plan_dict(plan)
                entry["raw"] = st.run_pp(ctx, plan, strat)
            else:
                from xronos.bench.hftp_worker import supported

                if st.virtual():
                    raise _NotRun("wall clock only: transformers' tp_plan calls torch.distributed past the "
                                  "virtual clock (run it with --cpu-mode quota or pace)")
                reason = supported(config, sc.n)
                if reason:
                    raise _NotRun(reason)
                if want_hf_caps and tp_reason is None:
                    # transformers' even TP holds at least what our even split holds on every rank
                    why = st.over_cap(st.tp_plan(ctx, profiles, "uniform"))
                    if why:
                        raise st.Infeasible(f"the even split does not fit ({why})")
                entry["raw"] = st.run_hftp(ctx)
        except _NotRun as exc:
            entry["not_run"] = str(exc)
        except st.Infeasible as exc:
            log.warning("bench.strategy_infeasible", strategy=strat, reason=str(exc)[-500:])
            entry["infeasible"] = str(exc)[-3000:]
        except Exception as exc:  # a strategy failing (e.g. OOM-killed) is a result, not a crash
            log.warning("bench.strategy_failed", strategy=strat, error=str(exc)[-500:])
            entry["failed"] = f"{type(exc).__name__}: {exc}"[-3000:]
        entry["wall_s"] = time.perf_counter() - t0
        out[strat] = entry
    return out

class _NotRun(Exception):
    pass


def _tp_unavailable(model_dir: Path) -> str | None:
    import json

    from xronos.node.models.registry import family_for

    try:
        family_for(json.loads((model_dir / "config.json").read_text()))
    except ValueError as exc:
        return f"the Xronos engine cannot run this model yet: {exc}"
    return None


def _plan_dict(plan) -> dict:
    """A planner or pipeline result as plain JSON; a TP plan also gets its layout and each row its
    per-kind counts (`attn`, `mlp`, `vocab`; `units` = attention units), whatever the planner's
    row type carries itself."""
    d = _finite(asdict(plan))
    layout = getattr(plan, "layout", None)
    if layout is not None and hasattr(layout, "counts"):
        d["layout"] = {k: list(layout.counts(k)) for k in ("attn", "mlp", "vocab")}
        d["layout_text"] = layout.to_text()
        for row in d.get("rows", []):
            r = row["rank"]
            row.update(attn=layout.attn[r], mlp=layout.mlp[r], vocab=layout.vocab[r], units=layout.attn[r])
    return d


def _finite(v):
    if hasattr(v, "model_dump"):  # a pydantic model inside a plan (Sizes, Layout)
        v = v.model_dump(mode="json")
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no inf
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v
