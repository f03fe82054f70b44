"""Live re-split of a data-parallel plan's batch: when to give the groups new rows. Pure (no torch, no I/O).

A data-parallel plan (`Plan.shares`: rows of each global batch per data-parallel group, every group
at the same TP layout) changes live by a new split of the batch, which moves no weights (every rank
holds its whole shard and the same optimizer state whatever its rows): so a re-split costs
nothing, and the question is only whether the new split is faster, and whether the evidence says so.

**The model.** A group's iteration is its slowest TP rank's compute (`IterationMetrics.compute_s`;
the groups wait for each other only in the gradient all-reduce, whose exposed part does not depend
on the split). Its time at r rows, as the planner prices a mesh's groups (`costmodel.rows_factor`):

    t_g(r) = c_g * (a_g + (1 - a_g) * r / B_p)        (0 with no rows)

with a_g the share of the iteration a rank pays whatever its rows (`NodeCost.rows_fixed`, from the
profile's rows probe) of the group's rank that is slowest in the profile, and B_p the profile's rows.
`c_g` (the group's time at the profile's rows) is refitted from what the group measured: the median
of its last `window` complete steps at its current rows r_g > 0 is t_g(r_g), so c_g = median /
(a_g + (1 - a_g) r_g / B_p). A group with 0 rows measures nothing worth refitting (its ranks only
step their optimizers): it keeps its last measured c_g (as the TP policy keeps a node's last speed
for a kind it holds none of: a group that lost its rows because it was slow must not look fast the
moment it stops measuring), or, never measured, its profile's estimate (`GroupCost.full_s`) scaled
by the median measured-over-profiled ratio of the groups that have rows (the boxes as the clock
sees them now). So a group that went to 0 rows gets rows back only when the others turn slower
than it was, not when it itself speeds up (it is not measured): as the TP policy's 0-share kinds.

**The split.** Each row in turn to the group that would finish it soonest (`dpcost.greedy_rows`:
the least slowest group's time for nondecreasing t_g), no group beyond the rows its memory allows
(`max_rows`, the caller's from the memory model; never below its current rows, which run).

**The bar** (`rebalance.PolicyConfig`, the TP policy's): the first `warmup` steps at the start and
after every re-split are not measured; a decision needs `settle` samples of every group with rows;
every `interval` steps the current split's predicted time (the slowest group's median) is compared
with the new split's, and the re-split is ordered when the predicted gain exceeds `threshold` plus
`noise_margin` relative standard errors of the slowest group's median, at `confirm` evaluations in
a row. For `cooldown` steps after a re-split (doubling up to `max_cooldown` when re-splits follow
each other) only a re-split that carries the last one on is made (no group gets back rows it gave
away, nor gives away rows it got): never a step back on the noise of a short median. No payback
test: nothing moves.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from xronos.gateway.plan.costmodel import SEGMENTS, NodeCost, layout_shares, segment_times
from xronos.gateway.plan.dpcost import greedy_rows
from xronos.gateway.plan.rebalance import PolicyConfig
from xronos.protocol.layout import Layout


@dataclass(frozen=True)
class GroupCost:
    """A data-parallel group's profile: its time at the profile's rows and the share of it paid
    whatever the rows."""

    full_s: float  # sum over the barrier segments of the slowest TP rank's time, at B_p rows
    fixed: float  # a: `NodeCost.rows_fixed` of the group's slowest rank (in [0, 1))

    def at(self, rows: int, profile_rows: int, scale: float = 1.0) -> float:
        """t(rows) with c = `full_s` x `scale`."""
        return 0.0 if rows == 0 else self.full_s * scale * (self.fixed + (1 - self.fixed) * rows / profile_rows)


def group_costs(nodes: Sequence[NodeCost], layout: Layout, groups: int) -> list[GroupCost]:
    """Each group's `GroupCost` from its nodes' profiles (`nodes` in rank order: group g holds
    ranks g*tp..(g+1)*tp-1, rank r at TP rank r % tp of `layout`)."""
    tp = layout.world_size
    if len(nodes) != tp * groups:
        raise ValueError(f"{len(nodes)} nodes for {groups} data-parallel groups of {tp} ranks")
    out = []
    for g in range(groups):
        segs = [segment_times(n, layout_shares(layout, i)) for i, n in enumerate(nodes[g * tp:(g + 1) * tp])]
        full = sum(max(s[k] for s in segs) for k in SEGMENTS)
        slow = max(range(tp), key=lambda i: sum(segs[i].values()))
        out.append(GroupCost(full, nodes[g * tp + slow].rows_fixed))
    return out


@dataclass(frozen=True)
class Resplit:
    """A decision to re-split: at `step`'s boundary, from `old` rows per group to `new`."""

    step: int
    old: tuple[int, ...]
    new: tuple[int, ...]
    predicted_old_s: float  # the slowest group's compute per iteration, refitted, at `old`
    predicted_new_s: float
    predicted_group_s: tuple[float, ...]  # each group's at `new`
    scale: tuple[float, ...]  # each group's measured over profiled time (its c_g / full_s)
    reason: str

    @property
    def gain(self) -> float:
        return (self.predicted_old_s - self.predicted_new_s) / self.predicted_old_s


