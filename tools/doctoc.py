"""The table of contents of every page in docs/: regenerated between `<!-- toc -->` and
`<!-- /toc -->` from the page's `##` and `###` headings, with GitHub's anchors.

    python tools/doctoc.py          # rewrite the tables that are out of date
    python tools/doctoc.py --check  # exit 1 naming the pages whose table is out of date

tests/tools/test_docs.py runs the check, so a heading added without its entry fails the suite.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
START, END = "<!-- toc -->", "<!-- /toc -->"


def headings(text: str) -> list[tuple[int, str]]:
    """(level, title) of every markdown heading outside fenced code blocks."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"(#{1,6}) (.+?)\s*$", line)):
            found.append((len(m.group(1)), m.group(2)))
    return found


def anchor(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores
    kept), spaces to hyphens. Duplicate titles are not numbered here: pages keep titles unique."""
    text = re.sub(r"[^\w\- ]", "", title.replace("`", "").lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    return {anchor(title) for _, title in headings(text)}


def toc(text: str) -> str:
    lines = [f"{'  ' * (level - 2)}- [{title.replace('`', '')}](#{anchor(title)})"
             for level, title in headings(text) if level in (2, 3)]
    return "\n".join([START, *lines, END])


def refreshed(text: str) -> str:
    """The page with its table regenerated; a page without the markers gets none."""
    if START not in text:
        return text
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    return head + toc(text) + tail


def main(argv: list[str]) -> int:
    stale = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        new = refreshed(text)
        if new != text:
            stale.append(page.name)
            if "--check" not in argv:
                page.write_text(new)
    if stale and "--check" in argv:
        print(f"table of contents out of date (python tools/doctoc.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
