"""Entry point of the `xronos` command.

Each subcommand lives in its own module of this package and exposes
`register(subparsers)`, which adds its parser and sets `func` to a handler taking the parsed
arguments and returning an exit code. Modules import torch and friends only inside their
handlers, so `xronos --help` and the gateway-side commands stay light. Other packages add
commands through the entry point group `xronos.commands` (name = module with `register`): the
bench's `xronos bench` does, so that the CLI itself never imports the bench.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import signal
import sys
import threading

# Only subcommands that exist are listed here; a later feature adds its module name.
SUBCOMMANDS: tuple[str, ...] = ("plan", "broker", "run", "profile", "node", "gateway", "job", "nodes", "demo")
PLUGINS = "xronos.commands"  # entry point group: commands installed by other packages (the bench)
# Services log JSON lines for the journal (they configure that themselves). The client commands
# talk to a person: their own output on stdout, and only library warnings, as plain text, on stderr.
CLIENTS = ("job", "nodes", "demo", "profile")
# Options whose value may begin with '-' (a negative count or step: `--units -2,10,4`). argparse
# takes such a value for an unknown flag and says only "expected one argument"; joined as
# `--units=-2,10,4` it reaches the command's own check, which names the flag and the number.
DASH_VALUES = ("--units", "--layout", "--cpu-shares", "--reshard-at")
# A negative number argparse does not take for one (`--lr -1e-3`, `--reserve-mb -inf`: it knows
# only -12 and -1.5) after any long option: joined too, so the option's own check names it.
NEGATIVE_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|-(inf|infinity|nan)", re.IGNORECASE)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("xronos")
    except PackageNotFoundError:  # a bare checkout on PYTHONPATH
        return "0+unknown"


def configure_client_logging() -> None:
    """Plain `warning: event key=value` lines on stderr for the library logs of client commands."""
    import structlog

    def plain(_logger, method: str, event: dict) -> str:
        text = str(event.pop("event", ""))
        if text == "mqtt.connect_refused":  # the command itself says why, in words
            raise structlog.DropEvent
        event.pop("timestamp", None)
        level = event.pop("level", method)
        extra = " ".join(f"{k}={v}" for k, v in event.items() if not k.startswith("_"))
        return f"xronos: {level}: {text}" + (f" ({extra})" if extra else "")

    structlog.configure(
        processors=[structlog.stdlib.add_log_level, plain],
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        # sys.stderr as it is when a line is written (tests swap it), not when configured.
        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr),
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger()
    if not any(h.get_name() == "xronos-client" for h in root.handlers):
        handler = _StderrHandler()
        handler.set_name("xronos-client")
        handler.setFormatter(logging.Formatter("xronos: %(levelname)s: %(name)s: %(message)s"))
        handler.setLevel(logging.WARNING)
        root.addHandler(handler)


class _StderrHandler(logging.StreamHandler):
    """A stream handler on whatever sys.stderr is at the time of each record."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xronos",
        description="Heterogeneity-aware tensor-parallel fine-tuning on CPU edge devices.",
    )
    parser.add_argument("--version", action="version", version=f"xronos {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"xronos.cli.{name}").register(sub)
    for name, module in plugins().items():
        if name not in SUBCOMMANDS:
            importlib.import_module(module).register(sub)
    return parser


def plugins() -> dict[str, str]:
    """Command name -> module of the commands other packages plug in (`xronos.commands`)."""
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group=PLUGINS)}


def join_dash_values(argv: list[str]) -> list[str]:
    """`OPT VALUE` as `OPT=VALUE` for the DASH_VALUES options when VALUE starts with a single '-'
    (not another long option, not -h), and for any long option when VALUE is a negative number;
    nothing after `--` is touched."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return out + argv[i:]
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        dash = arg in DASH_VALUES and nxt.startswith("-") and not nxt.startswith("--") and nxt != "-h"
        if dash or (arg.startswith("--") and "=" not in arg and NEGATIVE_NUMBER.fullmatch(nxt)):
            out.append(f"{arg}={nxt}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


class Terminated(BaseException):
    """SIGTERM (`timeout`, `kill`, a supervisor): raised in the main thread like Ctrl-C's
    KeyboardInterrupt, so a command's `finally` blocks run (its rank processes stopped, its temporary
    files removed) before it exits 143. The services (`xronos node`, `xronos gateway`, `xronos
    broker`) set their own handler."""


def _terminated(_signum: int, _frame: object) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    # SIGTERM's default (die at once) only: a caller's own handler (a test harness, a service) stays
    mine = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    if mine:
        signal.signal(signal.SIGTERM, _terminated)
    try:
        return _main(argv)
    finally:
        if mine and signal.getsignal(signal.SIGTERM) is _terminated:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(join_dash_values(sys.argv[1:] if argv is None else list(argv)))
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if args.command in CLIENTS:
        configure_client_logging()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"xronos {args.command}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"xronos {args.command}: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except BrokenPipeError:
        # The reader went away (`xronos plan --json | head`): no traceback, and none at exit either
        # when Python flushes stdout (it is pointed at /dev/null for that).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a shell reports a process killed by SIGPIPE
    except (ValueError, TypeError, FileNotFoundError) as exc:
        # Bad input: one clear line naming the problem, no traceback.
        print(f"xronos {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
