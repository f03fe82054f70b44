"""One benchmark cell: a scenario x a model shape x several strategies, measured side by side.

`validate` refuses bad input before anything is written or spawned: unknown scenario, model or
strategy names, shares the machine cannot enforce, a model that cannot fit the emulated memory
caps, a network rate this machine cannot emulate (not root, no iproute2, no namespaces). `run_cell`
then writes the checkpoint and data to a scratch directory, profiles each distinct device in its
cgroup, runs each strategy (each rank behind its emulated link), and returns the result document
(raw numbers, summaries, environment). Nothing is written to the results directory here (see
`results.write`).
"""

from __future__ import annotations

import math
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import structlog

from xronos.bench import netem
from xronos.bench import strategies as st
from xronos.node.emulator import Confinement, RankLimits, find_controller, usable_cores, validate_limits
from xronos.bench.scenarios import DEFAULT_MEM_SCALE, PI5_SHARE, Scenario, get_scenario
from xronos.bench.workloads import PAPER_BLOCKS, get_shape, shape_config, write_checkpoint, write_dataset

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
    mem_scale: float | None = DEFAULT_MEM_SCALE
    unit_share: float = PI5_SHARE
    # Every rank's link rate, emulated with network namespaces + tc (bench/netem.py); the paper's
    # LAN is 1 Gbit/s. 0 = plain loopback (no limit).
    bandwidth_mbit: float = netem.PAPER_RATE_MBIT
    lr: float = 2e-5
    seed: int = 0
    name: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def cell_name(self) -> str:
        blocks = f"b{self.blocks}" if self.blocks else "full"
        return self.name or f"{self.scenario}_{self.model}_s{self.seq_len}_{blocks}{network_suffix(self.bandwidth_mbit)}"


def network_suffix(rate_mbit: float) -> str:
    """The paper's 1 Gbit/s is the standard; any other network is in the cell's name, so that its
    result never overwrites a standard cell's."""
    if rate_mbit == netem.PAPER_RATE_MBIT:
        return ""
    return f"_{rate_mbit:g}mbit" if rate_mbit else "_loopback"


def _param_count(config: dict) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    cfg = AutoConfig.for_model(config["model_type"], num_labels=2,
                               **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


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
    if spec.iters <= spec.warmup:
        raise ValueError(f"--iters {spec.iters} must exceed the {spec.warmup} warm-up iterations")
    max_pos = config.get("n_positions") or config.get("max_position_embeddings")
    if spec.seq_len > max_pos - 2:
        raise ValueError(f"--seq-len {spec.seq_len} exceeds what {spec.model} can take ({max_pos - 2})")
    if spec.batch_size % spec.micro_batches and "pp" in spec.strategies:
        raise ValueError(f"batch {spec.batch_size} does not split into {spec.micro_batches} micro-batches")
    if not (spec.unit_share > 0 and math.isfinite(spec.unit_share)):
        raise ValueError(f"unit share must be > 0, got {spec.unit_share}")
    check_bandwidth(spec.bandwidth_mbit)
    # Can this machine enforce the shares and caps? (EmulatorError is a ValueError.)
    caps = sc.memory_caps(spec.mem_scale)
    lims = [RankLimits(s, c) for s, c in zip(sc.shares(spec.unit_share), caps)]
    cpu = find_controller("cpu")
    if cpu is None:
        Confinement(lims)  # raises the emulator's own "no writable controller" message
    from xronos.node.emulator import cpu_limit_of

    validate_limits(lims, usable_cores(), cpu_limit_of(cpu))
    if any(c is not None for c in caps) and find_controller("memory") is None:
        raise ValueError("memory caps asked for (--mem-scale) but no writable cgroup memory controller")
    # Does the model fit the caps at all? Weights + grads + two AdamW moments, 16 B per fp32
    # parameter, spread perfectly, plus each rank's runtime: a necessary condition for every strategy.
    if all(c is not None for c in caps):
        need = 16 * _param_count(config) + len(caps) * st.RUNTIME_RESERVE
        if need > sum(caps):
            raise ValueError(
                f"{spec.model} with {config.get('n_layer') or config.get('num_hidden_layers')} blocks "
                f"needs at least {need / 2**30:.2f} GiB (weights, grads, AdamW state, runtime) but the "
                f"emulated caps of {sc.name} total {sum(caps) / 2**30:.2f} GiB "
                f"({[round(c / 2**30, 2) for c in caps]}); use fewer --blocks or a larger --mem-scale")
    if spec.bandwidth_mbit:
        netem.check_available()  # builds and removes a one-rank network: refuses naming what failed
    return sc, config


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
            "loadavg_start": os.getloadavg(), "started_at": time.time()}


