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


class _Ledger:
    """Who pays for the process's CPU outside the computing thread (Gloo's threads) while
    asynchronous calls are in flight: at every launch and finish, the CPU the other threads took
    since the last one is split evenly among the calls then in flight, those Gloo has not completed
    yet when any has not. So with two calls in flight (forward and backward chunking keep two) each
    is charged its share, not both the whole; the charges sum to what the threads took. All
    launches and finishes come from the computing thread (autograd runs a CPU backward on the
    thread that called it)."""

    def __init__(self) -> None:
        self.live: list[_Flight] = []
        self.mark = self._others()

    @staticmethod
    def _others() -> float:
        return time.process_time() - time.thread_time()

    def reset(self) -> None:
        """Count from now: what the threads took until here is paid already."""
        self.mark = self._others()

    def advance(self) -> None:
        now = self._others()
        spent, self.mark = max(0.0, now - self.mark), now
        payers = [f for f in self.live if not f.completed()] or self.live
        for f in payers:
            f.others += spent / len(payers)


_LEDGER = _Ledger()


class _Flight:
    """An all-reduce Gloo runs in its own threads (`async_op=True`) while this rank computes: the
    `Flight` a clock's `launch` gets. The call's CPU, which a clock charges to the rank's box as
    for a blocking call, is the launching call's, its share of Gloo's threads' while it flew
    (`_Ledger`: the compute between launch and wait is the computing thread's and not the call's)
    and the wait's."""

    def __init__(self, t: torch.Tensor, slots: torch.Tensor | None, op: str, pg: dist.ProcessGroup) -> None:
        _LEDGER.advance()
        c0 = time.process_time()
        self.t, self.n, self.slots = t, t.numel(), slots
        self.buf = t
        if slots is not None and t.dtype in _SLOT_DTYPES:  # the slots ride in the same call, as all_reduce's
            self.buf = torch.cat([t.view(-1), slots.to(t.dtype)])
        self.works = [dist.all_reduce(self.buf, op=_OPS[op], group=pg, async_op=True)]
        if slots is not None and self.buf is t:
            self.works.append(dist.all_reduce(slots, group=pg, async_op=True))
        self.launch_cpu = time.process_time() - c0
        self.others = 0.0
        _LEDGER.reset()  # the threads' CPU during the launch is in launch_cpu
        _LEDGER.live.append(self)

    def completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def finish(self) -> tuple[torch.Tensor | None, float]:
        t0 = time.thread_time()
        try:
            for w in self.works:
                w.wait()
        finally:
            _LEDGER.advance()
            _LEDGER.live.remove(self)
        cpu = self.launch_cpu + self.others + (time.thread_time() - t0)
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
