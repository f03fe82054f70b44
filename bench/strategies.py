"""Run one strategy of a benchmark cell on emulated devices; return its raw per-rank numbers.

Every strategy trains the same checkpoint on the same data file (hence the same batches), each
rank confined to its device's CPU share and memory cap:
- `xronos` / `xronos-optimal` / `uniform`: our engine through the trainer's `launch_local`, units
  from the planner (greedy, optimal, Megatron-style even split) over the devices' profiles;
- `pp`: the Asteroid-style pipeline (stages from the DP over the devices' layer profiles);
- `hf-tp`: transformers' own even TP, where the model's sizes divide the rank count.
With `Ctx.bandwidth_mbit` set, every launch runs its ranks in the network emulator (one namespace
per rank behind a link of that rate, `bench/netem.py`) and planning assumes that rate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import structlog

from xronos.node.emulator import Confinement, RankLimits

log = structlog.get_logger(__name__)
TP_STRATEGIES = {"xronos": "greedy", "xronos-optimal": "optimal", "uniform": "uniform"}
STRATEGIES = (*TP_STRATEGIES, "pp", "hf-tp")
# Bytes a rank process needs before any model tensor: Python, torch, transformers, Gloo buffers.
# Subtracted from each memory cap before planning (the cost model predicts model memory only).
RUNTIME_RESERVE = 450 << 20
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


def limits(ctx: Ctx, order: list[int]) -> list[RankLimits]:
    return [RankLimits(ctx.shares[d], ctx.caps[d]) for d in order]


def planning_bw_bps(ctx: Ctx) -> float:
    """Bytes/s the planners assume per link: the emulated rate, or the paper's LAN on loopback."""
    return ctx.bandwidth_mbit * 1e6 / 8 if ctx.bandwidth_mbit else NOMINAL_BW_BPS


@contextlib.contextmanager
def network(ctx: Ctx, n: int) -> Iterator[object | None]:
    """The ranks' placement for one launch: an emulated LAN of n links, or None (loopback)."""
    if not ctx.bandwidth_mbit:
        yield None
        return
    from xronos.bench.netem import Network

    with Network(n, ctx.bandwidth_mbit) as net:
        yield net


def network_record(net) -> dict:
    from xronos.bench.netem import LOOPBACK

    return net.describe() if net is not None else {"kind": "loopback", "description": LOOPBACK}


def planning_caps(ctx: Ctx) -> list[float]:
    return [1e15 if c is None else max(0.0, c - RUNTIME_RESERVE) for c in ctx.caps]


# -- profiling ------------------------------------------------------------------------------------
def profile_devices(ctx: Ctx, want_tp: bool, want_pp: bool, iters: int = 3) -> dict[str, dict]:
    """Profile each distinct device once, inside its own cgroup, all devices at the same time (their
    shares fit the machine together): {device name: {"tp": ProfileReport JSON, "pp": layer profile}}."""
    from xronos.bench.profile_device import ProfileJob

    first = {name: d for d, name in reversed(list(enumerate(ctx.device_names)))}
    jobs = {}
    for name, d in first.items():
        jobs[name] = ProfileJob(model_dir=str(ctx.model_dir), batch_size=ctx.batch_size, seq_len=ctx.seq_len,
                                micro_rows=max(1, ctx.batch_size // ctx.micro_batches), iters=iters,
                                tp_out=str(ctx.work / f"tp-{d}.json") if want_tp else None,
                                pp_out=str(ctx.work / f"pp-{d}.json") if want_pp else None)
        (ctx.work / f"profile-{d}.json").write_text(jobs[name].model_dump_json())
    log.info("bench.profile", devices=list(first))
    # CPU share only: the memory caps emulate the training budget; the profiler's own transient
    # footprint (several widths, memory instrumentation) is not scaled down like the caps are.
    with Confinement([RankLimits(ctx.shares[d]) for d in first.values()], top_weight=True) as conf:
        procs = {}
        for r, (name, d) in enumerate(first.items()):
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "xronos.bench.profile_device", str(ctx.work / f"profile-{d}.json")],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            conf.add(r, procs[name].pid)
        errs = {name: p.communicate()[1] for name, p in procs.items()}
    out: dict[str, dict] = {}
    for name, proc in procs.items():
        if proc.returncode != 0:
            how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
            raise RuntimeError(f"profiling {name} failed ({how}; signal 9 under a memory cap is the OOM "
                               f"killer):\n{errs[name].decode(errors='replace')[-2000:]}")
        job = jobs[name]
        out[name] = {k: json.loads(Path(getattr(job, f"{k}_out")).read_text())
                     for k in ("tp", "pp") if getattr(job, f"{k}_out")}
    return out


# -- TP strategies ------------------------------------------------------------------------------
def tp_plan(ctx: Ctx, profiles: dict[str, dict], strategy: str):
    """The planner's PlanResult for this strategy over the devices' Xronos profiles."""
    from xronos.gateway.costmodel import comm_time, node_cost, tp_comm_volume
    from xronos.gateway.planner import plan
    from xronos.gateway.profiles import node_profile
    from xronos.protocol.messages import ProfileReport

    nodes = []
    for d, name in enumerate(ctx.device_names):
        report = ProfileReport.model_validate(profiles[name]["tp"])
        nodes.append(dataclasses.replace(node_cost(node_profile(report)), node_id=f"r{d} {name}"))
    r0 = ProfileReport.model_validate(profiles[ctx.device_names[0]]["tp"])
    volume = tp_comm_volume(r0.arch.hidden_size, ctx.batch_size, ctx.seq_len, r0.num_blocks, "classify")
    comm = comm_time(volume, len(nodes), planning_bw_bps(ctx), NOMINAL_LATENCY_S)
    result = plan(nodes, r0.sizes.attn, TP_STRATEGIES[strategy], planning_caps(ctx), comm)
    return dataclasses.replace(result, sizes=r0.sizes)


