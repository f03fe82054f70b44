"""`python -m xronos.node.box.boxed MODULE ARGS...`: run MODULE as `__main__` inside the box the node gave
it (`node/box/limits.py`): dies with its parent, joins its cgroups, takes its rlimits — all before the
module's first import, so its limits hold from its first allocation and bind what it starts.

The box comes in the environment (`XRONOS_BOX`, JSON): `parent` (the pid that started it),
`cgroups` (cgroup.procs files to join), `data` (RLIMIT_DATA bytes), `nproc` (RLIMIT_NPROC). Without
it the module just runs, dying with its parent."""

from __future__ import annotations

import ctypes
import json
import os
import resource
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1


def enter(box: dict) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not glibc Linux: the node's process-group kill still ends it
    parent = box.get("parent")
    if parent is not None and os.getppid() != parent:
        os._exit(137)  # the parent died before the death signal was armed: as if it had fired
    for procs in box.get("cgroups", []):
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    if "data" in box:
        resource.setrlimit(resource.RLIMIT_DATA, (int(box["data"]), int(box["data"])))
    if "nproc" in box:
        resource.setrlimit(resource.RLIMIT_NPROC, (int(box["nproc"]), int(box["nproc"])))


def main() -> None:
    if len(sys.argv) < 2:
        print("usage: python -m xronos.node.box.boxed MODULE ARGS...", file=sys.stderr)
        sys.exit(2)
    enter(json.loads(os.environ.pop("XRONOS_BOX", "{}")))  # not inherited: a grandchild gets its own
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
