"""The docs as the docs tests read them: the README and every page of docs/, with helpers for the
parts they check (code blocks, backquoted spans, headings)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))
FILES = [README, *PAGES]


def text(path: Path) -> str:
    return path.read_text()


def all_text() -> str:
    """The README and every page, one after the other."""
    return "\n".join(text(p) for p in FILES)


def name(path: Path) -> str:
    return str(path.relative_to(REPO))


def code_lines(doc: str) -> list[str]:
    """The lines of the fenced code blocks, a shell line continued with `\\` joined to the next."""
    out, fenced, pending = [], False, ""
    for line in doc.splitlines():
        if line.lstrip().startswith("```"):
            fenced, pending = not fenced, ""
            continue
        if not fenced:
            continue
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        out.append(line)
    return out


def spans(doc: str) -> list[str]:
    """Every backquoted span outside the code blocks (a span may wrap over one line break)."""
    outside = re.sub(r"^[ \t]*```.*?^[ \t]*```[^\n]*$", "", doc, flags=re.S | re.M)
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", outside)]
