"""The options of the `xronos` commands and the docs (the README and every page of docs/) agree:
every option of every command (its --help) is named in the docs, so their synopses cannot fall
behind the parser again (the audit found `xronos plan --job-id`, the client commands'
--base-topic/--timeout and `xronos bench`'s result options missing), and every command and option
the docs show exists, so a renamed or removed one cannot linger there."""

from __future__ import annotations

import argparse
import re

import doctext
from xronos.cli.main import build_parser

OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
# Options of programs that are not ours, as the docs use them (pip's dry run, `hf download`, the
# appliance test's `systemd-nspawn --boot`).
FOREIGN = {"--dry-run", "--report", "--include", "--local-dir", "--boot"}


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((dict(a.choices) for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--")}


def _sources():
    """(file, text) of every code line (its comment cut off) and every backquoted span."""
    for path in doctext.FILES:
        doc = doctext.text(path)
        for line in doctext.code_lines(doc):
            yield doctext.name(path), re.split(r"(?:^|\s)#(?:\s|$)", line, maxsplit=1)[0]
        for span in doctext.spans(doc):
            yield doctext.name(path), span


def _invocations():
    """(file, command path, options) of every `xronos ...` the docs show. A word after `xronos`
    that is not a command is a wrong command where the line or span starts with `xronos`, and
    prose elsewhere ("xronos and uniform" is a strategy)."""
    top = build_parser()
    for where, source in _sources():
        tokens = source.split()
        for i, tok in enumerate(tokens):
            if not (tok == "xronos" or tok.endswith("/bin/xronos")) or (i and tokens[i - 1] == "-u"):
                continue
            rest = tokens[i + 1:]
            if not rest:
                continue
            parser, path = top, ["xronos"]
            subs = _subcommands(parser)
            words = rest[0].split("|")
            if rest[0].startswith("-"):
                yield where, tuple(path), parser, OPTION.findall(" ".join(rest)), source
                continue
            if not all(w in subs for w in words):
                if i == 0 and re.fullmatch(r"[a-z][a-z-]*", rest[0]):
                    yield where, (*path, rest[0]), None, [], source
                continue
            for w in words:
                sub, sub_path, tail = subs[w], [*path, w], rest[1:]
                nested = _subcommands(sub)
                if nested and tail and not tail[0].startswith("-"):
                    for w2 in tail[0].split("|"):
                        yield (where, (*sub_path, w2), nested.get(w2), OPTION.findall(" ".join(tail[1:])), source)
                    continue
                yield where, tuple(sub_path), sub, OPTION.findall(" ".join(tail)), source


def test_every_option_is_in_the_docs():
    docs = doctext.all_text()
    named = set(OPTION.findall(docs))
    missing = {}
    for path, parser in _commands(build_parser()):
        gone = sorted(_options(parser) - {"--help"} - named)
        if gone:
            missing[" ".join(("xronos", *path))] = gone
    assert missing == {}


def test_every_command_and_option_the_docs_show_exists():
    wrong = []
    seen = 0
    for where, path, parser, flags, source in _invocations():
        seen += 1
        if parser is None:
            wrong.append(f"{where}: no command {' '.join(path)!r}: {source}")
            continue
        bad = sorted(set(flags) - _options(parser))
        if bad:
            wrong.append(f"{where}: {' '.join(path)} has no {', '.join(bad)}: {source}")
    assert seen > 50 and wrong == []


def test_every_other_option_the_docs_name_is_defined():
    """An option named outside a shown command (`--rows`, a bench module's `--quick`, install.sh's
    `--role`) is defined by an argparse parser in the code or a shell script's options."""
    repo = doctext.REPO
    defined = set(FOREIGN)
    for path, parser in _commands(build_parser()):
        defined |= _options(parser)
    for py in repo.glob("*/**/*.py"):
        if ".venv" not in py.parts and "tests" not in py.parts:
            defined |= set(re.findall(r"add_argument\(\s*\"(--[a-z][a-z0-9-]*)\"", py.read_text()))
    for sh in repo.glob("systemd/**/*.sh"):
        defined |= set(re.findall(r"(--[a-z][a-z0-9-]*)(?:\||\))", sh.read_text()))
    named = {f: doctext.name(p) for p in reversed(doctext.FILES) for f in OPTION.findall(doctext.text(p))}
    assert {f: where for f, where in named.items() if f not in defined} == {}


def test_the_timeout_help_says_each_commands_own_default():
    parser = build_parser()
    job = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["job"]
    sub = next(a for a in job._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert "(default 900)" in sub["submit"].format_help()  # answered after the profiles: minutes
    assert "(default 30)" in sub["status"].format_help()
