"""`xronos plan PROFILE.json ...`: predicted split of a job over nodes from their profile reports.

Gateway-side and torch-free: it reads the profiler's JSON reports (refusing a set taken under
different job settings: a LoRA and a full fine-tune's, other weight decay or clipping), runs the
cost model and the planner, and prints per node its count and share of every segment kind
(attention units, MLP columns, vocabulary rows), predicted compute, memory vs cap and idle time;
then the slowest node's time per segment, the predicted iteration, the ideal and the proven lower
bound. With `--strategy auto` (the default) it predicts every candidate (TP `segment`, data
parallelism `dp`, DP×TP meshes), prints the winner's plan as above (DP and meshes: each node's
rows, compute and memory), then the candidates side by side and why the winner won.
"""

from __future__ import annotations

import argparse
import math
import sys

from xronos.cli.profile import id_arg, positive_int
from xronos.gateway.plan.commmodel import DEFAULT_BANDWIDTH_BPS, DEFAULT_LATENCY_S
from xronos.gateway.plan.costmodel import FITS, SEGMENTS
from xronos.gateway.plan.auto import TRIAL_MIN_RUN, candidates_table, choice_message, choose_reports
from xronos.gateway.plan.choose import CHOICES, Choice, trial_modes
from xronos.gateway.plan.planner import MiB, PlanResult
from xronos.gateway.plan.compatible import Loaded
from xronos.gateway.plan.profiles import DEFAULT_RESERVE_MB, falling_times, load_report
from xronos.protocol.layout import KINDS, NOUN
from xronos.protocol.messages import Overlap, OverlapTrial


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan", help="plan each node's share of every segment kind from profile reports",
        description="Predict the best split of a model over nodes — attention units, MLP columns and "
                    "vocabulary rows, each kind on its own — from their profile reports (xronos "
                    "profile --out FILE.json). Ranks follow the file order.",
    )
    p.add_argument("profiles", nargs="+", metavar="PROFILE.json", help="one report per node")
    p.add_argument("--strategy", choices=CHOICES, default="auto",
                   help="auto (default: the fastest that fits of segment, dp and DP x TP meshes, shown side by "
                        "side), segment (tensor parallelism, every kind balanced on its own, exact), dp (speed-"
                        "weighted data parallelism: a replica per node), paper (the paper's head-tied greedy) or "
                        "uniform (Megatron-LM's even split)")
    p.add_argument("--batch-size", type=positive_int, metavar="B",
                   help="the job's batch size: refuse profiles taken at another")
    p.add_argument("--seq-len", type=positive_int, metavar="S",
                   help="the job's sequence length: refuse profiles taken at another")
    p.add_argument("--reserve-mb", type=float, default=DEFAULT_RESERVE_MB,
                   help=f"MiB of available memory left to the node's day job (default {DEFAULT_RESERVE_MB})")
    p.add_argument("--bandwidth-mbps", type=float, default=DEFAULT_BANDWIDTH_BPS * 8 / 1e6,
                   help="slowest link in Mbit/s for the all-reduce term (default 1000)")
    p.add_argument("--latency-ms", type=float, default=DEFAULT_LATENCY_S * 1e3,
                   help=f"per all-reduce latency in ms (default {DEFAULT_LATENCY_S * 1e3:g})")
    p.add_argument("--fit", choices=FITS, default="affine",
                   help="time of partitioned layers: affine in width (default) or linear (paper)")
    p.add_argument("--export-merged", action="store_true",
                   help="LoRA profiles: the run also exports the merged model, so the owner gathers the "
                        "whole model (default: the adapters only)")
    p.add_argument("--overlap", choices=("off", "auto", "on"), default="off",
                   help="tensor-parallel plans: hide the all-reduces behind compute (issue 37): auto (the fastest "
                        "predicted mode, none among them), on (the fastest overlapping one) or off (default)")
    p.add_argument("--chunks", type=positive_int, default=None, metavar="N",
                   help="with --overlap on: N chunks (default: the planner's pick)")
    p.add_argument("--job-id", default=None, type=id_arg, help="job id written into --json output (default preview)")
    p.add_argument("--json", action="store_true", help="print the protocol Plan message as JSON")
    p.set_defaults(func=run)


