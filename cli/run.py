"""`xronos run`: tensor-parallel fine-tuning on N local ranks (one process each, Gloo on loopback).

The handler is three steps — choose the units per rank, refuse bad input, launch. The units come
from `--units`, or, with `--strategy`, from profiling every rank and planning (`xronos.cli.strategy`),
in which case predicted and measured compute time per rank are reported after training.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

from xronos.cli import flagtable
from xronos.cli.flagtable import add_flags
from xronos.cli.usemodel import using_lines

# The planner's settings and their defaults: a run without --strategy is not planned, so one of
# them set there would be silently ignored.
PLANNER_FLAGS = {"reserve_mb": 512.0, "profile_cache": None, "bandwidth_mbps": 1000.0, "latency_ms": 0.5}


def register(subparsers: argparse._SubParsersAction) -> None:
    from xronos.node.runconfig import RunConfig

    p = subparsers.add_parser(
        "run",
        help="fine-tune a model with heterogeneous tensor parallelism on local ranks",
        description="Fine-tune a Hugging Face checkpoint on N local ranks (one process each, Gloo "
        "on 127.0.0.1), rank r holding its range of each segment kind (attention units, MLP "
        "columns, vocabulary rows); export a standard Hugging Face directory.",
    )
    add_flags(p, RunConfig, flagtable.RUN)  # the recipe's and the placement's, typed by their fields
    p.add_argument("--nodes", required=True, type=int, metavar="N", help="number of ranks")
    p.add_argument("--layout", metavar="attn=a1,..;mlp=m1,..;vocab=v1,..",
                   help="a hand-chosen per-segment layout: attention units, MLP columns and vocabulary "
                   "rows per rank (each kind sums to the model's size; MLP and vocabulary cuts fall on "
                   "multiples of 32)")
    p.add_argument("--units", metavar="u1,...,uN",
                   help="the paper's head-tied unit instead: attention units per rank (sum = the "
                   "model's heads, KV heads under GQA), MLP columns and vocabulary rows following them")
    p.add_argument("--strategy", choices=["segment", "paper", "uniform"],
                   help="instead of --layout/--units: profile every rank where it will run, plan with "
                   "this strategy (segment: each kind balanced on its own, exact; paper: the paper's "
                   "head-tied greedy; uniform: Megatron's even split), and report predicted vs "
                   "measured compute time per rank")
    p.add_argument("--reshard-at", action="append", default=[], metavar="STEP:attn=..;mlp=..;vocab=..",
                   help="re-shard live at the boundary before step STEP to this layout (the --layout form, "
                   "same number of ranks): weights and AdamW state move between the running ranks, no "
                   "restart; with --shares, STEP:shares=R1,..,RG re-splits the batch instead (rows per "
                   "data-parallel group from STEP on, summing to --batch-size; the layout stays, nothing "
                   "moves); repeatable, steps increasing. For testing the move; its time is in --metrics")
    p.add_argument("--overlap", default="off", metavar="{off,bwd,cN}",
                   help="hide the tensor-parallel all-reduces behind compute: bwd (each input-gradient "
                   "all-reduce beside its weight-gradient GEMMs), cN (the batch rows in N chunks, each "
                   "chunk's all-reduces travelling while the next chunk computes, forward and backward; "
                   "N <= --batch-size) "
                   "or off (default). The sums stay the same ones")
    p.add_argument("--overlap-trial", metavar="M1,M2[,..]",
                   help="measure these overlap modes (off, bwd, cN; 2 to 4) against each other at the start "
                   "and keep the fastest: after 2 steps of warm-up under M1 (which --overlap, if given, "
                   "must be), each runs 4 steps, in turn, the first not measured; the slowest rank's median "
                   "iteration decides (a later mode must be 1 %% faster). A job with overlap auto or on does "
                   "this itself")
    p.add_argument("--cpu-shares", metavar="s1,...,sN",
                   help="confine rank r (its profile and its training) to s_r cores with a cgroup CPU "
                   "quota, to emulate heterogeneous boxes on one machine (needs a writable cgroup)")
    p.add_argument("--reserve-mb", type=float, default=PLANNER_FLAGS["reserve_mb"], metavar="M",
                   help="with --strategy: memory each rank keeps free for its day job (default 512)")
    p.add_argument("--profile-cache", metavar="DIR", help="with --strategy: reuse/store rank profiles here")
    p.add_argument("--bandwidth-mbps", type=float, default=PLANNER_FLAGS["bandwidth_mbps"], metavar="MBIT",
                   help="with --strategy: the link the planner assumes (default 1000; the local ranks "
                   "talk over loopback, so a large value leaves each rank's measured CPU cost of an "
                   "all-reduce as the communication term)")
    p.add_argument("--latency-ms", type=float, default=PLANNER_FLAGS["latency_ms"], metavar="MS",
                   help="with --strategy: per-all-reduce link latency the planner assumes (default 0.5)")
    p.set_defaults(func=handle)


def parse_units(text: str) -> list[int]:
    try:
        return [int(u) for u in text.split(",")]
    except ValueError:
        raise ValueError(f"--units must be comma-separated integers, got {text!r}") from None


def group_size(args: argparse.Namespace) -> int:
    """Ranks per tensor-parallel group: --nodes, or with --shares --nodes over the groups. Checked
    here, before any process starts: the shares must be integers >= 0 summing to --batch-size, one
    per group, the groups dividing --nodes."""
    if args.shares is None:
        return args.nodes
    try:
        shares = [int(s) for s in args.shares]
    except ValueError:
        raise ValueError(f"--shares must be comma-separated integers (rows per group), got {','.join(args.shares)!r}") \
            from None
    if any(s < 0 for s in shares):
        raise ValueError(f"--shares: rows per data-parallel group must be >= 0, got {shares}")
    if args.batch_size is not None and sum(shares) != args.batch_size:
        raise ValueError(f"--shares {','.join(map(str, shares))}: sum to {sum(shares)} rows, but --batch-size is "
                         f"{args.batch_size}")
    if args.nodes % len(shares):
        raise ValueError(f"--shares: {len(shares)} data-parallel groups cannot split --nodes {args.nodes} into equal "
                         "tensor-parallel groups")
    if args.strategy is not None:
        raise ValueError("give either --shares (a hand-chosen data-parallel mesh) or --strategy, not both")
    return args.nodes // len(shares)


def resolve_layout(args: argparse.Namespace):
    """The layout from --layout or --units (with --strategy it is planned instead): of every rank,
    or with --shares of each data-parallel group's ranks (default there: the whole model on each)."""
    from xronos.node.rank.validate import check_units, model_sizes
    from xronos.protocol.layout import Layout

    if args.layout is not None and args.units is not None:
        raise ValueError("give either --layout or --units, not both")
    tp = group_size(args)
    per = "" if args.shares is None else f" / {len(args.shares)} groups of --shares"
    if args.layout is not None:
        layout = Layout.parse(args.layout)
        if layout.world_size != tp:
            raise ValueError(f"--layout has {layout.world_size} counts per kind (one per rank), but --nodes{per} is "
                             f"{tp}: {layout.describe()}")
        return layout
    if args.units is None:
        if args.shares is not None and tp == 1:  # pure data parallelism: a whole replica per rank
            return Layout.single(model_sizes(str(Path(args.model).resolve())))
        raise ValueError("one of --layout, --units or --strategy is required" + (" (a tensor-parallel group of "
                         f"{tp} ranks per share)" if args.shares is not None else ""))
    units = parse_units(args.units)
    if len(units) != tp and args.shares is not None:
        raise ValueError(f"--units has {len(units)} entries {units}, but --nodes{per} is {tp} (one per rank of a "
                         "tensor-parallel group)")
    sizes = model_sizes(str(Path(args.model).resolve()))
    check_units(units, tp, sizes.attn)
    return Layout.tied(units, sizes)


