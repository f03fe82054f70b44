"""memwatch: per-phase peaks of the real process (/proc/self/status, clear_refs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from xronos.node.measure import memwatch

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")

CHILD = """
import ctypes, json, sys
from xronos.node.measure.memwatch import Watch
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
    assert [h[0] for h in doc["heaps"]] == ["start", "big", "after"]  # glibc's heap at each phase's end


def test_without_out_dir_the_mark_is_cumulative_and_nothing_is_written(tmp_path: Path) -> None:
    w = memwatch.Watch(out_dir=None)
    assert not w.resetting
    first = w.phase("a")
    assert w.phase("b") >= first and w.peak() >= first
    w.write(0)
    assert not any(tmp_path.iterdir())


HEAP_CHILD = """
import ctypes, json, sys
from xronos.node.measure import memwatch
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
out = {"before": memwatch.heap()}
p = libc.malloc(100 << 20)
ctypes.memset(p, 1, 100 << 20)
out["held"] = memwatch.heap()
libc.free(p)
out["freed"] = memwatch.heap()
print(json.dumps(out))
"""


@pytest.mark.skipif(not memwatch.heap(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_heap_tells_used_from_free_holes_under_the_ranks_setting() -> None:
    """With mmap off and trimming out of reach (the training ranks' setting), a freed 100 MiB block
    moves from `used` to `free` and the heap's span keeps it: the resident hole the rank pays."""
    env = {**__import__("os").environ, "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}
    proc = subprocess.run([sys.executable, "-c", HEAP_CHILD], check=True, capture_output=True, text=True, env=env)
    h = json.loads(proc.stdout)
    mib = 1 << 20
    assert h["held"]["used"] - h["before"]["used"] >= 100 * mib
    assert h["held"]["mmapped"] == h["before"]["mmapped"]  # in the heap, not mmapped on its own
    assert h["freed"]["free"] - h["before"]["free"] >= 100 * mib
    assert h["freed"]["span"] == h["held"]["span"] >= 100 * mib
    for doc in h.values():
        assert doc["span"] >= doc["used"] and set(doc) == {"span", "used", "free", "mmapped"}
