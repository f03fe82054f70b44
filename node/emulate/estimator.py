"""What a virtual clock advances by for one compute burst: a statistic of the recent CPU times of
the same recurring burst (pure; no clock is read here).

A TP iteration repeats the same bursts (the same segment of the same block, forward or backward,
at the same shapes) every step, and on a shared host one burst's thread CPU time varies with what
else runs (cache and memory-bandwidth contention, interrupts): 11-19 % across load conditions
where its wall time varied 4-5x (`../shared/emulation/REPORT.md`, E1). So, as SimGrid SMPI's
`SMPI_SAMPLE` reuses a benchmarked block, a burst is charged a statistic of its key's last
`window` samples instead of its own noisy sample:

- `min` (the default): the uncontended cost (the prototype's choice: 1-5 % idle floor under load
  2-9), but it sits under the mean burst (~30 % for short, memory-bound bursts), so absolute
  virtual times read low, and it depends on how finely the work is cut into bursts (see DEFAULT_MODE);
- `med`: the window median: the typical burst, additive across a split;
- `qNN`: the NN-th percentile (q25: between the two);
- `mean`, `raw` (the burst's own sample: no smoothing, as bad as quotas under load).
A key's first sample is dropped when its second arrives: the first run of a recurring burst pays
one-time costs (allocating its tensors, lazy initialisation: the first training step ran 1.5-2.5x
slow), and a median over the few samples of a short run would carry it for several iterations.
What a window statistic hides: any drift inside the window (a burst that became more expensive is
charged its old minimum until the old samples leave the window); a change of the work's shape
(a live re-shard) therefore clears the history (`forget`).
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Hashable

MODES = ("min", "med", "mean", "raw")  # and qNN, 0 <= NN <= 100
# The window minimum, chosen by measurement. Noise on a shared host only ever slows a burst, and
# the lower envelope of a few samples is steady where their median is not: with xronos's and
# uniform's layouts alternated inside one run (bench/results/interleave*.md: a live re-shard clears
# the windows, so each phase's estimates rest on a handful of samples), xronos/uniform moved
# 0.1-1.1 % between pairs under the minimum and 2.8-7.2 % under the median on the four
# heterogeneous grid cells; on the grid (bench/results/vgrid) the profiles predicted the runs'
# compute within 3.9-8.7 % under the minimum against 5.9-18.9 % under the median, and balanced
# work idled at most 1.8-2.4 % per rank at load ~1 against 2.6-3.0 % (vclock-floor-quiet.md; and
# 0.8-1.1 % against 2.1-2.2 % in vclock-floor-default.md).
# The price: absolute virtual times read low (under the mean burst), and a profile's per-layer
# minima sum below a run's per-collective minimum on fine-grained work. The median was the
# default before the within-run comparison existed.
DEFAULT_MODE = "min"
DEFAULT_WINDOW = 32


def check_mode(mode: str) -> str:
    """The mode, or ValueError naming it."""
    if mode in MODES or re.fullmatch(r"q(100|[0-9]{1,2})", mode or ""):
        return mode
    raise ValueError(f"estimator must be one of {', '.join(MODES)} or qNN (a percentile), got {mode!r}")


def statistic(samples: list[float], mode: str) -> float:
    """The mode's statistic of non-empty `samples` (oldest first)."""
    if mode == "raw":
        return samples[-1]
    if mode == "mean":
        return sum(samples) / len(samples)
    s = sorted(samples)
    if mode == "min":
        return s[0]
    q = 0.5 if mode == "med" else int(mode[1:]) / 100
    # the nearest-rank percentile: one of the samples, never an interpolation between two
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


class Estimator:
    """Per-key windows of CPU seconds and the mode's statistic over them."""

    def __init__(self, mode: str = DEFAULT_MODE, window: int = DEFAULT_WINDOW) -> None:
        self.mode = check_mode(mode)
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"estimator window must be an integer >= 1, got {window!r}")
        self.window = window
        self._hist: dict[Hashable, deque[float]] = {}
        self._first: set[Hashable] = set()  # keys whose first sample is still in the window

    def add(self, key: Hashable, seconds: float) -> float:
        """Record a sample of `key` and return the key's estimate with it."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"a CPU time must be finite and >= 0, got {seconds!r}")
        h = self._hist.get(key)
        if h is None:
            h = self._hist[key] = deque(maxlen=self.window)
            self._first.add(key)
        elif key in self._first:  # the second sample: the first (a warm-up) goes
            self._first.discard(key)
            h.popleft()
        h.append(seconds)
        return statistic(list(h), self.mode)

    def value(self, key: Hashable) -> float:
        """The key's estimate from its samples so far (0 before the first)."""
        h = self._hist.get(key)
        return statistic(list(h), self.mode) if h else 0.0

    def __contains__(self, key: Hashable) -> bool:
        """Whether `key` has a sample."""
        return key in self._hist

    def forget(self) -> None:
        self._hist.clear()
        self._first.clear()

    def __len__(self) -> int:
        return len(self._hist)