def parse_reshard_at(texts: list[str]) -> list[dict]:
    """`--reshard-at STEP:LAYOUT` (or `STEP:shares=R1,..,RG`) values as RunConfig.reshard_at entries."""
    from xronos.protocol.layout import Layout

    out = []
    for text in texts:
        step, sep, layout = text.partition(":")
        try:
            if not sep:
                raise ValueError
            if not step.strip().isascii() or not step.strip().isdigit():
                raise ValueError
            n = int(step)
        except ValueError:
            raise ValueError(f"--reshard-at: expected STEP:attn=..;mlp=..;vocab=.. with STEP a step number "
                             f"(0, 1, ...), got {text!r}") from None
        if layout.strip().startswith("shares="):
            rows = layout.strip().removeprefix("shares=")
            parts = rows.split(",")
            if not all(x.strip().isascii() and x.strip().isdigit() for x in parts):  # as --layout's counts
                raise ValueError(f"--reshard-at {n}: shares must be comma-separated integers >= 0 (rows per "
                                 f"data-parallel group), got {rows!r}")
            out.append({"step": n, "shares": tuple(int(x) for x in parts)})
            continue
        try:
            out.append({"step": n, "layout": Layout.parse(layout)})
        except ValueError as exc:
            raise ValueError(f"--reshard-at {n}: {str(exc).removeprefix('--layout: ')}") from None
    return out