def run_tp(ctx: Ctx, layout, tag: str) -> dict:
    from xronos.node.launch import launch_local
    from xronos.node.runconfig import RunConfig

    metrics = ctx.work / f"metrics-{tag}.json"
    cfg = RunConfig(model_dir=str(ctx.model_dir), data_path=str(ctx.data_path), task="classify",
                    layout=layout, batch_size=ctx.batch_size, seq_len=ctx.seq_len, lr=ctx.lr,
                    max_steps=ctx.iters, seed=ctx.seed, threads=1, metrics_path=str(metrics),
                    progress=False, gloo_timeout_s=600, eval_fraction=ctx.eval_fraction,
                    dropout=ctx.dropout)
    n = layout.world_size
    with Confinement(limits(ctx, list(range(n))), top_weight=True) as conf, network(ctx, n) as net:
        launch_local(cfg, n, wrap=conf.wrap, echo_rank0=False, placement=net)
        quotas, link = conf.quotas(), network_record(net)
    doc = json.loads(metrics.read_text())
    # "units" is the rank's attention units (the planning unit of the head-tied strategies).
    return {"ranks": [{"device": d, "units": layout.attn[d], "attn": layout.attn[d], "mlp": layout.mlp[d],
                       "vocab": layout.vocab[d], "iterations": r["iterations"]}
                      for d, r in zip(range(n), doc["ranks"])], "quotas": quotas,
            "network": link, "eval_before": doc.get("eval_before"), "eval_after": doc.get("eval_after")}


# -- pipeline -----------------------------------------------------------------------------------
def pp_plan(ctx: Ctx, profiles: dict[str, dict]):
    from xronos.bench.pp_plan import plan_pipeline
    from xronos.bench.pp_profile import chain

    times, weights, acts = [], None, None
    for name in ctx.device_names:
        t, weights, acts = chain(profiles[name]["pp"], ctx.micro_batches)
        times.append(t)
    hidden = profiles[ctx.device_names[0]]["pp"]["hidden"]
    rows = max(1, ctx.batch_size // ctx.micro_batches)
    msg = rows * ctx.seq_len * hidden * 4  # one fp32 activation (and its gradient) per boundary
    boundary = [2 * (NOMINAL_LATENCY_S + msg / planning_bw_bps(ctx))] * len(weights)
    return plan_pipeline(times, weights, acts, boundary, planning_caps(ctx), ctx.micro_batches)


def run_pp(ctx: Ctx, plan) -> dict:
    from xronos.bench.pp_worker import PPRankConfig
    from xronos.node.launch import spawn_ranks

    if len(plan.stages) < 2:
        raise ValueError("the pipeline plan put the whole model on one device; nothing to pipeline")
    order = [s.device for s in plan.stages]
    metrics = ctx.work / "metrics-pp.json"
    cfg = PPRankConfig(model_dir=str(ctx.model_dir), data_path=str(ctx.data_path), batch_size=ctx.batch_size,
                       seq_len=ctx.seq_len, lr=ctx.lr, max_steps=ctx.iters, seed=ctx.seed,
                       micro_batches=ctx.micro_batches, spans=[(s.start, s.stop) for s in plan.stages],
                       metrics_path=str(metrics), gloo_timeout_s=600, eval_fraction=ctx.eval_fraction,
                       dropout=ctx.dropout)
    with Confinement(limits(ctx, order), top_weight=True) as conf, network(ctx, len(order)) as net:
        spawn_ranks("xronos.bench.pp_worker", [cfg] * len(order), conf.wrap, placement=net)
        quotas, link = conf.quotas(), network_record(net)
    doc = json.loads(metrics.read_text())
    return {"ranks": [{"device": d, "span": r["span"], "iterations": r["iterations"]}
                      for d, r in zip(order, doc["ranks"])], "quotas": quotas, "network": link,
            "idle_devices": [d for d in range(len(ctx.shares)) if d not in order]}


# -- transformers' TP ---------------------------------------------------------------------------
def run_hftp(ctx: Ctx) -> dict:
    from xronos.bench.hftp_worker import HFTPRankConfig
    from xronos.node.launch import spawn_ranks

    n = len(ctx.shares)
    metrics = ctx.work / "metrics-hftp.json"
    cfg = HFTPRankConfig(model_dir=str(ctx.model_dir), data_path=str(ctx.data_path), batch_size=ctx.batch_size,
                         seq_len=ctx.seq_len, lr=ctx.lr, max_steps=ctx.iters, seed=ctx.seed, world_size=n,
                         metrics_path=str(metrics))
    with Confinement(limits(ctx, list(range(n))), top_weight=True) as conf, network(ctx, n) as net:
        spawn_ranks("xronos.bench.hftp_worker", [cfg] * n, conf.wrap, placement=net)
        quotas, link = conf.quotas(), network_record(net)
    doc = json.loads(metrics.read_text())
    return {"ranks": [{"device": d, "iterations": r["iterations"]} for d, r in enumerate(doc["ranks"])],
            "quotas": quotas, "network": link}