def _positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"--{name} must be a finite number > 0, got {value}")


def run(args: argparse.Namespace) -> int:
    if args.job_id is not None and not args.json:
        raise ValueError("--job-id names the job in the --json output; without --json it would be ignored")
    _positive("bandwidth-mbps", args.bandwidth_mbps)
    if not (args.latency_ms >= 0 and math.isfinite(args.latency_ms)):
        raise ValueError(f"--latency-ms must be a finite number >= 0, got {args.latency_ms}")
    if not (args.reserve_mb >= 0 and math.isfinite(args.reserve_mb)):
        raise ValueError(f"--reserve-mb must be a finite number >= 0, got {args.reserve_mb}")
    if args.chunks is not None and args.overlap != "on":
        raise ValueError(f"--chunks {args.chunks} needs --overlap on (got --overlap {args.overlap})")
    loaded = [Loaded(str(path), load_report(path)) for path in args.profiles]
    for item in loaded:
        for text in falling_times(item.report):
            print(f"xronos plan: warning: {item.source}: {text}", file=sys.stderr)
        s = item.report.settings  # a merged export is LoRA's; a full fine-tune's profile would plan another job
        if args.export_merged and s is not None and s.lora is None:
            raise ValueError(f"{item.source}: field settings.lora: --export-merged is for LoRA profiles, but node "
                             f"{item.report.node_id} was profiled for full fine-tuning")
    choice = choose_reports(
        loaded, args.strategy, reserve_mb=args.reserve_mb,
        bandwidth_Bps=args.bandwidth_mbps * 1e6 / 8, latency_s=args.latency_ms / 1e3, fit=args.fit,
        batch_size=args.batch_size, seq_len=args.seq_len, export_merged=args.export_merged,
        overlap=args.overlap, chunks=args.chunks,
    )
    if args.json:
        print(choice_message(choice, args.job_id or "preview").model_dump_json(indent=2))
    else:
        print(render_choice(choice))
    result = choice.winner.tp
    if result is not None and not result.feasible:
        over = [r.node_id for r in result.rows if r.over_cap]
        print(f"xronos plan: warning: this plan exceeds the memory cap on {over}", file=sys.stderr)
        return 1
    return 0


def render_choice(choice: Choice) -> str:
    """The winner's plan, then (auto) the candidates side by side and why the winner won."""
    w = choice.winner
    if w.tp is not None:
        text = render(w.tp)
    else:
        text = render_dp(choice)
    if w.overlap is not None and w.tp is not None:
        o = w.overlap
        past = w.tp.ideal_iteration_s
        text += (f"\noverlap {o.mode.label}: predicted iteration {o.iteration_s:.4f} s, {o.saved_s:.4f} s less than "
                 f"with every all-reduce blocking (chunking adds {o.chunk_overhead_s:.4f} s of compute)"
                 + (f"; {o.iteration_s / past:.3f} of the ideal bound without overlap" if 0 < past < math.inf else ""))
    trial = trial_modes(w)
    if trial and w.tp is not None:
        steps = OverlapTrial(modes=[Overlap(backward=m.backward, chunks=m.chunks) for m in trial]).steps
        own = {m: q for m, q, _ in w.own_plans}  # a mode kept on a layout of its own: predicted there
        each = ", ".join(f"{q.mode.label} {own[q.mode].iteration_s:.4f} s on its own layout" if q.mode in own
                         else f"{q.mode.label} {q.iteration_s:.4f} s" for q in w.ranked if q.mode in trial)
        text += (f"\noverlap trial: a job of at least {TRIAL_MIN_RUN * steps} steps measures "
                 f"{', '.join(m.label for m in trial)} against each other in its first {steps} and keeps the "
                 f"fastest (predicted: {each})")
    if choice.asked == "auto":
        text += "\n\ncandidates (auto: the fastest that fits; a tie goes to segment):\n" + candidates_table(choice)
    return text