def parse_overlap(text: str):
    """`--overlap off|bwd|cN` as RunConfig.overlap (None: off); ValueError naming the value otherwise."""
    from xronos.gateway.plan.overlapcost import mode_of
    from xronos.protocol.messages import MAX_CHUNKS, Overlap

    try:
        mode = mode_of(text)
    except ValueError:
        mode = None
    if mode is None or mode.chunks > MAX_CHUNKS:
        raise ValueError(f"--overlap {text!r}: off, bwd or cN with N chunks, 2 <= N <= {MAX_CHUNKS}")
    return Overlap(backward=mode.backward, chunks=mode.chunks) if mode.on else None


def parse_trial(text: str | None, overlap):
    """`--overlap-trial M1,M2,..` as RunConfig.trial (None without the flag), and the run's overlap
    (M1's unless --overlap named one); ValueError naming the value otherwise."""
    from pydantic import ValidationError

    from xronos.protocol.messages import Overlap, OverlapTrial, overlap_label

    if text is None:
        return None, overlap
    try:
        modes = [parse_overlap(x.strip()) or Overlap(backward=False, chunks=1) for x in text.split(",")]
    except ValueError as exc:
        raise ValueError(f"--overlap-trial {text!r}: {str(exc).removeprefix('--overlap ')}") from None
    try:
        trial = OverlapTrial(modes=modes)
    except ValidationError as exc:
        why = exc.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")
        raise ValueError(f"--overlap-trial {text!r}: 2 to 4 distinct modes ({why})") from None
    first = None if overlap_label(modes[0]) == "off" else modes[0]
    if overlap is not None and overlap_label(overlap) != overlap_label(first):
        raise ValueError(f"--overlap-trial {text!r}: its first mode runs the warm-up, and --overlap says "
                         f"{overlap_label(overlap)}: name it first")
    return trial, first


def config_from_args(args: argparse.Namespace, layout):
    """The RunConfig the flags describe (`flagtable.RUN`); ValueError naming the flags otherwise."""
    from pydantic import ValidationError

    from xronos.node.runconfig import RunConfig

    export = Path(args.export).resolve()
    from xronos.common.paths import overlaps

    for flag, what in (("--model", "the input model directory"), ("--data", "the data")):
        src = Path(getattr(args, flag[2:])).resolve()
        # as a job's (jobcheck.confined_spec): an export replaces, and removes an earlier
        # export's files (exportfiles.py), so it may neither be, contain nor lie inside what it reads
        if overlaps(export, src):
            raise ValueError(f"--export {args.export} would overwrite {what} ({flag} {getattr(args, flag[2:])}): "
                             "export somewhere else")
    if export.exists() and not export.is_dir():
        raise ValueError(f"--export {args.export}: exists and is not a directory")
    from xronos.node.models.stage import writable_problem

    if (why := writable_problem(export)) is not None:  # tried for real: root passes os.access on a read-only mount
        raise ValueError(f"--export {args.export}: {why}")
    if args.metrics is not None and not Path(args.metrics).resolve().parent.is_dir():
        raise FileNotFoundError(f"--metrics {args.metrics}: directory does not exist")
    fields = flagtable.collect(args, flagtable.RUN)
    trial, overlap = parse_trial(getattr(args, "overlap_trial", None), parse_overlap(getattr(args, "overlap", "off")))
    try:
        cfg = RunConfig(**fields, layout=layout, progress=True, reshard_at=parse_reshard_at(args.reshard_at),
                        overlap=overlap, trial=trial)
    except ValidationError as exc:
        msg = flagtable.problems(exc.errors(), args, flagtable.RUN, _RULE_NAMES)
        raise ValueError(re.sub(r"ranks, the run (\d+)", r"ranks, but --nodes is \1", msg)) from None
    r = cfg.recipe
    if r.max_steps is not None and r.warmup_steps > r.max_steps:  # a job's is checked by its owner (jobcheck)
        raise ValueError(f"--warmup-steps {r.warmup_steps} is longer than the run (--max-steps {r.max_steps}): "
                         "the learning rate would never reach --lr")
    return cfg


