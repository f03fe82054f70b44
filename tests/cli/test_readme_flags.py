"""Every option of every `xronos` command (its --help) is in README.md, so the README's synopses
cannot fall behind the parser again (the audit found `xronos plan --job-id`, the client commands'
--base-topic/--timeout and `xronos bench`'s result options missing)."""

from __future__ import annotations

import argparse
from pathlib import Path

from xronos.cli.main import build_parser

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def test_every_option_is_in_the_readme():
    missing = {}
    for path, parser in _commands(build_parser()):
        flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
        gone = [f for f in flags if f not in README]
        if gone:
            missing[" ".join(("xronos", *path))] = gone
    assert missing == {}


def test_the_timeout_help_says_each_commands_own_default():
    parser = build_parser()
    job = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["job"]
    sub = next(a for a in job._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert "(default 900)" in sub["submit"].format_help()  # answered after the profiles: minutes
    assert "(default 30)" in sub["status"].format_help()
