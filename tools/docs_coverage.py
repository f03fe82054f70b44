"""Did a rewrite of the docs lose a fact? Reads an old README (or any markdown file) and reports
what of it is not in the current README or a page of docs/: its lines that carry a command, a flag,
a number or a backquoted name and are not found verbatim (whitespace aside), and, stricter, every
backquoted span, every --flag and every number of it that appears nowhere.

    python tools/docs_coverage.py <(git show 1964adb:README.md)

Used when the README was split into docs/ (issue 35); useful again when a branch that edited the
old README is merged: what it added must land in the page that now holds its topic.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEARING = re.compile(r"\d|--?[a-z]|`|xronos |\bmake\b|sudo ")


def _norm(text: str) -> str:
    return " ".join(text.split())


def report(old: str) -> dict[str, list[str]]:
    new = "\n".join([(ROOT / "README.md").read_text(), *(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))])
    hay = _norm(new)
    lines = [f"{i}: {line}" for i, line in enumerate(old.splitlines(), 1)
             if _norm(line) and BEARING.search(line) and _norm(line) not in hay]
    spans = set(re.findall(r"`([^`\n]+)`", old))
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", old))
    numbers = set(re.findall(r"(?<![\w.])([−+-]?\d[\d,.]*(?:\s?(?:%|MiB|GiB|ms|s|x|Mbit/s))?)", old))
    return {
        "lines not found verbatim": lines,
        "spans lost": sorted(s for s in spans if _norm(s) not in hay),
        "flags lost": sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", new)),
        "numbers lost": sorted(n for n in numbers if _norm(n) not in hay),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    found = report(Path(argv[0]).read_text())
    for what, items in found.items():
        print(f"{what}: {len(items)}")
        for item in items:
            print(f"  {item}")
    return 1 if any(found[k] for k in ("spans lost", "flags lost", "numbers lost")) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