# The names in the recipe's and the config's rules across fields, as the flags name them.
_RULE_NAMES = (("epochs/max_steps", "--max-steps"), ("data_format:", "--data-format:"),
               ("export_gguf:", "--export-gguf:"), ("export_merged:", "--export-merged:"),
               ("without lora (LoRA)", "without --lora-r (LoRA)"), ("for task ", "for --task "),
               ("of task ", "of --task "), ("reshard_at", "--reshard-at"), ("or rebalance (", "or --rebalance ("),
               ("shares:", "--shares:"), ("overlap:", "--overlap:"), ("trial:", "--overlap-trial:"))


def handle(args: argparse.Namespace) -> int:
    from xronos.cli.strategy import confinement, plan_run
    from xronos.node.rank.validate import preflight

    if args.nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {args.nodes}")
    group_size(args)  # --shares checked before anything is profiled or started
    if args.strategy is None:
        ignored = ["--" + k.replace("_", "-") for k, default in PLANNER_FLAGS.items() if getattr(args, k) != default]
        if ignored:
            raise ValueError(f"{', '.join(ignored)}: only with --strategy (the planner's settings; a run with "
                             "--layout or --units is not planned)")
    with confinement(args.cpu_shares, args.nodes) as wrap:
        if args.strategy is None:
            return _launch(args, resolve_layout(args), wrap)
        if args.units is not None or args.layout is not None:
            raise ValueError("give either --layout/--units or --strategy, not both")
        # Refuse bad input before spending minutes on profiles: check with a placeholder split.
        check_planner_flags(args)
        placeholder = config_from_args(args, uniform_layout(args))
        preflight(placeholder, args.nodes)
        planned = plan_run(args, placeholder.recipe, placeholder.threads, wrap)
        return _launch(args, planned[0].layout, wrap, planned)


def check_planner_flags(args: argparse.Namespace) -> None:
    """The planner's own flags, which it checks only once every rank is profiled."""
    for flag, value, low in (("--reserve-mb", args.reserve_mb, 0.0), ("--latency-ms", args.latency_ms, 0.0),
                             ("--bandwidth-mbps", args.bandwidth_mbps, None)):
        if not (math.isfinite(value) and (value > 0 if low is None else value >= low)):
            raise ValueError(f"{flag} must be finite and {'> 0' if low is None else '>= 0'}, got {value}")


def uniform_layout(args: argparse.Namespace):
    from xronos.node.rank.validate import model_sizes
    from xronos.protocol.layout import Layout

    sizes = model_sizes(str(Path(args.model).resolve()))
    H, n = sizes.attn, args.nodes
    return Layout.tied([H // n + (1 if r < H % n else 0) for r in range(n)], sizes)


def _launch(args: argparse.Namespace, layout, wrap, planned=None) -> int:
    import tempfile

    from xronos.cli.strategy import report_run
    from xronos.node.rank.local import RankFailed, launch_local
    from xronos.node.rank.validate import preflight

    cfg = config_from_args(args, layout)
    pre = preflight(cfg, layout.world_size)  # with --shares: each group's layout
    mesh = f"; {len(cfg.shares)} data-parallel groups, rows {list(cfg.shares)}" if cfg.shares else ""
    print(
        f"xronos run: {pre.family} model ({pre.sizes.describe()}) on {args.nodes} rank{'s' * (args.nodes != 1)}, "
        f"layout {layout.describe()}{mesh}; {pre.train_rows} training rows"
        + (f", {pre.eval_rows} eval rows" if pre.eval_rows else "")
        + (f"; {pre.num_labels} labels" + (f" {list(pre.labels.names)[:8]}" if pre.labels.by_name else "")
           if pre.labels is not None else ""),
        file=sys.stderr, flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="xronos-run-metrics-") as tmp:
        if planned is not None and cfg.metrics_path is None:  # the prediction check needs metrics
            cfg = cfg.model_copy(update={"metrics_path": str(Path(tmp) / "metrics.json")})
        try:
            launch_local(cfg, args.nodes, wrap=wrap,
                         module="xronos.cli.liverank" if cfg.rebalance else "xronos.node.rank.localrank")
        except RankFailed as exc:
            print(f"xronos run: error: {exc}", file=sys.stderr)
            return 1
        if planned is not None:
            report_run(*planned, cfg.metrics_path, keep=args.metrics is not None)
    print(f"xronos run: exported to {cfg.recipe.export_dir}", file=sys.stderr)
    r = cfg.recipe
    labels = list(pre.labels.names) if pre.labels is not None else None
    for line in using_lines(r.export_dir, r.task, lora=r.lora is not None, gguf=r.export_gguf, merged=r.export_merged,
                            labels=labels):
        print(f"xronos run: {line}", file=sys.stderr)
    return 0
