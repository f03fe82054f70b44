"""memwatch: per-phase peaks of the real process (/proc/self/status, clear_refs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from xronos.node import memwatch

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")

CHILD = """
import ctypes, json, sys
from xronos.node.memwatch import Watch
w = Watch(sys.argv[1])
w.phase("start")
buf = bytearray(200 << 20)
for i in range(0, len(buf), 4096): buf[i] = 1
del buf
ctypes.CDLL("libc.so.6").malloc_trim(0)
w.phase("big")
w.phase("after")
w.write(0)
"""


def test_each_phase_gets_its_own_peak_when_resetting(tmp_path: Path) -> None:
    """A 200 MiB transient shows in the phase that made it, not in the next (the mark is reset),
    and the overall peak keeps it."""
    subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], check=True)
    doc = json.loads((tmp_path / "rank0.json").read_text())
    big, after = doc["phases"]["big"], doc["phases"]["after"]
    assert big - after > 150 << 20
    assert doc["peak"] >= big and doc["peak_phase"] == "big"
    assert [e[0] for e in doc["events"]] == ["start", "big", "after"]


def test_without_out_dir_the_mark_is_cumulative_and_nothing_is_written(tmp_path: Path) -> None:
    w = memwatch.Watch(out_dir=None)
    assert not w.resetting
    first = w.phase("a")
    assert w.phase("b") >= first and w.peak() >= first
    w.write(0)
    assert not any(tmp_path.iterdir())
