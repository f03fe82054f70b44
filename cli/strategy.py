"""`xronos run --strategy`: profile every local rank where it will run, plan, then judge the plan.

Each rank's profile is taken in its own process (`xronos profile`), with the rank's thread count
and — under `--cpu-shares` — inside the rank's CPU cgroup (the same `wrap` hook the training
launch uses), one rank after the other so that profiles do not contend with each other. The
gateway's planner turns the reports into a per-kind layout (attention units, MLP columns,
vocabulary rows per rank). After training, each rank's predicted compute time per iteration (its
own, summed over segments, at its shares of the layout) is set against the mean measured compute
time (the trainer's `compute_s`, steady-state iterations), with the mean absolute percentage error
(MAPE) of the affine-in-share cost model and of the paper's linear model side by side.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from xronos.cli import flagtable
from xronos.gateway.plan.commmodel import comm_per_node, tp_comm_volume
from xronos.gateway.plan.costmodel import layout_shares, node_cost, predict_time
from xronos.gateway.plan.planner import PlanResult
from xronos.gateway.plan.compatible import Loaded
from xronos.gateway.plan.profiles import collective_cost, falling_times, load_report, node_profile, plan_reports
from xronos.protocol.layout import KINDS, NOUN, Layout
from xronos.protocol.messages import ProfileKey, ProfileReport, ProfileSettings, Recipe

Wrap = Callable[[int, subprocess.Popen], None]


def profile_ranks(model_dir: str, key: ProfileKey, threads: int, n: int, *, wrap: Wrap | None = None,
                  iters: int = 10, cache_dir: str | None = None) -> list[ProfileReport]:
    """One ProfileReport per rank (node id `rank{r}`), each measured in its own process under the
    run's profile key (under LoRA the run's adapters on a frozen base: its own profile)."""
    from xronos.node.rank.spawn import ChildProcess, rank_env

    env = rank_env(threads)
    reports = []
    with tempfile.TemporaryDirectory(prefix="xronos-profile-") as tmp:
        for rank in range(n):
            out = Path(tmp) / f"rank{rank}.json"
            args = ["profile", "--model", model_dir, *flagtable.argv(flagtable.PROFILE, key), "--threads", str(threads),
                    "--iters", str(iters), "--node-id", f"rank{rank}", "--out", str(out)]
            args += ["--cache-dir", cache_dir] if cache_dir else []
            print(f"xronos run: profiling rank {rank} ...", file=sys.stderr, flush=True)
            # The node's one launcher: its own process group, dying with us; no box of its own
            # (a local run's ranks have none either), `wrap` confines it as it will its rank.
            child = ChildProcess("xronos.cli", *args, env=env, name=f"profile-rank{rank}")
            try:
                if wrap is not None:
                    wrap(rank, child.proc)
                code = child.wait()
                tail = child.tail(10)
            finally:
                child.close()
            if code != 0:
                raise RuntimeError(f"profiling rank {rank} failed (exit {code}):\n{tail}")
            reports.append(load_report(out))
    return reports


def plan_units(reports: list[ProfileReport], strategy: str, reserve_mb: float, *,
               batch_size: int | None = None, seq_len: int | None = None,
               bandwidth_mbps: float = 1000.0, latency_ms: float = 0.5, export_merged: bool = False,
               settings: ProfileSettings | None = None) -> PlanResult:
    """The planner's result over the ranks' reports (ranks in order); `export_merged`: a LoRA run
    that also exports the merged model (the owner gathers the whole model); `settings`: the run's,
    a report taken under others (a cached one, say) is refused."""
    if not (bandwidth_mbps > 0 and math.isfinite(bandwidth_mbps)):
        raise ValueError(f"--bandwidth-mbps must be finite and > 0, got {bandwidth_mbps}")
    if not (latency_ms >= 0 and math.isfinite(latency_ms)):
        raise ValueError(f"--latency-ms must be finite and >= 0, got {latency_ms}")
    return plan_reports([Loaded(f"profile of {r.node_id}", r) for r in reports], strategy,  # type: ignore[arg-type]
                        reserve_mb=reserve_mb, batch_size=batch_size, seq_len=seq_len, settings=settings,
                        bandwidth_Bps=bandwidth_mbps * 1e6 / 8, latency_s=latency_ms / 1e3,
                        export_merged=export_merged)


def predictions(reports: list[ProfileReport], layout: Layout) -> dict[str, list[float]]:
    """Predicted compute seconds per rank at its shares of `layout`, by each time model."""
    return {fit: [predict_time(node_cost(node_profile(r), fit), layout_shares(layout, rank))
                  for rank, r in enumerate(reports)]
            for fit in ("affine", "linear")}


def mape(predicted: list[float], measured: list[float]) -> float:
    return 100.0 * sum(abs(p - m) / m for p, m in zip(predicted, measured)) / len(measured)


def comm_cpu(reports: list[ProfileReport]) -> list[float | None]:
    """Each rank's own CPU seconds per iteration in the all-reduces, from its profile's probe."""
    r0 = reports[0]
    volume = tp_comm_volume(r0.arch.hidden_size, r0.batch_size, r0.seq_len, r0.num_blocks, r0.task)
    return comm_per_node(volume, len(reports), [collective_cost(r) for r in reports])


def _mape_or_none(predicted: list[float], measured: list[float]) -> float | None:
    pairs = [(p, m) for p, m in zip(predicted, measured) if m > 0]
    return mape([p for p, _ in pairs], [m for _, m in pairs]) if pairs else None


def judge(result: PlanResult, reports: list[ProfileReport], measured: list[float],
          measured_comm: list[float] | None = None) -> dict[str, Any]:
    """Predicted vs measured per rank and the MAPE of each quantity: compute (both time models) and
    communication (the plan's all-reduce time, the same for every rank since a collective ends for
    all at once, vs the rank's measured `comm_s`). `quantities` holds one entry per quantity (room
    for more, e.g. peak memory): its per-rank predicted/measured field names and its MAPE."""
    layout = result.layout
    pred = predictions(reports, layout)
    cpu = comm_cpu(reports)
    comm = measured_comm if measured_comm is not None else [float("nan")] * len(measured)
    ranks = [dict(rank=r, attn=layout.attn[r], mlp=layout.mlp[r], vocab=layout.vocab[r], units=layout.attn[r],
                  predicted_compute_s=pa, predicted_linear_s=pl, measured_compute_s=m,
                  error_pct=100.0 * (pa - m) / m,
                  predicted_comm_s=result.comm_s, measured_comm_s=mc, comm_cpu_s=cpu[r],
                  comm_error_pct=100.0 * (result.comm_s - mc) / mc if mc > 0 else None)
             for r, (pa, pl, m, mc) in enumerate(zip(pred["affine"], pred["linear"], measured, comm))]
    comm_mape = (_mape_or_none([result.comm_s] * len(comm), comm) if measured_comm is not None else None)
    quantities = {
        "compute": dict(predicted="predicted_compute_s", measured="measured_compute_s",
                        mape_pct=mape(pred["affine"], measured), mape_linear_pct=mape(pred["linear"], measured)),
        "comm": dict(predicted="predicted_comm_s", measured="measured_comm_s", mape_pct=comm_mape),
    }
    return dict(strategy=result.strategy, layout=layout.model_dump(mode="json"), units=list(layout.attn),
                predicted_iteration_s=result.predicted_iteration_s, bottleneck_s=result.bottleneck_s,
                segment_s=dict(result.segment_s), comm_s=result.comm_s, ranks=ranks,
                mape_pct=mape(pred["affine"], measured), mape_linear_pct=mape(pred["linear"], measured),
                comm_mape_pct=comm_mape, quantities=quantities,
                profile_seconds=[r.profile_seconds for r in reports])


def _pct(v: float | None) -> str:
    return "–" if v is None or v != v else f"{v:+.1f}%"


def format_judgement(j: dict[str, Any]) -> str:
    lines = [f"{'rank':>4} {'attn':>5} {'mlp':>6} {'vocab':>6} {'compute pred s':>14} {'meas s':>8} {'error':>7} "
             f"{'comm pred s':>11} {'meas s':>8} {'error':>7} {'own comm CPU s':>14}"]
    for r in j["ranks"]:
        mc = r.get("measured_comm_s", float("nan"))
        cpu = r.get("comm_cpu_s")
        lines.append(f"{r['rank']:>4} {r['attn']:>5} {r['mlp']:>6} {r['vocab']:>6} {r['predicted_compute_s']:>14.4f} "
                     f"{r['measured_compute_s']:>8.4f} {r['error_pct']:>+6.1f}% "
                     f"{r.get('predicted_comm_s', j['comm_s']):>11.4f} {mc:>8.4f} {_pct(r.get('comm_error_pct')):>7} "
                     f"{'–' if cpu is None else f'{cpu:.4f}':>14}")
    lines.append(f"compute-time prediction MAPE {j['mape_pct']:.2f}% (affine in the share); "
                 f"{j['mape_linear_pct']:.2f}% with the paper's linear model")
    if j.get("comm_mape_pct") is not None:
        lines.append(f"communication-time prediction MAPE {j['comm_mape_pct']:.2f}%")
    return "\n".join(lines)


def parse_shares(text: str, n: int) -> list[float]:
    try:
        shares = [float(s) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"--cpu-shares must be comma-separated numbers of cores, got {text!r}") from None
    if len(shares) != n:
        raise ValueError(f"--cpu-shares has {len(shares)} entries for --nodes {n}")
    return shares


@contextmanager
def confinement(shares: str | None, n: int) -> Iterator[Wrap | None]:
    """The launcher's wrap hook putting rank r into a cgroup with a CPU quota of shares[r] cores
    (the bench's heterogeneity emulator), or None without --cpu-shares."""
    if shares is None:
        yield None
        return
    from xronos.node.emulate.confinement import Confinement, RankLimits

    # Top CPU weight: a quota is only a ceiling, and on a busy machine a rank at the default
    # weight gets its neighbours' leftovers instead, so every emulated device would be equally slow.
    with Confinement([RankLimits(s) for s in parse_shares(shares, n)], top_weight=True) as conf:
        yield conf.wrap


def plan_run(args: Any, recipe: Recipe, threads: int, wrap: Wrap | None) -> tuple[PlanResult, list[ProfileReport]]:
    """Profile each rank of an `xronos run` of `recipe` (`threads` intra-op threads per rank)
    where it will run, then plan with args.strategy (and the planner's flags)."""
    key = recipe.profile_key()
    reports = profile_ranks(recipe.model_dir, key, threads, args.nodes, wrap=wrap,
                            cache_dir=args.profile_cache)
    for text in (t for r in reports for t in falling_times(r)):
        print(f"xronos run: warning: {text}", file=sys.stderr, flush=True)
    result = plan_units(reports, args.strategy, args.reserve_mb, batch_size=recipe.batch_size,
                        seq_len=recipe.seq_len, bandwidth_mbps=getattr(args, "bandwidth_mbps", 1000.0),
                        latency_ms=getattr(args, "latency_ms", 0.5), export_merged=recipe.exports_whole_model,
                        settings=ProfileSettings.of_key(key))
    if not result.feasible:  # uniform ignores memory (and a run would OOM the box): refuse before launching
        over = "; ".join(f"{r.node_id} needs {r.predicted_memory / 2**20:.0f} MiB of its {r.memory_cap / 2**20:.0f} "
                         f"MiB cap holding " + ", ".join(f"{r.count(k)} {NOUN[k]}" for k in KINDS)
                         for r in result.rows if r.over_cap)
        raise ValueError(f"the {result.strategy} plan exceeds memory caps: {over}")
    print(f"xronos run: {args.strategy} plan {result.layout.describe()}, predicted iteration "
          f"{result.predicted_iteration_s:.4f} s (compute {result.bottleneck_s:.4f} s + comm "
          f"{result.comm_s:.4f} s)", file=sys.stderr, flush=True)
    return result, reports


def report_run(result: PlanResult, reports: list[ProfileReport], metrics_path: str, keep: bool) -> dict[str, Any]:
    """Print predicted vs measured compute per rank; with `keep`, add it to the metrics JSON."""
    path = Path(metrics_path)
    doc = json.loads(path.read_text())
    measured = [r["summary"]["compute_s"] for r in doc["ranks"]]
    comm = [r["summary"]["comm_s"] for r in doc["ranks"]]
    verdict = judge(result, reports, measured, comm)
    print(format_judgement(verdict), flush=True)
    from xronos.cli.memreport import format_memory, judge_memory

    memory = judge_memory(list(result.rows), doc)
    if memory is not None:
        print(format_memory(memory), flush=True)
    if keep:
        doc["prediction"] = verdict
        doc["prediction_memory"] = memory
        path.write_text(json.dumps(doc, indent=1))
    return verdict
