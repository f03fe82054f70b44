"""Entry point of the `xronos` command.

Each subcommand lives in its own module of this package and exposes
`register(subparsers)`, which adds its parser and sets `func` to a handler taking the parsed
arguments and returning an exit code. Modules import torch and friends only inside their
handlers, so `xronos --help` and the gateway-side commands stay light.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Only subcommands that exist are listed here; a later feature adds its module name.
SUBCOMMANDS: tuple[str, ...] = ("plan", "broker", "run", "profile", "node", "gateway", "job", "nodes", "demo", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xronos",
        description="Heterogeneity-aware tensor-parallel fine-tuning on CPU edge devices.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"xronos.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, TypeError, FileNotFoundError) as exc:
        # Bad input: one clear line naming the problem, no traceback.
        print(f"xronos {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
