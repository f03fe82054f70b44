"""The profiler and the ranks must run under one malloc setting (node/measure/allocator.py): freed big
blocks stay in the heap instead of going back to the kernel to be page-faulted in again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Allocate and touch 256 MiB, free it, and print the resident set before and after the free.
_PROBE = r"""
import ctypes, sys
from xronos.node.measure import allocator
print(allocator.tune(), file=sys.stderr)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
n = 256 << 20
p = libc.malloc(n)
ctypes.memset(p, 1, n)
held = rss()
libc.free(p)
print(held, rss())
"""


def _freed_share(malloc: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if malloc:
        env["XRONOS_MALLOC"] = malloc
    else:
        env.pop("XRONOS_MALLOC", None)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    held, after = (int(v) for v in out.stdout.split())
    return (held - after) / (256 << 20)


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")
def test_tune_keeps_freed_blocks_resident() -> None:
    # glibc's default returns the whole block; tuned, none of it goes back (a trim threshold that
    # wrapped to 0 in the C int would hand it back too).
    assert _freed_share("glibc") > 0.9
    assert _freed_share(None) < 0.1


def test_opt_out() -> None:
    env = dict(os.environ, XRONOS_MALLOC="glibc")
    out = subprocess.run([sys.executable, "-c", "from xronos.node.measure import allocator; print(allocator.tune())"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