def relative_error(samples: Sequence[float]) -> float:
    """The relative standard error of a median (as `refit.noise`: 1.25 x sigma / sqrt(n), sigma
    from the interquartile range); 0 below 3 samples."""
    if len(samples) < 3:
        return 0.0
    med = statistics.median(samples)
    lo, _, hi = statistics.quantiles(samples, n=4, method="inclusive")
    return 1.25 * (hi - lo) / 1.349 / math.sqrt(len(samples)) / med if med > 0 else 0.0


def carries_on(previous: Sequence[int] | None, current: Sequence[int], new: Sequence[int]) -> bool:
    """`new` continues the re-split previous -> current: no group's rows go back the way they came."""
    if previous is None:
        return False
    return all((b - c) * (c - a) >= 0 for a, c, b in zip(previous, current, new))


@dataclass
class Resplitter:
    """The policy's state over a data-parallel run. Feed `observe` each complete step's group
    times, ask `decide` at boundaries (module docstring)."""

    shares: tuple[int, ...]  # the current rows per group
    profile_rows: int  # B_p: the rows the profiles were measured at
    base: Sequence[GroupCost]  # group order
    max_rows: Sequence[int] | None = None  # per group, the most rows its memory allows (None: any)
    config: PolicyConfig = field(default_factory=PolicyConfig)
    last_reason: str = field(init=False, default="warming up")
    resplits: list[Resplit] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.shares = tuple(self.shares)
        n = len(self.shares)
        if n < 1 or len(self.base) != n:
            raise ValueError(f"{len(self.base)} group costs for {n} shares {list(self.shares)}")
        if any(isinstance(r, bool) or r < 0 for r in self.shares) or sum(self.shares) < 1:
            raise ValueError(f"shares {list(self.shares)}: rows per group must be >= 0, at least one in all")
        if isinstance(self.profile_rows, bool) or self.profile_rows < 1:
            raise ValueError(f"profile rows must be >= 1, got {self.profile_rows}")
        for g, c in enumerate(self.base):
            if not (c.full_s > 0 and math.isfinite(c.full_s)) or not 0 <= c.fixed < 1:
                raise ValueError(f"group {g}: profile time must be finite and > 0 and its fixed share in [0, 1), "
                                 f"got {c.full_s}, {c.fixed}")
        if self.max_rows is not None and len(self.max_rows) != n:
            raise ValueError(f"{len(self.max_rows)} row limits for {n} groups")
        self.samples = [deque(maxlen=self.config.window) for _ in range(n)]
        self.last_scale: list[float | None] = [None] * n  # each group's scale when it last had rows
        self._skip = self.config.warmup
        self._measured = 0
        self._streak = 0
        self._wait = 0
        self._cooldown = self.config.cooldown
        self._since = math.inf
        self._previous: tuple[int, ...] | None = None

    @property
    def batch(self) -> int:
        return sum(self.shares)

    def observe(self, group_s: Sequence[float]) -> None:
        """One complete step under the current shares: each group's compute seconds (its slowest
        TP rank's `compute_s`)."""
        if len(group_s) != len(self.shares):
            raise ValueError(f"{len(group_s)} groups measured, the split has {len(self.shares)}")
        for g, t in enumerate(group_s):
            if not (t >= 0 and math.isfinite(t)):
                raise ValueError(f"group {g}: compute seconds must be finite and >= 0, got {t}")
        self._since += 1
        self._wait = max(0, self._wait - 1)
        if self._skip > 0:
            self._skip -= 1
            return
        for g, t in enumerate(group_s):
            if self.shares[g] > 0:
                self.samples[g].append(t)
        self._measured += 1

    def scales(self) -> list[float] | None:
        """Each group's measured over profiled time (c_g / full_s); a 0-row group its last measured
        one, or never measured the median of the others'. None until every group with rows has a sample."""
        B = self.profile_rows
        measured = {}
        for g, (r, q) in enumerate(zip(self.shares, self.samples)):
            if r > 0:
                if not q:
                    return None
                measured[g] = statistics.median(q) / self.base[g].at(r, B)
        typical = statistics.median(measured.values())
        return [measured[g] if g in measured else self.last_scale[g] if self.last_scale[g] is not None else typical
                for g in range(len(self.shares))]

    def times(self, rows: Sequence[int], scales: Sequence[float]) -> list[float]:
        return [c.at(r, self.profile_rows, s) for c, r, s in zip(self.base, rows, scales)]

    def split(self, scales: Sequence[float]) -> tuple[int, ...]:
        """The split with the least slowest group (each within its row limit)."""
        limit = [max(m, r) for m, r in zip(self.max_rows, self.shares)] if self.max_rows is not None else None

        def time_of(g: int, r: int) -> float:
            if limit is not None and r > limit[g]:
                return math.inf
            return self.base[g].at(r, self.profile_rows, scales[g])

        return tuple(greedy_rows(time_of, len(self.shares), self.batch))

    def decide(self, step: int) -> Resplit | None:
        """At the boundary before `step`: a Resplit to apply there, or None (`last_reason` says why)."""
        cfg = self.config
        if self._skip > 0 or self._measured == 0:
            self.last_reason = "warming up"
            return None
        need_n = cfg.settle
        short = [g for g, (r, q) in enumerate(zip(self.shares, self.samples)) if r > 0 and len(q) < need_n]
        if short:
            self._streak = 0
            self.last_reason = f"settling: groups {short} have fewer than {need_n} samples at their rows"
            return None
        if self._measured % cfg.interval:
            return None
        scales = self.scales()
        assert scales is not None  # every group with rows has samples (settled)
        current = max(self.times(self.shares, scales))
        new = self.split(scales)
        predicted = self.times(new, scales)
        planned = max(predicted)
        gain = (current - planned) / current if current > 0 else 0.0
        slowest = max(range(len(self.shares)), key=lambda g: self.times(self.shares, scales)[g])
        need = cfg.threshold + cfg.noise_margin * relative_error(self.samples[slowest])
        if new == self.shares or gain <= need:
            self._streak = 0
            self.last_reason = (f"kept rows {list(self.shares)}: predicted gain {100 * gain:.1f}% <= {100 * need:.1f}% "
                                f"(threshold {100 * cfg.threshold:.1f}% + measurement noise)")
            return None
        if self._wait > 0 and not carries_on(self._previous, self.shares, new):
            self._streak = 0
            self.last_reason = (f"cooling down ({self._wait} iterations left): rows {list(new)} would take back "
                                "part of the last re-split")
            return None
        self._streak += 1
        if self._streak < cfg.confirm:
            self.last_reason = f"kept rows {list(self.shares)}: gain {100 * gain:.1f}% seen {self._streak} of {cfg.confirm} times"
            return None
        reason = f"predicted {current:.4f} -> {planned:.4f} s per iteration ({100 * gain:.1f}% faster), nothing moves"
        decision = Resplit(step, self.shares, new, current, planned, tuple(predicted), tuple(scales), reason)
        self._switched(new)
        self.resplits.append(decision)
        self.last_reason = f"re-split at step {step}: rows per group {list(self.shares)}: {reason}"
        return decision

    def moved_to(self, shares: Sequence[int]) -> None:
        """The run now trains `shares` by someone else's decision: the same bookkeeping as a re-split
        of the policy's own."""
        shares = tuple(shares)
        if len(shares) != len(self.shares) or sum(shares) != self.batch or any(r < 0 for r in shares):
            raise ValueError(f"shares {list(shares)}: {len(self.shares)} groups of rows >= 0 summing to {self.batch}")
        self._switched(shares)

    def _switched(self, new: tuple[int, ...]) -> None:
        cfg = self.config
        # Back-off, as the TP policy's: a re-split soon after the previous one doubles the cooldown.
        self._cooldown = min(cfg.max_cooldown, 2 * self._cooldown) if self._since <= 2 * self._cooldown \
            else cfg.cooldown
        scales = self.scales() if all(q or r == 0 for q, r in zip(self.samples, self.shares)) else None
        if scales is not None:  # what each group was measured at, for when it has no rows to measure
            self.last_scale = list(scales)
        self._previous, self.shares = self.shares, tuple(new)
        self.restart()

    def restart(self) -> None:
        """Measure afresh (the steps since the last re-split may have run under the old rows: an
        order applied later than asked): the samples start over after the warm-up."""
        cfg = self.config
        for q in self.samples:  # times at other rows: the refit starts over at the new ones
            q.clear()
        self._skip = cfg.warmup
        self._measured = 0
        self._streak = 0
        self._wait = self._cooldown
        self._since = 0
