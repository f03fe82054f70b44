"""`xronos bench`: one benchmark cell — every strategy on the same emulated devices and model.

A command the bench plugs into the CLI (entry point group `xronos.commands` in pyproject.toml):
the CLI never imports the bench, and an installation without it simply has no `xronos bench`.

    xronos bench --scenario set-a --model gpt2-medium --strategies xronos,uniform,pp --iters 6 \\
        --seq-len 32 --blocks 2

Needs root (cgroups). The devices run on the virtual clock by default (`--cpu-mode virtual`: each
rank's compute over its device's speed, the link modelled at --bandwidth-mbit); `--cpu-mode quota`
or `pace` run them on the wall clock under CFS quotas or pacing (network namespaces + tc for the
emulated links, or --bandwidth-mbit 0 for plain loopback): a stress test of the host's scheduler.
Writes bench/results/<name>.json (+ .md, plots) atomically, naming the clock; bad input is refused
before anything is written or spawned.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def _mem_scale(text: str) -> float | str | None:
    if text.lower() in ("none", "off"):
        return None
    if text.lower() == "kept":
        return "kept"
    try:
        value = _fraction(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mem-scale must be 'kept', a number like 0.125 or 1/8, or 'none'; "
                                         f"got {text!r}")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--mem-scale must be > 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    if "/" in text:
        num, den = text.split("/", 1)
        return float(num) / float(den)
    return float(text)


def register(subparsers) -> None:
    from xronos.bench.scenarios import SCENARIOS
    from xronos.bench.strategies import STRATEGIES
    from xronos.bench.workloads import SHAPES

    p = subparsers.add_parser("bench", help="run one benchmark cell (strategies side by side on emulated devices)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", required=True, help=f"one of {', '.join(SCENARIOS)}")
    p.add_argument("--model", help=f"one of {', '.join(SHAPES)} (not with --tta)")
    p.add_argument("--strategies", default="xronos,uniform,pp,hf-tp",
                   help=f"comma list of {', '.join(STRATEGIES)}")
    p.add_argument("--iters", type=int, default=6, help="iterations per strategy (incl. warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="iterations excluded from the means")
    p.add_argument("--seq-len", type=int, default=32, help="32/64/128 = the paper's CoLA/SST-2/MRPC")
    p.add_argument("--blocks", type=int, default=None, help="keep this many transformer blocks (full width)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--mem-scale", type=_mem_scale, default="kept",
                   help="memory cap = runtime reserve + this x (device RAM - reserve); default 'kept': the "
                        "fraction of the model's parameters the cell keeps (bench/scenarios.py); 'none' = no caps")
    p.add_argument("--unit-share", type=float, default=0.30,
                   help="cores per unit of device speed (a Raspberry Pi 5 rank gets this share)")
    p.add_argument("--bandwidth-mbit", "--bandwidth-mbps", type=float, default=1000.0,
                   help="every rank's link rate, emulated with network namespaces + tc (default 1000: the "
                        "paper's 1 Gbit/s LAN; needs root); 0 = plain loopback, no limit (--bandwidth-mbps: the "
                        "same, as `xronos run` and `xronos plan` spell it)")
    p.add_argument("--lora-r", type=int, default=8,
                   help="the LoRA strategies (xronos-lora, uniform-lora, pp-lora): the adapters' rank (default 8)")
    p.add_argument("--lora-alpha", type=float, default=16.0, help="the LoRA strategies: adapter scale alpha / r (default 16)")
    p.add_argument("--lora-targets", default="",
                   help="the LoRA strategies: comma list of target modules (peft's names; default: the family's, peft's)")
    p.add_argument("--name", default=None, help="result file name (default from the cell)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--tta", action="store_true",
                   help="time-to-accuracy instead: the real MiniLM on generated sentiment data, --iters steps")
    p.add_argument("--target", type=float, default=0.9, help="--tta: target held-out accuracy")
    p.add_argument("--eval-every", type=int, default=5, help="--tta: reference evaluation interval (steps)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 2e-5; 5e-5 with --tta)")
    p.add_argument("--cpu-mode", choices=("virtual", "quota", "pace"), default="virtual",
                   help="how the devices' speeds are made: virtual clock (default) or wall clock under CFS "
                        "quotas / pacing (XRONOS_EMULATOR_CPU)")
    p.add_argument("--estimator", default="min",
                   help="virtual clock: a burst's CPU time estimate over its last 32 samples: min (default), "
                        "med, mean, raw or qNN (XRONOS_EMULATOR_ESTIMATOR)")
    p.set_defaults(func=handler)


def handler(args) -> int:
    with cpu_mode(args.cpu_mode, args.estimator):
        return _handle(args)


def _handle(args) -> int:
    from xronos.bench import results
    from xronos.bench.harness import CellSpec, run_cell, validate

    strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    if args.tta:
        from xronos.bench.tta import run_tta

        if args.model:
            raise ValueError("--tta uses the real MiniLM; drop --model")
        doc = run_tta(args.scenario, strategies, steps=args.iters, eval_every=args.eval_every,
                      target=args.target, seq_len=args.seq_len, lr=args.lr or 5e-5, mem_scale=args.mem_scale,
                      unit_share=args.unit_share, bandwidth_mbit=args.bandwidth_mbit)
        return _finish(results, doc, args)
    if not args.model:
        raise ValueError("--model is required (or --tta)")

    spec = CellSpec(scenario=args.scenario, model=args.model,
                    strategies=strategies, lr=args.lr or 2e-5,
                    iters=args.iters, warmup=args.warmup, seq_len=args.seq_len, blocks=args.blocks,
                    batch_size=args.batch_size, mem_scale=args.mem_scale, unit_share=args.unit_share,
                    bandwidth_mbit=args.bandwidth_mbit, name=args.name, lora_r=args.lora_r,
                    lora_alpha=args.lora_alpha,
                    lora_targets=tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()))
    validate(spec)  # refuse before any work
    return _finish(results, results.summarize(run_cell(spec)), args)


@contextlib.contextmanager
def cpu_mode(mode: str, estimator: str | None = None) -> Iterator[None]:
    """The emulator's mode and estimator for everything confined inside (children inherit them);
    the environment as it was afterwards."""
    from xronos.node.emulate.cpumode import CPU_MODE_ENV, ESTIMATOR_ENV, default_cpu_mode, default_estimator
    from xronos.node.emulate.estimator import DEFAULT_MODE

    saved = {k: os.environ.get(k) for k in (CPU_MODE_ENV, ESTIMATOR_ENV)}
    estimator = DEFAULT_MODE if estimator is None else estimator
    os.environ[CPU_MODE_ENV], os.environ[ESTIMATOR_ENV] = mode, estimator
    try:
        default_cpu_mode(), default_estimator()  # refuse a bad one now, naming it
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _finish(results, doc: dict, args) -> int:
    paths = results.write(doc, args.out, plots=not args.no_plots)
    print(paths[1].read_text())  # the Markdown file, as written
    print("wrote " + ", ".join(str(p) for p in paths))
    failed = [k for k, v in doc["strategies"].items() if "failed" in v]
    return 1 if failed else 0