def run_cell(spec: CellSpec, scratch: str | None = None) -> dict:
    sc, config = validate(spec)
    cpu = find_controller("cpu")
    env = environment(cpu.version if cpu else None)
    env["network"] = netem.describe(spec.bandwidth_mbit)
    doc: dict = {"spec": asdict(spec) | {"cell_name": spec.cell_name}, "environment": env,
                 "scenario": {"name": sc.name, "note": sc.note, "devices": [asdict(d) for d in sc.devices],
                              "shares": sc.shares(spec.unit_share), "memory_caps": sc.memory_caps(spec.mem_scale),
                              "ideal_ratio_to_uniform_from_speeds": sc.ideal_ratio_to_uniform()},
                 "model": {"name": spec.model, "blocks": spec.blocks or PAPER_BLOCKS[spec.model],
                           "paper_blocks": PAPER_BLOCKS[spec.model], "config": config,
                           "parameters": _param_count(config)},
                 "strategies": {}}
    with tempfile.TemporaryDirectory(prefix="xronos-bench-", dir=scratch) as tmp:
        work = Path(tmp)
        model_dir = write_checkpoint(work / "model", config, seed=spec.seed)
        rows = spec.batch_size * (spec.iters + 2)
        data = write_dataset(work / "data.jsonl", rows, spec.seq_len, get_shape(spec.model)["vocab_size"],
                             seed=spec.seed)
        ctx = st.Ctx(work, model_dir, data, config, sc.shares(spec.unit_share), sc.memory_caps(spec.mem_scale),
                     [d.name for d in sc.devices], spec.batch_size, spec.seq_len, spec.micro_batches,
                     spec.iters, spec.lr, spec.seed, bandwidth_mbit=spec.bandwidth_mbit)
        doc["strategies"] = run_strategies(spec, sc, config, ctx, doc)
    env["loadavg_end"] = os.getloadavg()
    env["finished_at"] = time.time()
    return doc


def run_strategies(spec: CellSpec, sc: Scenario, config: dict, ctx: st.Ctx, doc: dict) -> dict:
    """Profile the devices (into doc), then run every strategy; a failing one is recorded, not fatal."""
    want_tp = any(s in st.TP_STRATEGIES for s in spec.strategies)
    tp_reason = _tp_unavailable(ctx.model_dir) if want_tp else None
    t0 = time.perf_counter()
    profiles = st.profile_devices(ctx, want_tp and tp_reason is None, "pp" in spec.strategies)
    doc["profiling_s"] = time.perf_counter() - t0
    doc["profiles"] = profiles
    out: dict[str, dict] = {}
    for strat in spec.strategies:
        log.info("bench.strategy", cell=spec.cell_name, strategy=strat)
        entry: dict = {}
        t0 = time.perf_counter()
        try:
            if strat in st.TP_STRATEGIES:
                if tp_reason:
                    raise _NotRun(tp_reason)
                plan = st.tp_plan(ctx, profiles, strat)
                entry["plan"] = _plan_dict(plan)
                entry["raw"] = st.run_tp(ctx, plan.layout, strat)
            elif strat == "pp":
                plan = st.pp_plan(ctx, profiles)
                entry["plan"] = _plan_dict(plan)
                entry["raw"] = st.run_pp(ctx, plan)
            else:
                from xronos.bench.hftp_worker import supported

                reason = supported(config, sc.n)
                if reason:
                    raise _NotRun(reason)
                entry["raw"] = st.run_hftp(ctx)
        except _NotRun as exc:
            entry["not_run"] = str(exc)
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
    d = asdict(plan)
    for k, v in list(d.items()):
        if isinstance(v, float) and not math.isfinite(v):
            d[k] = None  # JSON has no inf
    return d
