"""A rank of tests/node/test_overlap_world.py: compute, an all-reduce, compute, on a virtual clock;
the all-reduce blocking or launched before the second compute and waited for after it, alternate
iterations. Writes per iteration the mode, its virtual start and time, the compute before and
after the all-reduce (the clock's account), a launched call's own CPU charge and whether the sum
came out exact (JSON)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from tests.node.tp.tp_world import worker_setup  # noqa: E402
from xronos.node.emulate.link import Link  # noqa: E402
from xronos.node.emulate.vclock import Box, VirtualClock  # noqa: E402


def main() -> None:
    job, rank, group = worker_setup(sys.argv)
    clock = VirtualClock(Box(1.0, Link(job["bandwidth_Bps"], 0.0), "min"))
    group.clock = clock
    a = torch.randn(192, 192) / 192 ** 0.5

    def work(n: int) -> None:
        y = a
        for _ in range(n):
            y = (y @ a).tanh_()

    rows = []
    for it in range(job["iters"]):
        overlap = it % 2 == 1
        x = torch.full((32, 256), float(rank + 1))  # 32 KiB; the sum is exact in fp32
        t0, c0 = group.now(), clock.account.compute
        work(job["before"])
        if overlap:
            pending = group.all_reduce_async(x)
            c1 = clock.account.compute
            own = pending.ticket.own_cost  # the call's CPU the clock charges this rank at the wait
            work(job["after"])
            pending.wait()
        else:
            group.all_reduce(x)
            c1 = clock.account.compute
            own = 0.0
            work(job["after"])
        group.settle()
        t1, c2 = group.now(), clock.account.compute
        rows.append({"overlap": overlap, "t0": t0, "iteration_s": t1 - t0, "before_s": c1 - c0, "after_s": c2 - c1,
                     "own_s": own,
                     "exact": bool(torch.equal(x, torch.full_like(x, sum(range(1, job["world"] + 1)))))})
        group.barrier(timed=False)
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
