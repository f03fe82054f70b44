"""The allocator setting every training and profiling process runs with.

glibc hands every block above its mmap threshold (at most 32 MiB) back to the kernel when it is
freed, so each iteration page-faults its large activations, gradients and optimizer temporaries in
afresh: a GPT-2-medium 2-block iteration took 4.0 s instead of 2.35 s here (bench/prediction_error,
--malloc glibc vs tuned). Training ranks keep those blocks in the heap (`xronos.node.rank.local.rank_env`
sets glibc's environment variables); the profiler must measure under the same setting, or it
predicts a cost the trainer never pays: the vocabulary-sized GPT-2-medium embedding profiled at
2.0 s per iteration untuned, 0.73 s tuned.

A process that is already running cannot take the environment variables any more; `tune()` sets
the same two parameters through `mallopt`. Only short-lived processes should call it — a process
tuned this way keeps its peak heap for life, which is what a training rank budgets for but not what
a long-running service should do. XRONOS_MALLOC=glibc opts out everywhere (for comparison).

The price is free holes: the heap keeps every block it ever spread to, and with activations of mixed
sizes (6/12/21 MiB at seq 256) new blocks extend the heap past gaps they do not fit. A qwen2.5-1.5b
LoRA rank at seq 256 held 526 MiB at most but its heap spanned 750-870 MiB (`memwatch.heap()`,
bench/results/mem-peak-lora.md); an mmap threshold of 8 MiB cut its peak 16 % for +20 % per
iteration, glibc's default did not lower it at all. `malloc_trim(0)` once per iteration (after
the optimizer step; also before the backward) does not lower the peak either: the next iteration
touches the holes again (peak 924-1025 against 1017-1035 MiB there, 684-691 against 724 MiB on a
GPT-2-medium full fine-tune rank) and it costs +15-65 % per iteration in page faults, so ranks
do not trim. The holes are predicted instead: the profiler measures them under this setting
(`ProfileReport.heap_slack_*` fields, measured by `xronos.node.measure.heapprobe`) and the cost
model adds them to the peak (`xronos.gateway.plan.memorymodel.heap_slack`).
"""

from __future__ import annotations

import ctypes
import os

TRIM_THRESHOLD = 64 << 30
ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # from glibc's malloc.h
_MALLOPT_MAX = 2**31 - 1  # mallopt takes a C int: 64 GiB would wrap to 0, trimming on every free


def wanted() -> bool:
    return os.environ.get("XRONOS_MALLOC") != "glibc"


def tune() -> bool:
    """Apply the training ranks' malloc setting to this process; True when it took effect."""
    if not wanted():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False  # not glibc: nothing to tune
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _MALLOPT_MAX))


def trim() -> bool:
    """Hand the heap's free pages back to the kernel (glibc `malloc_trim(0)`): once, after a phase
    whose transients the process never needs again (loading the weights), so that they do not
    stay resident for the rest of its life; True when it released anything."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.malloc_trim(0))
