"""Run one strategy of a benchmark cell on emulated devices; return its raw per-rank numbers.

Every strategy trains the same checkpoint on the same data file (hence the same batches), each
rank confined to its device's CPU share and memory cap:
- `xronos` / `xronos-paper` / `uniform`: our engine through the trainer's `launch_local`, the
  layout from the planner over the devices' profiles: `segment` (each segment kind split on its
  own, minimising the sum of per-segment bottlenecks under the memory caps; the default),
  `paper` (the paper's head-tied greedy: a head with its share of the MLP and vocabulary) and
  `uniform` (Megatron-style even split);
- `xronos-lora`: `xronos` (the per-segment planner) training LoRA adapters on the frozen base
  (the cell's `lora_r`, `lora_targets`), planned over LoRA profiles of the devices (the profiling
  set trains the same adapters: no weight gradients for frozen weights, optimizer state for the
  adapters and the head only); `uniform-lora`: the even split training the same adapters;
- `pp`: the Asteroid-style pipeline (stages from the DP over the devices' layer profiles);
  `pp-lora`: the same pipeline training the same adapters (peft's LoRA layers in each stage, the
  adapters drawn as the TP engine draws them), planned over LoRA layer profiles;
- `hf-tp`: transformers' own even TP, where the model's sizes divide the rank count.
On the virtual clock (the emulator's default mode) the link is modelled at `Ctx.bandwidth_mbit`
(`xronos.node.emulate.link`); on the wall clock (quota, pace), with `Ctx.bandwidth_mbit` set, every
launch runs its ranks in the network emulator (one namespace per rank behind a link of that rate,
`bench/netem.py`). Planning assumes that rate either way. transformers' TP (`hf-tp`) calls
torch.distributed itself, past our clock: it runs on the wall clock only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import structlog

from xronos.node.emulate.confinement import Confinement, RankLimits
from xronos.node.emulate.cpumode import default_cpu_mode
from xronos.node.emulate.link import Link
from xronos.bench.scenarios import RUNTIME_RESERVE
from xronos.protocol.recipe import LoraSpec, Recipe

log = structlog.get_logger(__name__)
# Bench strategy -> planner strategy (`xronos.gateway.plan.planner.STRATEGIES`).
TP_STRATEGIES = {"xronos": "segment", "xronos-paper": "paper", "uniform": "uniform", "xronos-lora": "segment",
                 "uniform-lora": "uniform"}
PP_STRATEGIES = ("pp", "pp-lora")
# Strategies that train LoRA adapters (Ctx.lora_*) on a frozen base; the ratios compare them among
# themselves, never with full fine-tuning (`results.LORA_SUFFIX`).
LORA_STRATEGIES = ("xronos-lora", "uniform-lora", "pp-lora")
STRATEGIES = (*TP_STRATEGIES, *PP_STRATEGIES, "hf-tp")
NOMINAL_BW_BPS = 1e9 / 8  # 1 Gbit/s Ethernet (the paper's LAN) for planning inputs on loopback
NOMINAL_LATENCY_S = 0.5e-3


@dataclasses.dataclass(frozen=True)
class Ctx:
    """What every strategy run needs to know about the cell."""

    work: Path
    model_dir: Path
    data_path: Path
    config: dict
    shares: list[float]
    caps: list[int | None]
    device_names: list[str]
    batch_size: int
    seq_len: int
    micro_batches: int
    iters: int
    lr: float
    seed: int
    eval_fraction: float = 0.0  # > 0 only for the time-to-accuracy run (trainer evaluates the tail)
    dropout: float | None = None  # override every dropout probability (None: the checkpoint's)
    bandwidth_mbit: float = 0.0  # emulated link rate per rank (bench/netem.py); 0: plain loopback
    # virtual clock: the link's network-stack CPU per byte carried (`Link.stack_s_per_byte`), profile and run
    stack_s_per_byte: float = 0.0
    # LoRA strategies' adapters: rank, alpha, target module names (None: the family's default).
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] | None = None


def limits(ctx: Ctx, order: list[int]) -> list[RankLimits]:
    return [RankLimits(ctx.shares[d], ctx.caps[d], ctx.device_names[d]) for d in order]


def virtual() -> bool:
    """Do the cell's ranks run on the virtual clock (`XRONOS_EMULATOR_CPU`, virtual by default)?"""
    return default_cpu_mode() == "virtual"


