"""The overlap trial (`protocol.OverlapTrial`, issue #37): which overlap mode each of a run's first
steps runs, and which mode is kept. Pure: the engine applies the modes and makes the ranks agree
on the measurements (`tpengine.TPEngine`).

Why measure: the planner predicts each mode's gain from the profiles, and on some boxes a call
launched beside compute costs more CPU than the profile's probe read (on `xronos demo`'s boxes it
predicted two chunks 8-26 % fast, docs/planning.md). The modes differ only in when the same sums
travel, so trying each for a few steps costs a few slower steps and changes nothing else.

The schedule from the run's first step `start`: `after` steps of warm-up under the plan's mode
(modes[0]); then every mode in turn, one step each, for `rounds` + 1 rounds (a drift of the host
falls on every mode alike, as `bench.interleave` found it must), the first round not measured: a
mode's first step pays its one-time costs (new tensor shapes for the allocator; on the virtual
clock, the first sample of each of its bursts). At the last step every rank gives each mode's
median iteration, the slowest rank's median counts, and the least wins. A mode must
beat the earlier ones by `TIE` (relative) to win: the plan's own mode, first, keeps ties. A kept
mode with a layout planned for it (`OverlapTrial.layouts`) has the ranks move there at the next
free boundary (the engine's `own_move`): the modes are compared on one layout, since a step cannot
afford a move, and the layout that suits the kept one is the planner's. A run too short to finish
the trial runs the plan's mode throughout.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Sequence

from xronos.protocol.layout import Layout
from xronos.protocol.messages import Overlap, OverlapTrial, overlap_label

TIE = 0.01  # a later mode must be this much faster (relative) than the best before it to win


@dataclass(frozen=True)
class TrialOutcome:
    """What the trial decided: `kept` from step `step` on (0-based; the trial ran the steps
    before it); each mode's median iteration (the slowest rank's), by label, in the trial's order."""

    step: int
    kept: Overlap
    seconds: dict[str, float]
    layout: Layout | None = None  # the kept mode's own layout, where the ranks move next (None: stay)

    @property
    def kept_label(self) -> str:
        return overlap_label(self.kept)

    def text(self, clock: str) -> str:
        each = ", ".join(f"{k} {v:.4f} s" for k, v in self.seconds.items())
        return f"overlap trial ({clock} clock, median iteration of each mode): {each}; kept {self.kept_label}"


def pick(seconds: Sequence[float], tie: float = TIE) -> int:
    """The index of the least time; a later one must be `tie` (relative) below the best before it."""
    best = 0
    for i in range(1, len(seconds)):
        if seconds[i] < seconds[best] * (1 - tie):
            best = i
    return best


@dataclass
class Trial:
    """One run's trial, from its first step `start` (a resumed run tries again from there)."""

    spec: OverlapTrial
    start: int
    samples: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.samples = [[] for _ in self.spec.modes]

    @property
    def last(self) -> int:
        """The step after which the ranks decide."""
        return self.start + self.spec.steps - 1

    def fits(self, steps: int) -> bool:
        """Whether a run of `steps` steps (0..steps-1) reaches the decision."""
        return self.last < steps

    def _turn(self, step: int) -> int | None:
        """The step's place in the turns (the unmeasured first round included); None outside them."""
        i = step - self.start - self.spec.after
        return i if 0 <= i < (self.spec.rounds + 1) * len(self.spec.modes) else None

    def mode(self, step: int) -> Overlap:
        """The mode `step` runs: the plan's in the warm-up, then each in turn. (After the trial the
        engine runs the kept one.)"""
        i = self._turn(step)
        return self.spec.modes[0 if i is None else i % len(self.spec.modes)]

    def record(self, step: int, seconds: float) -> None:
        """This rank's iteration time of `step` (counted in the measured rounds only)."""
        i = self._turn(step)
        if i is not None and i >= len(self.spec.modes):
            self.samples[i % len(self.spec.modes)].append(seconds)

    def medians(self) -> list[float]:
        """Each mode's median iteration on this rank (every mode has `rounds` samples by `last`)."""
        if any(not s for s in self.samples):
            raise RuntimeError(f"overlap trial: a mode has no sample yet (decide after step {self.last})")
        return [statistics.median(s) for s in self.samples]

    def decide(self, worst: Sequence[float]) -> TrialOutcome:
        """The outcome from each mode's slowest-rank median (every rank passes the same `worst`)."""
        if len(worst) != len(self.spec.modes):
            raise ValueError(f"overlap trial: {len(worst)} medians for {len(self.spec.modes)} modes")
        i = pick(worst)
        return TrialOutcome(self.last + 1, self.spec.modes[i],
                            {overlap_label(m): float(s) for m, s in zip(self.spec.modes, worst)},
                            self.spec.layout_for(i))
