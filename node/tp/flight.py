"""An all-reduce in flight: what `TPGroup.all_reduce_async` starts (`_Flight`, handed to the clock's
`launch`) and returns (`Pending`, whose `wait` lands it through the group and its clock)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from xronos.node.tp.clock import Meet

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
_SLOT_DTYPES = (torch.float32, torch.float64)  # tensors whose all-reduce can carry a clock's slots


class _Flight:
    """An all-reduce Gloo runs in its own threads (`async_op=True`) while this rank computes: the
    `Flight` a clock's `launch` gets. The call's CPU, which a clock charges to the rank's box as
    for a blocking call, is the launching call's, Gloo's threads' while it flew (the process's CPU
    minus this thread's: the compute between launch and wait is the thread's and not the call's;
    with several calls in flight each counts the others' too: an upper bound) and the wait's."""

    def __init__(self, t: torch.Tensor, slots: torch.Tensor | None, op: str, pg: dist.ProcessGroup) -> None:
        c0 = time.process_time()
        self.t, self.n, self.slots = t, t.numel(), slots
        self.buf = t
        if slots is not None and t.dtype in _SLOT_DTYPES:  # the slots ride in the same call, as all_reduce's
            self.buf = torch.cat([t.view(-1), slots.to(t.dtype)])
        self.works = [dist.all_reduce(self.buf, op=_OPS[op], group=pg, async_op=True)]
        if slots is not None and self.buf is t:
            self.works.append(dist.all_reduce(slots, group=pg, async_op=True))
        self.launch_cpu = time.process_time() - c0
        self.proc0, self.thread0 = time.process_time(), time.thread_time()

    def finish(self) -> tuple[torch.Tensor | None, float]:
        proc, thread = time.process_time(), time.thread_time()
        others = max(0.0, (proc - self.proc0) - (thread - self.thread0))
        for w in self.works:
            w.wait()
        cpu = self.launch_cpu + others + (time.process_time() - proc)
        if self.buf is self.t:
            return self.slots, cpu
        self.t.view(-1).copy_(self.buf[:self.n])
        return self.buf[self.n:].to(torch.float64), cpu


class Pending:
    """An all-reduce in flight (`TPGroup.all_reduce_async`): `wait()` once before reading or
    writing its tensor; it returns the tensor, reduced in place."""

    def __init__(self, group: Any, t: torch.Tensor, meet: Meet, ticket: object | None) -> None:
        # group: the TPGroup that launched it (not imported: group.py imports this module)
        self.group, self.t, self.meet, self.ticket = group, t, meet, ticket
        self.done = False

    def wait(self) -> torch.Tensor:
        if not self.done:
            self.done = True
            self.group._land(self)
        return self.t
