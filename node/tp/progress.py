"""Let a call in flight move while the rank computes: Gloo's threads ahead of the computing thread.

An all-reduce launched asynchronously (`TPGroup.all_reduce_async`) is moved on by Gloo's own
threads, step by step, each step waiting for the network. On a box whose core also computes,
every time such a thread is woken it waits for the computing thread to yield the core: the
scheduler lets a woken thread of the same class in at the end of the running one's slice. Measured
on this host (`bench/stack_probe.py`: two ranks pinned one per core, a GEMM burst with the call in
flight), a 786 kB all-reduce that takes 5.9 ms with the core free completed 11.6 ms after its
launch beside the burst; with Gloo's threads at SCHED_FIFO priority 1 it completed in 6.4 ms, as
a real-time thread takes the core as soon as it is woken. Those threads mostly wait on sockets,
so they take the core for the few microseconds a step needs and give it back.

With `XRONOS_COMM_THREADS=fifo` the first asynchronous launch raises the process's Gloo threads
(those that appeared while a process group was made: `made`) to SCHED_FIFO 1. That needs the right
to: root, CAP_SYS_NICE, or an RLIMIT_RTPRIO of at least 1 (systemd: `LimitRTPRIO=1` and
`RestrictRealtime=no`, which the node's unit does not grant by default: docs/install.md). Without it
the attempt is logged once and the run goes on, its calls moving only at the computing thread's
slice ends.

It is off by default (`off`), an experiment. A real-time thread is not time-sliced with normal
ones, and Gloo's TCP loop does not always sleep. With three ranks on two cores (`bench/overlap.py`'s
demo cell) two ranks' loops spun at 93 % of a core each, the third rank's threads — real-time too,
at the same priority — never got a core, and the run stood still for 14 minutes. Even with one rank
pinned per core (`bench/overlap_wall.py`, 2026-12-07) iterations then took up to twice as long
now and then, overlap off included: the loop took its own rank's core from the computing thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import structlog

log = structlog.get_logger(__name__)

ENV = "XRONOS_COMM_THREADS"
MODES = ("off", "fifo")
PRIORITY = 1  # the lowest real-time priority: above every normal thread, below the kernel's own

_made: set[int] = set()  # Gloo's threads: those that appeared while a process group was made
_done: set[int] = set()  # those already raised (or found gone)
_refused = False  # raising one was refused: not tried again

T = TypeVar("T")


def mode() -> str:
    """`XRONOS_COMM_THREADS`, checked: `off` (the default) or `fifo`."""
    return parse(os.environ.get(ENV, "off"))


def parse(text: str) -> str:
    """A value of `XRONOS_COMM_THREADS`; ValueError naming the variable and the value."""
    value = text.strip().lower() or "off"
    if value not in MODES:
        raise ValueError(f"{ENV} must be one of {', '.join(MODES)}, got {text!r}")
    return value


def _threads() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # not Linux: nothing to raise
        return set()


def made(make: Callable[[], T]) -> T:
    """Make a process group (`make()`) and note the threads that appeared meanwhile as Gloo's."""
    before = _threads()
    out = make()
    _made.update(_threads() - before)
    return out


def promote() -> int:
    """With `XRONOS_COMM_THREADS=fifo`, raise the noted threads not raised yet to SCHED_FIFO 1 (once
    each; nothing after a refusal). Returns how many were raised now."""
    global _refused
    todo = _made - _done
    if not todo or _refused or mode() == "off" or not hasattr(os, "sched_setscheduler"):
        return 0
    raised = 0
    for tid in sorted(todo):
        try:
            os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(PRIORITY))
        except ProcessLookupError:  # gone (a group torn down)
            pass
        except PermissionError as exc:
            _refused = True
            log.warning("tp.comm_threads_not_raised", reason=str(exc), threads=len(todo),
                        hint="root, CAP_SYS_NICE or LimitRTPRIO=1 with RestrictRealtime=no; calls in flight "
                             f"then move only when the computing thread yields the core ({ENV}=off: not tried)")
            return raised
        else:
            raised += 1
        _done.add(tid)
    if raised:
        log.info("tp.comm_threads_raised", threads=raised, policy="SCHED_FIFO", priority=PRIORITY)
    return raised
