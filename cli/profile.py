"""`xronos profile`: measure this box on a model's profiling set and write a ProfileReport JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from xronos.cli import flagtable
from xronos.cli.flagtable import add_flags


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
    from xronos.protocol.messages import ProfileKey

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
    add_flags(p, ProfileKey, flagtable.PROFILE)  # the profile key's: the job recipe's task, batch, ... LoRA
    p.add_argument("--threads", type=positive_int, metavar="T", help="torch threads (default: torch's)")
    p.add_argument("--iters", type=positive_int, default=10, metavar="K",
                   help="measured iterations per width after warm-up (default 10)")
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


def profile_key(args: argparse.Namespace):
    """The ProfileKey the flags describe (`flagtable.PROFILE`); ValueError naming the flags
    otherwise (LoRA options without --lora-r: a full fine-tune's profile has no adapters)."""
    from pydantic import ValidationError

    from xronos.protocol.messages import ProfileKey

    try:
        return ProfileKey(**flagtable.collect(args, flagtable.PROFILE))
    except ValidationError as exc:
        raise ValueError(flagtable.problems(exc.errors(), args, flagtable.PROFILE)) from None


def handle(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if not out.resolve().parent.is_dir():
        raise FileNotFoundError(f"--out {args.out}: directory does not exist")
    key = profile_key(args)
    if args.threads is not None:  # as a node refuses a profile request (node/agent/boxcheck.py)
        from xronos.node.box.capabilities import usable_cores

        if args.threads > (cores := usable_cores()):
            raise ValueError(f"--threads {args.threads}: this box has {cores} usable cores (affinity mask and CPU "
                             "quota); more threads than cores measure the scheduler, not the box")

    from xronos.node.measure import allocator
    from xronos.node.measure.profiler import config_for, profile
    from xronos.node.models.shapes import shape_config

    allocator.tune()  # measure under the training ranks' malloc setting (see node/measure/allocator.py)

    if args.model is not None:
        config = config_for(model_dir=args.model)
    else:
        config = shape_config(args.arch, key.task)
    report = profile(config, key.task, key.batch_size, key.seq_len, threads=args.threads, iters=args.iters,
                     clip=key.clip, weight_decay=key.weight_decay, lora=key.lora, node_id=args.node_id,
                     cache_dir=args.cache_dir, progress=_stage_printer())
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report.model_dump(mode="json"), indent=1))
    tmp.replace(out)
    print(f"xronos profile: {report.arch.family} ({report.sizes.describe()}) blocks={report.num_blocks} "
          f"profiled in {report.profile_seconds:.1f} s -> {out}", file=sys.stderr)
    for lay in report.layers:
        print(f"  {lay.name:<14} {'part' if lay.partitioned else 'repl'}  T={lay.time_s * 1e3:9.2f} ms  "
              f"M_w={lay.weight_bytes / 2**20:8.2f} MiB  M_a={lay.activation_bytes / 2**20:7.2f} MiB  "
              f"M_t={lay.temp_bytes / 2**20:7.2f} MiB", file=sys.stderr)
    return 0
