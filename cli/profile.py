"""`xronos profile`: measure this box on a model's profiling set and write a ProfileReport JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    from xronos.node.models.shapes import SHAPES

    p = subparsers.add_parser(
        "profile",
        help="profile this machine on a model's profiling set (embedding, one block, output)",
        description="Run a few fine-tuning iterations of a model's profiling set (embedding layer, one "
        "transformer block, output layer; random weights, synthetic batch) at full width and at about "
        "1/2 and 1/4 of every segment kind (attention units, MLP columns, vocabulary rows), and write "
        "per-layer time (per share of its kind) and memory (weights+grads+AdamW state, "
        "activations, temporaries) as a ProfileReport JSON for `xronos plan`.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="Hugging Face model directory (only config.json is read)")
    src.add_argument("--arch", metavar="NAME", help=f"built-in shape: {', '.join(SHAPES)}")
    p.add_argument("--task", required=True, choices=["classify", "causal-lm"])
    p.add_argument("--batch-size", required=True, type=positive_int, metavar="B")
    p.add_argument("--seq-len", required=True, type=positive_int, metavar="S")
    p.add_argument("--threads", type=positive_int, metavar="T", help="torch threads (default: torch's)")
    p.add_argument("--iters", type=positive_int, default=10, metavar="K",
                   help="measured iterations per width after warm-up (default 10)")
    p.add_argument("--no-clip", action="store_true",
                   help="the job does not clip gradients (leave out the global-norm pass)")
    p.add_argument("--weight-decay", type=float, default=0.0, metavar="W",
                   help="the job's AdamW weight decay (default 0, as `xronos run`)")
    p.add_argument("--lora-r", type=positive_int, metavar="R",
                   help="profile LoRA training: adapters of rank R on a frozen base (as `xronos run --lora-r`)")
    p.add_argument("--lora-targets", metavar="M1,M2,..", help="with --lora-r: the adapted modules (peft's names)")
    p.add_argument("--lora-dropout", type=float, default=0.0, metavar="P", help="with --lora-r: adapter dropout")
    p.add_argument("--node-id", default="local", type=id_arg, help="node id written into the report")
    p.add_argument("--cache-dir", metavar="DIR", help="reuse/store profiles of this hardware here")
    p.add_argument("--out", required=True, metavar="FILE.json")
    p.set_defaults(func=handle)


def id_arg(text: str) -> str:
    """argparse type of an id that goes into a message as an Id (a report's node_id, which `xronos
    plan` and the gateway read back; a plan's job_id): refused as the user typed it, in one line."""
    from pydantic import TypeAdapter, ValidationError

    from xronos.common.errtext import reason
    from xronos.protocol.messages import Id

    try:
        return TypeAdapter(Id).validate_python(text)
    except ValidationError as exc:
        raise argparse.ArgumentTypeError(reason(exc.errors()[0])) from None


def _stage_printer():
    t0 = time.perf_counter()

    def show(stage: str) -> None:
        print(f"xronos profile: {stage} ... ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    return show


def handle(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if not out.resolve().parent.is_dir():
        raise FileNotFoundError(f"--out {args.out}: directory does not exist")
    if args.lora_r is None and (args.lora_targets or args.lora_dropout):
        # Without --lora-r the profile is full fine-tuning's, which a LoRA job would be planned with.
        raise ValueError("--lora-targets / --lora-dropout need --lora-r (a LoRA profile)")

    from xronos.node.measure import allocator
    from xronos.node.measure.profiler import config_for, profile
    from xronos.node.models.shapes import shape_config

    allocator.tune()  # measure under the training ranks' malloc setting (see node/measure/allocator.py)

    if args.model is not None:
        config = config_for(model_dir=args.model)
    else:
        config = shape_config(args.arch, args.task)
    report = profile(config, args.task, args.batch_size, args.seq_len, threads=args.threads,
                     iters=args.iters, clip=not args.no_clip, weight_decay=args.weight_decay,
                     lora_r=args.lora_r, lora_dropout=args.lora_dropout,
                     lora_targets=[t.strip() for t in args.lora_targets.split(",")] if args.lora_targets else None,
                     node_id=args.node_id,
                     cache_dir=args.cache_dir, progress=_stage_printer())
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report.model_dump(mode="json"), indent=1))
    tmp.replace(out)
    print(f"xronos profile: {report.arch.family} ({report.sizes.describe()}) B={report.num_blocks} "
          f"profiled in {report.profile_seconds:.1f} s -> {out}", file=sys.stderr)
    for lay in report.layers:
        print(f"  {lay.name:<14} {'part' if lay.partitioned else 'repl'}  T={lay.time_s * 1e3:9.2f} ms  "
              f"M_w={lay.weight_bytes / 2**20:8.2f} MiB  M_a={lay.activation_bytes / 2**20:7.2f} MiB  "
              f"M_t={lay.temp_bytes / 2**20:7.2f} MiB", file=sys.stderr)
    return 0
