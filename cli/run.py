"""`xronos run`: tensor-parallel fine-tuning on N local ranks (one process each, Gloo on loopback).

The handler is three steps — choose the units per rank, refuse bad input, launch. The units come
from `--units`, or, with `--strategy`, from profiling every rank and planning (`xronos.cli.strategy`),
in which case predicted and measured compute time per rank are reported after training.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

from xronos.cli.usemodel import using_lines
from xronos.common.errtext import reason

# RunConfig field -> the flag a user typed (for error messages).
_FLAGS = {
    "model_dir": "--model", "data_path": "--data", "threads": "--threads-per-node",
    "metrics_path": "--metrics", "export_dir": "--export", "gloo_timeout_s": "--gloo-timeout",
    "shuffle": "--no-shuffle", "lora_r": "--lora-r", "lora_alpha": "--lora-alpha",
    "lora_dropout": "--lora-dropout", "lora_targets": "--lora-targets", "export_merged": "--export-merged",
    "export_gguf": "--export-gguf",
}
# The planner's settings and their defaults: a run without --strategy is not planned, so one of
# them set there would be silently ignored.
PLANNER_FLAGS = {"reserve_mb": 512.0, "profile_cache": None, "bandwidth_mbps": 1000.0, "latency_ms": 0.5}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="fine-tune a model with heterogeneous tensor parallelism on local ranks",
        description="Fine-tune a Hugging Face checkpoint on N local ranks (one process each, Gloo "
        "on 127.0.0.1), rank r holding its range of each segment kind (attention units, MLP "
        "columns, vocabulary rows); export a standard Hugging Face directory.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="Hugging Face model directory")
    p.add_argument("--data", required=True, metavar="FILE", help="CSV, JSON, JSONL or Parquet file")
    p.add_argument("--task", required=True, choices=["classify", "causal-lm"])
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
                   "restart; repeatable, steps increasing. For testing the move; its time is in --metrics")
    p.add_argument("--rebalance", action="store_true",
                   help="re-plan live: rank 0 refits every rank's speed per segment kind from the measured "
                   "compute and moves the run to a better layout (as --reshard-at does) when the predicted "
                   "gain is worth the move. Off by default: a local run keeps the layout it was given")
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
    p.add_argument("--batch-size", required=True, type=int, metavar="B")
    p.add_argument("--seq-len", required=True, type=int, metavar="S")
    p.add_argument("--lr", required=True, type=float)
    p.add_argument("--max-steps", required=True, type=int, metavar="K")
    p.add_argument("--seed", required=True, type=int)
    p.add_argument("--no-shuffle", action="store_true", help="consecutive rows instead of a seeded shuffle")
    p.add_argument("--dropout", type=float, metavar="P", help="override every dropout probability")
    p.add_argument("--weight-decay", type=float, default=0.0, metavar="W")
    p.add_argument("--max-grad-norm", type=float, metavar="G", help="clip by the global gradient norm")
    p.add_argument("--warmup-steps", type=int, default=0, metavar="W", help="linear LR warmup steps")
    p.add_argument("--text-column", default="text", metavar="C")
    p.add_argument("--text-pair-column", metavar="C2")
    p.add_argument("--label-column", default="label", metavar="L",
                   help="classify: integer ids, or names (ids in sorted order, stored as id2label in the "
                   "export; their count is the number of labels when the checkpoint has no head)")
    p.add_argument("--data-format", choices=["text", "chat", "prompt-completion"], default="text",
                   help="causal-lm instruction data: 'chat' renders a messages column (lists of {role, "
                   "content}) with the tokenizer's chat template, 'prompt-completion' joins two text "
                   "columns; the loss covers the answers only (default: text)")
    p.add_argument("--messages-column", default="messages", metavar="C", help="with --data-format chat")
    p.add_argument("--prompt-column", default="prompt", metavar="C", help="with --data-format prompt-completion")
    p.add_argument("--completion-column", default="completion", metavar="C",
                   help="with --data-format prompt-completion")
    p.add_argument("--threads-per-node", type=int, default=1, metavar="T")
    p.add_argument("--eval-fraction", type=float, default=0.0, metavar="F",
                   help="hold out this tail fraction of the rows for evaluation before/after training")
    p.add_argument("--metrics", metavar="FILE.json", help="write per-iteration metrics of every rank here")
    p.add_argument("--gloo-timeout", type=float, default=300.0, metavar="S",
                   help="seconds a rank waits in a collective before giving up (default 300)")
    p.add_argument("--export", required=True, metavar="OUT",
                   help="output Hugging Face directory (with --lora-r: a PEFT adapter directory)")
    p.add_argument("--lora-r", type=int, metavar="R",
                   help="train LoRA adapters of rank R on a frozen base instead of every weight")
    p.add_argument("--lora-alpha", type=float, default=16.0, metavar="A", help="LoRA scale A / R (default 16)")
    p.add_argument("--lora-dropout", type=float, default=0.0, metavar="P", help="dropout on the adapters' input")
    p.add_argument("--lora-targets", metavar="M1,M2,..",
                   help="modules to adapt, peft's names (e.g. q_proj,v_proj; c_attn; query,value); "
                   "default: the family's (peft's defaults)")
    p.add_argument("--export-merged", action="store_true",
                   help="with --lora-r: also export the merged model (W + scale B A) to OUT/merged")
    p.add_argument("--export-gguf", choices=["f32", "f16", "q8_0"], metavar="{f32,f16,q8_0}",
                   help="also write OUT/model-TYPE.gguf for llama.cpp (with --lora-r: of the merged model) and "
                   "an Ollama Modelfile beside it (causal LMs of the llama, qwen2, qwen3, gpt2 families)")
    p.set_defaults(func=handle)


def parse_units(text: str) -> list[int]:
    try:
        return [int(u) for u in text.split(",")]
    except ValueError:
        raise ValueError(f"--units must be comma-separated integers, got {text!r}") from None


def resolve_layout(args: argparse.Namespace):
    """The layout from --layout or --units (with --strategy it is planned instead)."""
    from xronos.node.rank.validate import check_units, model_sizes
    from xronos.protocol.layout import Layout

    if args.layout is not None and args.units is not None:
        raise ValueError("give either --layout or --units, not both")
    if args.layout is not None:
        layout = Layout.parse(args.layout)
        if layout.world_size != args.nodes:
            raise ValueError(f"--layout has {layout.world_size} counts per kind (one per rank), but --nodes is "
                             f"{args.nodes}: {layout.describe()}")
        return layout
    if args.units is None:
        raise ValueError("one of --layout, --units or --strategy is required")
    units = parse_units(args.units)
    sizes = model_sizes(str(Path(args.model).resolve()))
    check_units(units, args.nodes, sizes.attn)
    return Layout.tied(units, sizes)


def parse_reshard_at(texts: list[str]) -> list[dict]:
    """`--reshard-at STEP:LAYOUT` values as RunConfig.reshard_at entries."""
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
        try:
            out.append({"step": n, "layout": Layout.parse(layout)})
        except ValueError as exc:
            raise ValueError(f"--reshard-at {n}: {str(exc).removeprefix('--layout: ')}") from None
    return out


def config_from_args(args: argparse.Namespace, layout):
    from pydantic import ValidationError

    from xronos.node.runconfig import RunConfig

    if args.lora_r is None:
        given = [f for f, v, d in (
            ("--lora-alpha", args.lora_alpha, 16.0), ("--lora-dropout", args.lora_dropout, 0.0),
            ("--lora-targets", args.lora_targets, None), ("--export-merged", args.export_merged, False)) if v != d]
        if given:
            raise ValueError(f"{', '.join(given)} require --lora-r (without it the run fine-tunes every weight)")
    if args.data_format != "text" and args.task != "causal-lm":
        raise ValueError(f"--data-format {args.data_format} is for --task causal-lm (its loss covers the answers)")
    if args.export_gguf is not None and args.task != "causal-lm":
        raise ValueError(f"--export-gguf {args.export_gguf} is for --task causal-lm: llama.cpp runs language models, "
                         f"not a {args.task} head")
    export = Path(args.export).resolve()
    if export == Path(args.model).resolve():
        raise ValueError(f"--export {args.export} would overwrite the input model directory")
    if export.exists() and not export.is_dir():
        raise ValueError(f"--export {args.export}: exists and is not a directory")
    parent = next(d for d in (export, *export.parents) if d.exists())
    if not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)):
        raise ValueError(f"--export {args.export}: cannot create it ({parent} is not a writable directory)")
    if args.metrics is not None and not Path(args.metrics).resolve().parent.is_dir():
        raise FileNotFoundError(f"--metrics {args.metrics}: directory does not exist")
    fields = dict(
        model_dir=str(Path(args.model).resolve()), data_path=str(Path(args.data).resolve()),
        task=args.task, layout=layout, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
        max_steps=args.max_steps, seed=args.seed, shuffle=not args.no_shuffle, dropout=args.dropout,
        weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        warmup_steps=args.warmup_steps, text_column=args.text_column,
        text_pair_column=args.text_pair_column, label_column=args.label_column,
        data_format=args.data_format, messages_column=args.messages_column,
        prompt_column=args.prompt_column, completion_column=args.completion_column,
        threads=args.threads_per_node, eval_fraction=args.eval_fraction,
        metrics_path=str(Path(args.metrics).resolve()) if args.metrics else None,
        export_dir=str(export), gloo_timeout_s=args.gloo_timeout, progress=True,
        reshard_at=parse_reshard_at(args.reshard_at), rebalance=args.rebalance,
        lora_r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
        lora_targets=[t.strip() for t in args.lora_targets.split(",")] if args.lora_targets else None,
        export_merged=args.export_merged, export_gguf=args.export_gguf,
    )
    try:
        return RunConfig(**fields)
    except ValidationError as exc:
        raise ValueError("; ".join(_problem(e) for e in exc.errors())) from None


def _problem(e: dict) -> str:
    """One pydantic error as the user typed it: the flag and the value. A check across fields (no
    location) names its fields itself, and its input would be the whole config: not repeated."""
    msg = reason(e)
    if not e["loc"]:
        msg = msg.replace("reshard_at", "--reshard-at").replace("or rebalance (", "or --rebalance (")
        return re.sub(r"ranks, the run (\d+)$", r"ranks, but --nodes is \1", msg)
    flag = _FLAGS.get(str(e["loc"][0]), "--" + str(e["loc"][0]).replace("_", "-"))
    return f"{flag}: {msg} (got {e.get('input')!r})"


def handle(args: argparse.Namespace) -> int:
    from xronos.cli.strategy import confinement, plan_run
    from xronos.node.rank.validate import preflight

    if args.nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {args.nodes}")
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
        preflight(config_from_args(args, uniform_layout(args)), args.nodes)
        planned = plan_run(args, wrap)
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
    pre = preflight(cfg, args.nodes)
    print(
        f"xronos run: {pre.family} model ({pre.sizes.describe()}) on {args.nodes} ranks, "
        f"layout {layout.describe()}; {pre.train_rows} training rows"
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
    print(f"xronos run: exported to {cfg.export_dir}", file=sys.stderr)
    for line in using_lines(cfg.export_dir, cfg.task, lora=cfg.lora_r is not None, gguf=cfg.export_gguf,
                            merged=cfg.export_merged):
        print(f"xronos run: {line}", file=sys.stderr)
    return 0