def confine(ctx: Ctx, lims: list[RankLimits]) -> Confinement:
    """The ranks' groups in the emulator's mode; on the virtual clock, with the cell's link."""
    link = Link(planning_bw_bps(ctx), NOMINAL_LATENCY_S, ctx.stack_s_per_byte)
    return Confinement(lims, top_weight=True, link=link)


def planning_bw_bps(ctx: Ctx) -> float:
    """Bytes/s the planners assume per link: the emulated rate, or the paper's LAN on loopback."""
    return ctx.bandwidth_mbit * 1e6 / 8 if ctx.bandwidth_mbit else NOMINAL_BW_BPS


@contextlib.contextmanager
def network(ctx: Ctx, n: int) -> Iterator[object | None]:
    """The ranks' placement for one launch: an emulated LAN of n links, or None (loopback; on the
    virtual clock, whose link is modelled)."""
    if not ctx.bandwidth_mbit or virtual():
        yield None
        return
    from xronos.bench.netem import Network

    with Network(n, ctx.bandwidth_mbit) as net:
        yield net


def network_record(net, ctx: Ctx | None = None) -> dict:
    from xronos.bench.netem import LOOPBACK

    if net is None and ctx is not None and virtual():
        bw = planning_bw_bps(ctx)
        return {"kind": "modelled", "rate_mbit": bw * 8 / 1e6, "latency_s": NOMINAL_LATENCY_S,
                "description": f"modelled on the virtual clock: {bw * 8 / 1e6:g} Mbit/s, "
                               f"{NOMINAL_LATENCY_S * 1e3:g} ms a call (alpha-beta per collective)"}
    return net.describe() if net is not None else {"kind": "loopback", "description": LOOPBACK}


def planning_caps(ctx: Ctx) -> list[float]:
    """Bytes of model memory each rank may use: the cap minus the runtime reserve (pipeline plan)."""
    return [float(NO_CAP) if c is None else max(0.0, c - RUNTIME_RESERVE) for c in ctx.caps]


# -- profiling ------------------------------------------------------------------------------------
def profile_devices(ctx: Ctx, want_tp: bool, want_pp: bool, iters: int | None = None,
                    want_lora: bool = False, want_pp_lora: bool = False) -> dict[str, dict]:
    """Profile each distinct device once, inside its own cgroup, all devices at the same time (their
    shares fit the machine together): {device name: {"tp": ProfileReport JSON, "pp": layer profile,
    "tp-lora": the ProfileReport of the LoRA job (`want_lora`), "pp-lora": its layer profile
    (`want_pp_lora`)}}. `iters`: 3 on the wall clock; 8 on
    the virtual clock, whose estimator needs samples (a median of 2-3 under load 17 put a Set-A
    MiniPC at 2.0 Pi 5s, the run at 1.4), and which profiles at host speed (~40 s a device)."""
    from xronos.bench.profile_device import ProfileJob
    from xronos.node.measure.profiler import HEAP_ENV

    if iters is None:
        iters = 8 if virtual() else 3

    first = {name: d for d, name in reversed(list(enumerate(ctx.device_names)))}
    jobs = {}
    for name, d in first.items():
        jobs[name] = ProfileJob(model_dir=str(ctx.model_dir), batch_size=ctx.batch_size, seq_len=ctx.seq_len,
                                micro_rows=max(1, ctx.batch_size // ctx.micro_batches), iters=iters,
                                tp_out=str(ctx.work / f"tp-{d}.json") if want_tp else None,
                                pp_out=str(ctx.work / f"pp-{d}.json") if want_pp else None,
                                tp_lora_out=str(ctx.work / f"tp-lora-{d}.json") if want_lora else None,
                                pp_lora_out=str(ctx.work / f"pp-lora-{d}.json") if want_pp_lora else None,
                                lora_r=ctx.lora_r,
                                lora_targets=list(ctx.lora_targets) if ctx.lora_targets else None)
        (ctx.work / f"profile-{d}.json").write_text(jobs[name].model_dump_json())
    log.info("bench.profile", devices=list(first))
    # CPU share only: the memory caps emulate the training budget; the profiler's own transient
    # footprint (several widths, memory instrumentation) is not scaled down like the caps are.
    with confine(ctx, [RankLimits(ctx.shares[d], None, name) for name, d in first.items()]) as conf:
        procs = {}
        for r, (name, d) in enumerate(first.items()):
            # The heap probes always: the profile sees this host's memory, but the device it stands
            # for has the cell's cap, which the plans bind against (the profiler would skip them here).
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "xronos.bench.profile_device", str(ctx.work / f"profile-{d}.json")],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, HEAP_ENV: "always"})
            conf.add(r, procs[name].pid)
        errs = {name: p.communicate()[1] for name, p in procs.items()}
    out: dict[str, dict] = {}
    for name, proc in procs.items():
        if proc.returncode != 0:
            how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
            raise RuntimeError(f"profiling {name} failed ({how}; signal 9 under a memory cap is the OOM "
                               f"killer):\n{errs[name].decode(errors='replace')[-2000:]}")
        job = jobs[name]
        out[name] = {k.replace("_", "-"): json.loads(Path(getattr(job, f"{k}_out")).read_text())
                     for k in ("tp", "pp", "tp_lora", "pp_lora") if getattr(job, f"{k}_out")}
    return out


