"""A rank of tests/node/test_vclock_world.py: the same synthetic work on every rank between
collectives of every kind, on a virtual clock of the job's speed; writes its account and, per
collective, its arrival and departure (JSON)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from tests.node.tp.tp_world import worker_setup  # noqa: E402
from xronos.node.emulate.link import Link  # noqa: E402
from xronos.node.emulate.vclock import Box, VirtualClock  # noqa: E402


def main() -> None:
    job, rank, group = worker_setup(sys.argv)
    clock = VirtualClock(Box(job["speeds"][rank], Link(job["bandwidth_Bps"], job["latency_s"]), job["estimator"]))
    group.clock = clock
    a = torch.randn(job.get("n", 192), job.get("n", 192)) / job.get("n", 192) ** 0.5
    x = torch.zeros(32, 256)
    ids = torch.zeros(4, 16, dtype=torch.long)

    def work() -> None:  # the same CPU work on every rank
        y = a
        for _ in range(job["gemms"]):
            y = (y @ a).tanh_()
        if job["sleep_rank"] == rank:
            time.sleep(job["sleep_s"])  # wall time only: no CPU, no virtual time

    rows, wall = [], []
    for it in range(job["iters"]):
        group.drain_spans()
        t0, w0 = group.now(), time.perf_counter()
        for name, call in (("all_reduce", lambda: group.all_reduce(x)),
                           ("all_reduce_max", lambda: group.all_reduce(torch.zeros(3, dtype=torch.float64), "max")),
                           ("broadcast", lambda: group.broadcast(ids, 0)),
                           ("all_gather", lambda: group.all_gather(torch.zeros(8))),
                           ("barrier", lambda: group.barrier())):
            work()
            call()
        if not job.get("p2p", True):
            pass
        elif rank == 0:  # point to point: rank 0 sends to the last rank
            work()
            group.send(x, job["world"] - 1)
        elif rank == job["world"] - 1:
            work()
            group.recv(torch.empty_like(x), 0)
        work()
        group.settle()
        t1 = group.now()
        if job.get("end_barrier"):
            group.barrier(timed=False)
        spans = group.drain_spans()
        rows.append({"iteration_s": t1 - t0, "spans": [[s.name, s.start, s.seconds] for s in spans]})
        wall.append(time.perf_counter() - w0)
    acc = clock.account
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps(
        {"rows": rows, "wall": wall, "compute": acc.compute, "idle": acc.idle, "comm": acc.comm, "t": clock.t}))


if __name__ == "__main__":
    main()
