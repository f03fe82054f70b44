"""The gradient all-reduce of data parallelism: a DDP communication hook that *sums* the buckets.

torch's default hook divides every bucket by the world size (DDP assumes each rank's loss is a
mean over equal shares). Our ranks' losses are already their parts of the global mean
(`rows.share_loss`), so the hook sums. Multiplying each loss by the world size instead would undo
the division, but costs two fp32 roundings of every gradient element for world sizes that are not
powers of two; and a hook is needed anyway: it is where the gradient all-reduce meets the clock.

Two ways to run a bucket's all-reduce (`mode`):

- `overlap` — asynchronous Gloo all-reduce; DDP goes on with the backward pass while it runs and
  waits for every bucket at the end of backward (torch's own overlap of communication with
  computation). Each bucket's issue and completion times are recorded (`BucketSpan`) on the group's
  clock; only a wall clock is meaningful here, as the completion is read on Gloo's thread.
- `clocked` — each bucket through `TPGroup.all_reduce` (tag `grad`), so the group's clock sees it as
  any other collective: an emulated box's virtual clock advances by it and resolves it from the
  ranks' arrivals. It blocks backward while it runs: the virtual clock does not (yet) model a
  collective that overlaps compute, so it books the all-reduce as a barrier (an upper bound of
  the overlapped time). The clock issue covers the asynchronous case; until then this is the seam.

`auto` picks `overlap` on a wall clock and `clocked` on any other.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch
import torch.distributed as dist

from xronos.node.tp.group import TPGroup

MODES = ("auto", "overlap", "clocked")
TAG = "grad"  # the segment tag of the gradient all-reduce on a group's timeline


class BucketSpan(NamedTuple):
    """One bucket's all-reduce on the group's clock."""

    index: int  # DDP's bucket index (the last bucket holds the first layers' gradients)
    nbytes: int
    start: float  # when the hook issued it
    seconds: float  # until its result was there (overlap: on Gloo's thread; clocked: the collective)


class GradSync:
    """The hook's state: the data-parallel group, the mode and the buckets' spans since the last
    `drain`."""

    def __init__(self, group: TPGroup, mode: str = "auto") -> None:
        if mode not in MODES:
            raise ValueError(f"gradient sync mode must be one of {MODES}, got {mode!r}")
        if mode == "auto":
            mode = "overlap" if group.clock.name == "wall" else "clocked"
        self.group = group
        self.mode = mode
        self._spans: list[BucketSpan] = []
        self._lock = threading.Lock()  # overlap: spans are appended on Gloo's thread

    def drain(self) -> list[BucketSpan]:
        with self._lock:
            out, self._spans = sorted(self._spans, key=lambda s: s.start), []
        return out

    def _add(self, span: BucketSpan) -> None:
        with self._lock:
            self._spans.append(span)

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """All-reduce (sum) one bucket in this state's mode; the future DDP waits for."""
        buf = bucket.buffer()
        nbytes = buf.numel() * buf.element_size()
        index = bucket.index()
        clock = self.group.clock
        start = clock.now()
        if self.mode == "clocked":
            with self.group.segment(TAG):
                self.group.all_reduce(buf)
            self._add(BucketSpan(index, nbytes, start, clock.now() - start))
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            fut.set_result(buf)
            return fut
        work = dist.all_reduce(buf, group=self.group.pg, async_op=True)

        def done(f: torch.futures.Future) -> torch.Tensor:
            self._add(BucketSpan(index, nbytes, start, clock.now() - start))
            return f.value()[0]

        return work.get_future().then(done)


def sum_hook(state, bucket):  # noqa: ANN001, ANN201
    """The hook DDP calls (`ddp.register_comm_hook(grad_sync, sum_hook)`). Left unannotated: DDP
    checks a hook's annotations against the real classes, and this module's are strings."""
    return state.run(bucket)