# -- TP strategies ------------------------------------------------------------------------------
class Infeasible(ValueError):
    """No plan of this strategy fits the emulated memory caps (the message names needs and caps)."""


def planner_strategy(strategy: str) -> str:
    """The planner strategy a bench TP strategy runs."""
    return TP_STRATEGIES[strategy]


def tp_plan(ctx: Ctx, profiles: dict[str, dict], strategy: str):
    """The planner's PlanResult for this strategy over the devices' Xronos profiles: the one place
    the bench calls the planner (`xronos.gateway.plan.profiles.plan_reports`, what `xronos plan` runs).

    Each rank's report is the profile of its device with the node id made unique and the memory the
    planner may use set to the emulated cap (`plan_reports` subtracts `RUNTIME_RESERVE`); the
    communication term assumes the emulated link rate. Raises `Infeasible` when the planner finds
    no plan within the caps; a plan over a cap (uniform ignores memory) is returned with
    `feasible=False` (see `over_cap`)."""
    from xronos.gateway.plan.planner import InfeasiblePlan
    from xronos.gateway.plan.profiles import plan_reports

    loaded, reserve_mb = loaded_profiles(ctx, profiles, profile_key(strategy))
    try:
        return plan_reports(loaded, planner_strategy(strategy), reserve_mb=reserve_mb, exports=False,  # run_tp exports nothing
                            bandwidth_Bps=planning_bw_bps(ctx), latency_s=NOMINAL_LATENCY_S)
    except InfeasiblePlan as exc:
        raise Infeasible(str(exc)) from None


def loaded_profiles(ctx: Ctx, profiles: dict[str, dict], key: str, wire_ids: bool = False) -> tuple[list, float]:
    """Every rank's report (its device's profile `key`, node id `r<d> <device>`, or `r<d>` with
    `wire_ids`, as a Plan message needs them; memory the emulated cap) as the planner loads it, and
    the reserve to plan with."""
    from xronos.gateway.plan.compatible import Loaded
    from xronos.protocol.messages import ProfileReport

    loaded = []
    for d, name in enumerate(ctx.device_names):
        report = ProfileReport.model_validate(profiles[name][key])
        cap = ctx.caps[d]
        caps = report.capabilities.model_copy(update={"memory_available": NO_CAP if cap is None else int(cap)})
        report = report.model_copy(update={"node_id": f"r{d}" if wire_ids else f"r{d} {name}", "capabilities": caps})
        loaded.append(Loaded(source=f"profile of rank {d} ({name})", report=report))
    # A profile that measured the process (runtime_bytes, profiler version 6) predicts the whole
    # resident set: the planner then plans against the cgroup's cap itself, the one the kernel
    # enforces; an older one predicts the model alone, planned against the cap minus the reserve.
    measured = all(item.report.runtime_bytes > 0 for item in loaded)
    return loaded, 0.0 if measured else RUNTIME_RESERVE / 2**20


