"""Run a worker script as N real processes joined in one Gloo group on loopback.

Jobs go to workers as a JSON file and results come back as safetensors/JSON files: nothing of ours
crosses a process boundary by pickle.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from xronos.common.ports import free_port


def run_world(script: Path, world: int, job: dict[str, Any], workdir: Path, timeout: float = 240) -> None:
    """Start `world` ranks of `script JOB.json RANK` and wait; fail with every failing rank's stderr."""
    workdir.mkdir(parents=True, exist_ok=True)
    job = dict(job, world=world, port=free_port(), out=str(workdir))
    job_file = workdir / "job.json"
    job_file.write_text(json.dumps(job))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    logs = [(workdir / f"rank{r}.log").open("w+") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, str(script), str(job_file), str(r)],
                              stdout=logs[r], stderr=subprocess.STDOUT, env=env) for r in range(world)]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        report = []
        for r, code in failed:
            logs[r].seek(0)
            report.append(f"--- rank {r} exit {code} ---\n{logs[r].read()[-4000:]}")
        raise AssertionError("world failed:\n" + "\n".join(report))
    for f in logs:
        f.close()


def worker_setup(argv: list[str]):
    """In a worker: (job dict, rank, TPGroup). World of one uses TPGroup.single() (no Gloo)."""
    import torch

    from xronos.node.tp.group import TPGroup

    torch.set_num_threads(1)
    job = json.loads(Path(argv[1]).read_text())
    rank = int(argv[2])
    if job["world"] == 1:
        return job, rank, TPGroup.single()
    group = TPGroup.join(rank, job["world"], "127.0.0.1", job["port"], timeout_s=90)
    # End as every real rank does (`TPGroup.leave`, then `runtime.exit_process`): a process torn
    # down by the interpreter with Gloo's threads alive aborts now and then ("terminate called
    # without an active exception"), which failed these tests under load. A rank that failed
    # exits as usual instead (non-zero): its peers may never reach the barrier.
    failed = []
    hook = sys.excepthook
    sys.excepthook = lambda *exc: (failed.append(True), hook(*exc))

    def end() -> None:
        if not failed:
            from xronos.node.rank.spawn import exit_process

            group.leave()
            exit_process(0)

    atexit.register(end)
    return job, rank, group
