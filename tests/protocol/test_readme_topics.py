"""The README's Topic API table must say what the topic table does."""

import re
from pathlib import Path

from xronos.protocol.topics import ENTRIES

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_topic_table_matches_code():
    text = README.read_text()
    section = text.split("## Topic API", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `\{base\}/([^`]+)` \|[^|]*\|[^|]*\| (\w+) \| (yes|no) \|$", section, re.M)
    assert rows == [(e.pattern, e.encoding, "yes" if e.retained else "no") for e in ENTRIES if e.root == "base"]
    assert all(f"`{{prefix}}/{e.pattern}`" in section for e in ENTRIES if e.root == "discovery")