def profile_key(strategy: str) -> str:
    """Which of a device's profiles plans this strategy: the LoRA job's own, or full fine-tuning's;
    the engine's, or the pipeline's per-layer one."""
    kind = "pp" if strategy in PP_STRATEGIES else "tp"
    return f"{kind}-lora" if strategy in LORA_STRATEGIES else kind


def lora_spec(ctx: Ctx, strategy: str) -> LoraSpec | None:
    """The adapters a strategy trains (None: full fine-tuning)."""
    if strategy not in LORA_STRATEGIES:
        return None
    return LoraSpec(r=ctx.lora_r, alpha=ctx.lora_alpha, targets=list(ctx.lora_targets) if ctx.lora_targets else None)


def over_cap(plan) -> str | None:
    """Why a plan does not fit (each node over its cap: predicted need and cap), or None."""
    if getattr(plan, "feasible", True):
        return None
    over = [f"{r.node_id} needs {r.predicted_memory / 2**30:.2f} GiB, cap {r.memory_cap / 2**30:.2f} GiB"
            for r in plan.rows if r.over_cap]
    return ("plan exceeds the memory caps (predicted peak resident set vs the cgroup cap; model memory "
            "vs the cap minus the runtime reserve for a profile without runtime_bytes): "
            + "; ".join(over or ["(no node named)"]))


NO_CAP = 1 << 50  # bytes: "no cap" for the planner


def cell_recipe(ctx: Ctx, lora: LoraSpec | None = None) -> Recipe:
    """What every strategy of a cell trains: the same rows, batches and updates (no clipping, no
    weight decay: the baselines have neither)."""
    return Recipe(model_dir=str(ctx.model_dir), data_path=str(ctx.data_path), task="classify",
                  batch_size=ctx.batch_size, seq_len=ctx.seq_len, lr=ctx.lr, max_steps=ctx.iters, seed=ctx.seed,
                  eval_fraction=ctx.eval_fraction, dropout=ctx.dropout, max_grad_norm=None, lora=lora)


def run_tp(ctx: Ctx, layout, tag: str) -> dict:
    from xronos.node.rank.local import launch_local
    from xronos.node.runconfig import RunConfig

    metrics = ctx.work / f"metrics-{tag}.json"
    cfg = RunConfig(recipe=cell_recipe(ctx, lora=lora_spec(ctx, tag)), layout=layout, threads=1, metrics_path=str(metrics),
                    progress=False, gloo_timeout_s=600)
    n = layout.world_size
    with confine(ctx, limits(ctx, list(range(n)))) as conf, network(ctx, n) as net:
        launch_local(cfg, n, wrap=conf.wrap, echo_rank0=False, placement=net)
        quotas, link = conf.quotas(), network_record(net, ctx)
        # What the kernel enforced and counted per rank (cap, peak charge, OOM kills), beside the
        # rank's own whole-life peak resident set: the memory half of the prediction check.
        kernel = [conf.memory_stats(r) if ctx.caps[r] is not None else None for r in range(n)]
    doc = json.loads(metrics.read_text())
    peaks = (doc.get("memory") or {}).get("peak_rss_bytes") or [None] * n
    # "units" is the rank's attention units (the planning unit of the head-tied strategies).
    return {"ranks": [{"device": d, "units": layout.attn[d], "attn": layout.attn[d], "mlp": layout.mlp[d],
                       "vocab": layout.vocab[d], "iterations": r["iterations"]}
                      for d, r in zip(range(n), doc["ranks"])], "quotas": quotas,
            "network": link, "eval_before": doc.get("eval_before"), "eval_after": doc.get("eval_after"),
            "memory": [{"peak_rss_bytes": p, "kernel": k} for p, k in zip(peaks, kernel)]}


