"""Measuring a layer's memory while it trains: activations, temporaries and resident state.

Three instruments, all measured on the real tensors of a real fine-tuning iteration:

- **Activations (M_a)** — `SavedTensorMeter` installs `torch.autograd.graph.saved_tensors_hooks`
  and records every tensor autograd packs for backward, counted once per underlying storage
  (views share one). Storages of parameters are excluded: a weight saved by `linear` for its
  backward is already counted in M_w. Each saved storage is attributed to the innermost region
  (sub-layer) running when it was packed; a partitioned region's own *input* is attributed to the
  replicated remainder instead, because that tensor has the full hidden width on every rank (it is
  what the "copy" before a column-parallel layer hands in), so it does not shrink with p.
- **Temporaries (M_t)** — `AllocTrace` runs the iteration under torch's profiler with
  `profile_memory=True`, which reports every allocation and free of c10's CPU allocator with a
  timestamp, and marks phases/regions with `record_function`. Replaying the events gives the
  allocated-bytes curve L(t); a phase's temporary peak is `max L(t) - max(L(start), L(end))` over
  the phase: the excess above everything that is alive before or after it (activations, outputs,
  gradients, optimizer state), i.e. exactly the short-lived buffers of Eq. 10.
  Limits: memory a kernel library allocates outside c10 (oneDNN/MKL scratch pads, OpenMP thread
  stacks) is invisible, and so is allocator fragmentation; both make M_t a lower bound of RSS
  growth, which the planner's reserve is there to cover. The first is small (glibc's own in-use
  peak matched c10's to the MiB on a LoRA seq-256 rank); the second is not at long sequence: that
  rank's heap held 515-635 MiB of free holes beside 526 MiB in use (bench/results/mem-peak-lora.md).
- **Heap slack** — glibc's heap span (`memwatch.heap()`) after the iteration minus its in-use
  peak during it (bytes in use before + c10's peak above that level, `AllocTrace.peak_bytes`):
  the free holes that stay resident under the ranks' allocator setting (`node/measure/allocator.py`).
  The heap grows for a few iterations before it is flat, so the iteration is repeated until its
  span stops growing, then run once more under the profiler (`node/measure/heapprobe.py`, at one and
  two blocks, each in a fresh process).
- **Resident state (M_w)** — the bytes of the unique storages of every parameter, its gradient
  and its optimizer state tensors, read after a real optimizer step (so AdamW's exp_avg and
  exp_avg_sq exist and are counted as allocated, not as assumed).
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.profiler import record_function

from xronos.node.measure import allocator, memwatch

# Kineto writes a "USDT: ... profiler_start/stop" line to stderr around every window it traces:
# noise in `xronos profile`'s output and a node's journal. It reads the level when the profiler
# first starts, so setting it here (before any AllocTrace) is enough; a user's own setting wins.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

REST = "blk.rest"  # the replicated remainder of a block


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def state_bytes(params: Iterable[nn.Parameter], optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the unique storages of params, their grads and their optimizer state."""
    seen: dict[tuple[int, int], int] = {}
    for p in params:
        tensors = [p, p.grad]
        if optimizer is not None:
            tensors += [v for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t is not None and t.numel() > 0 and t.dim() > 0:  # skip scalar step counters
                key = storage_key(t)
                seen[key] = key[1]
    return sum(seen.values())


@dataclass
class SavedTensorMeter:
    """Bytes saved for backward per layer key, unique per storage, `exclude`d storages skipped.

    `current()` names the layer running when a tensor is packed; `inputs[key]` holds the
    storages a partitioned layer received as input — those count as `REST` (replicated).
    """

    exclude: set[tuple[int, int]]
    current: Callable[[], str] = lambda: REST
    inputs: dict[str, set[tuple[int, int]]] = field(default_factory=dict)
    by_region: dict[str, int] = field(default_factory=dict)
    _seen: set[tuple[int, int]] = field(default_factory=set)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in self.exclude and key not in self._seen and key[1] > 0:
            self._seen.add(key)
            region = self.current()
            if key in self.inputs.get(region, ()):
                region = REST
            self.by_region[region] = self.by_region.get(region, 0) + key[1]
        return t

    @contextmanager
    def __call__(self) -> Iterator[SavedTensorMeter]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self

    @property
    def total(self) -> int:
        return sum(self.by_region.values())


class AllocTrace:
    """Allocator events of a window, and the temporary peak of each marked interval."""

    def __init__(self) -> None:
        self._prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self.mem: list[tuple[int, int]] = []  # (ns, +/- bytes), time order
        self.marks: list[tuple[str, int, int]] = []  # (name, start ns, end ns)

    def __enter__(self) -> AllocTrace:
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._prof.__exit__(*exc)
        if exc[0] is not None:
            return
        for e in self._prof.profiler.kineto_results.events():  # type: ignore[union-attr]
            name = e.name()
            if name == "[memory]":
                self.mem.append((e.start_ns(), e.nbytes()))
            elif name.startswith("xr::"):
                self.marks.append((name, e.start_ns(), e.end_ns()))
        self.mem.sort()

    def peak_bytes(self) -> int:
        """The window's highest allocated level above its start (c10's bytes in use)."""
        level = peak = 0
        for _, nbytes in self.mem:
            level += nbytes
            peak = max(peak, level)
        return peak

    def temp_bytes(self, name: str, skip: tuple[str, ...] = ()) -> int:
        """Largest excess over the interval's start/end levels, across intervals marked `name`;
        peaks reached inside intervals marked with a name in `skip` are not counted."""
        holes = [(a, b) for m, a, b in self.marks if m in skip]
        best = 0
        for mark_name, a, b in self.marks:
            if mark_name != name:
                continue
            level, peak, start = 0, 0, None
            for ns, nbytes in self.mem:
                if ns >= a and start is None:
                    start = peak = level
                if ns > b:
                    break
                level += nbytes
                if start is not None and not any(x <= ns <= y for x, y in holes):
                    peak = max(peak, level)
            if start is not None:
                best = max(best, peak - max(start, level))
        return best


@contextmanager
def mark(name: str) -> Iterator[None]:
    """A phase marker (`xr::name`) AllocTrace can find; costs nothing when not profiling."""
    with record_function(f"xr::{name}"):
        yield


# --- the process beside its models ----------------------------------------------------------
def runtime_rss() -> int:
    """This process's resident set with every model gone: warm (torch's kernels, thread pools and
    libraries initialised by the iterations just run), its freed heap handed back to the kernel
    (`allocator.trim`), so what is left is what a training rank's process holds besides its
    model. Measured: 353 MiB after profiling a GPT-2-Medium shape, 254 MiB right after the
    imports; a rank's own process held ~100 MiB more than at its start once it had trained."""
    gc.collect()
    allocator.trim()
    return memwatch.status()["VmRSS"]


def owner_rss() -> int:
    """What rank 0's data stack (`datasets`, with pyarrow and pandas; the trainer's owner imports it
    to read the data) adds to the resident set: 86 MiB here. 0 when this process has it already
    (then it is in `runtime_rss`). The tokenizer (21 MiB for a 50k-word vocabulary) and the
    encoded rows are not measured."""
    if "datasets" in sys.modules:
        return 0
    before = memwatch.status()["VmRSS"]
    import datasets  # noqa: F401

    return max(0, memwatch.status()["VmRSS"] - before)