def render_dp(choice: Choice) -> str:
    """A data-parallel plan (or a DP x TP mesh): per node its group, rows, counts, compute and memory."""
    w, sz = choice.winner, choice.sizes
    msg = choice_message(choice, "preview")
    tp = msg.tp_size
    width = max(4, *(len(e.node_id) for e in msg.entries))
    head = (f"strategy dp over {len(msg.entries)} nodes: {len(msg.shares or ())} data-parallel groups of TP {tp}; "
            + ", ".join(f"{sz.total(k)} {NOUN[k]}" for k in KINDS))
    lines = [head, f"{'node':<{width}}  {'group':>5}  {'rows':>5}  {'attn':>6}  {'mlp':>7}  {'vocab':>7}  "
                   f"{'compute s':>10}  {'memory / cap MiB':>21}"]
    for r, e in enumerate(msg.entries):
        g = r // tp
        mem = f"{e.predicted_memory / MiB:.1f} / {e.memory_cap / MiB:.1f}"
        flag = "  OVER CAP" if e.predicted_memory > e.memory_cap else ""
        lines.append(f"{e.node_id:<{width}}  {g:>5}  {(msg.shares or [0])[g]:>5}  {e.attn:>6}  {e.mlp:>7}  "
                     f"{e.vocab:>7}  {e.predicted_compute_s:>10.4f}  {mem:>21}{flag}")
    lines.append(f"predicted iteration {w.iteration_s:.4f} s = compute {w.compute_s:.4f} (the slowest group) + "
                 f"comm {w.comm_s:.4f} (what backward does not hide of the gradient all-reduce"
                 + (", and the TP all-reduces" if tp > 1 else "") + ")")
    return "\n".join(lines)


def render(result: PlanResult) -> str:
    """Human-readable table of a plan: per node its count and share of every kind."""
    sz = result.sizes
    width = max(4, *(len(r.node_id) for r in result.rows))
    cols = {k: max(len(k) + 8, len(f"{sz.total(k)} (1.000)")) for k in KINDS}
    head = "  ".join(f"{k + ' (share)':>{cols[k]}}" for k in KINDS)
    lines = [
        f"strategy {result.strategy} over {len(result.rows)} nodes: " + ", ".join(
            f"{sz.total(k)} {NOUN[k]}" for k in KINDS),
        f"{'node':<{width}}  {head}  {'compute s':>10}  {'memory / cap MiB':>21}  {'idle s':>8}",
    ]
    for r in result.rows:
        kinds = "  ".join(f"{f'{r.count(k)} ({r.shares[k]:.3f})':>{cols[k]}}" for k in KINDS)
        mem = f"{r.predicted_memory / MiB:.1f} / {r.memory_cap / MiB:.1f}"
        flag = "  OVER CAP" if r.over_cap else ""
        lines.append(f"{r.node_id:<{width}}  {kinds}  {r.predicted_compute_s:>10.4f}  {mem:>21}  "
                     f"{r.idle_s:>8.4f}{flag}")
    lines.append("slowest node per segment: " + ", ".join(
        f"{s} {result.segment_s[s]:.4f} s" for s in SEGMENTS if s != "out" or result.segment_s[s] > 0))
    ideal = result.ideal_iteration_s
    if not math.isfinite(ideal):
        bound = "ideal lower bound: none, the model does not fit the caps even fractionally"
    elif ideal > 0:
        bound = f"ideal lower bound {ideal:.4f} s (predicted / ideal = {result.predicted_iteration_s / ideal:.3f})"
    else:
        bound = f"ideal lower bound {ideal:.4f} s"
    lines.append(f"predicted iteration {result.predicted_iteration_s:.4f} s = compute "
                 f"{result.bottleneck_s:.4f} (sum over segments) + comm {result.comm_s:.4f}; {bound}")
    if result.search is not None:
        how = "proven optimal" if result.optimal else f"within {100 * result.gap:.2f}% of it"
        caps = "caps binding, coupled search" if result.search.coupled else "no cap binding"
        lines.append(f"proven lower bound on compute {result.lower_bound_s:.4f} s: this plan is {how} "
                     f"({caps})")
    return "\n".join(lines)