# -- pipeline -----------------------------------------------------------------------------------
def pp_plan(ctx: Ctx, profiles: dict[str, dict], strategy: str = "pp"):
    from xronos.bench.pp_plan import plan_pipeline
    from xronos.bench.pp_profile import chain, chain_params

    key = profile_key(strategy)
    times, weights, acts = [], None, None
    for name in ctx.device_names:
        t, weights, acts = chain(profiles[name][key], ctx.micro_batches)
        times.append(t)
    first = profiles[ctx.device_names[0]][key]
    hidden = first["hidden"]
    rows = max(1, ctx.batch_size // ctx.micro_batches)
    msg = rows * ctx.seq_len * hidden * 4  # one fp32 activation (and its gradient) per boundary
    boundary = [2 * (NOMINAL_LATENCY_S + msg / planning_bw_bps(ctx))] * len(weights)
    # On top of its training state: two fp32 copies of a stage's largest layer, held briefly (the
    # checkpoint tensor while it is copied in, the embedding's dense per-micro-batch gradient before it
    # is accumulated, the per-tensor AdamW temporaries; freed heap stays resident, node/measure/allocator.py).
    # Without it a Pi 5 stage holding the TinyLlama embedding and two blocks was planned at 2.31 GiB
    # of its 2.41 GiB budget and OOM-killed at 2.84 GiB resident; an embedding-only stage peaked at
    # ~2.9 GiB RSS with 1.0 GiB of weights, gradients and AdamW state.
    transient = [8 * p for p in chain_params(first)]
    return plan_pipeline(times, weights, acts, boundary, planning_caps(ctx), ctx.micro_batches, transient)


def run_pp(ctx: Ctx, plan, strategy: str = "pp") -> dict:
    from xronos.bench.pp_worker import PPRankConfig
    from xronos.node.rank.local import spawn_ranks

    if len(plan.stages) < 2:
        raise ValueError("the pipeline plan put the whole model on one device; nothing to pipeline")
    order = [s.device for s in plan.stages]
    metrics = ctx.work / f"metrics-{strategy}.json"
    cfg = PPRankConfig(recipe=cell_recipe(ctx, lora=lora_spec(ctx, strategy)), micro_batches=ctx.micro_batches,
                       spans=[(s.start, s.stop) for s in plan.stages], metrics_path=str(metrics), gloo_timeout_s=600)
    with confine(ctx, limits(ctx, order)) as conf, network(ctx, len(order)) as net:
        spawn_ranks("xronos.bench.pp_worker", [cfg] * len(order), conf.wrap, placement=net)
        quotas, link = conf.quotas(), network_record(net, ctx)
    doc = json.loads(metrics.read_text())
    return {"ranks": [{"device": d, "span": r["span"], "iterations": r["iterations"]}
                      for d, r in zip(order, doc["ranks"])], "quotas": quotas, "network": link,
            "idle_devices": [d for d in range(len(ctx.shares)) if d not in order]}


# -- transformers' TP ---------------------------------------------------------------------------
def run_hftp(ctx: Ctx) -> dict:
    from xronos.bench.hftp_worker import HFTPRankConfig
    from xronos.node.rank.local import spawn_ranks

    n = len(ctx.shares)
    metrics = ctx.work / "metrics-hftp.json"
    # eval_fraction 0 and the checkpoint's dropout, as before: transformers' TP is timed, not evaluated.
    cfg = HFTPRankConfig(recipe=cell_recipe(ctx).model_copy(update={"eval_fraction": 0.0, "dropout": None}),
                         world_size=n, metrics_path=str(metrics))
    if virtual():
        raise ValueError("hf-tp runs on the wall clock only (transformers' tp_plan calls torch.distributed "
                         "past our clock): run it with --cpu-mode quota or pace")
    with confine(ctx, limits(ctx, list(range(n)))) as conf, network(ctx, n) as net:
        spawn_ranks("xronos.bench.hftp_worker", [cfg] * n, conf.wrap, placement=net)
        quotas, link = conf.quotas(), network_record(net, ctx)
    doc = json.loads(metrics.read_text())
    return {"ranks": [{"device": d, "iterations": r["iterations"]} for d, r in enumerate(doc["ranks"])],
            "quotas": quotas, "network": link}
