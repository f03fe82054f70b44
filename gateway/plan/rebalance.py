"""Live re-balancing policy: when to move a running job to a new layout. Pure (no torch, no I/O).

How the nodes' speeds are estimated from what they measure — the speed factors, the kinds a node
holds none of, the two-share refit through an *anchor* — is `refit.py`'s docstring; a move decided
elsewhere (`moved_to`) is booked as the policy's own.

**Level shifts and settling.** A box that changes (its quota cut, a process started beside it)
changes all its kinds at once, so each node also has a *level*: its measured over predicted time
summed over the kinds it holds. When the last `shift_run` levels all lie more than `shift_tol`
(relative) above the median of the (at least 2 x `shift_run`) ones before them, or below their
lower quartile (outliers only ever slow an iteration down), the box changed: the node's older
samples are dropped (the estimate is the new level's alone, at once, instead of after half a
window) and what it measured at another share (its anchors) is scaled by the new level over the old.
Independent outliers (a 2x iteration now and then) rarely make a run of `shift_run`; jitter
within `shift_tol` never does. No decision is taken while any node has fewer than `settle`
samples at its current level (since the start, its last shift, or the last switch): the evidence
is still settling.

**Re-plan.** Every `interval` iterations once settled: the segment planner (`planner.plan(...,
"segment")`) over the refitted costs, under the memory caps. The current and the planned layout
are compared in the same refitted model (the sum over kinds of the slowest node's time: what the
barriers cost). The planned layout is taken only as far as the evidence reaches: no node gets
more of a kind than `reach` x the largest share it was measured at (a factor is local — a sliver
looks cheap per unit), else the move goes that part of the way (`blend`) and is carried on once
the node has been measured there. Switch only when
  - the predicted gain (current - planned) / current exceeds `threshold` plus `noise_margin`
    relative standard errors of the current prediction (`noise`: noisy boxes need a larger gain),
  - the move pays for itself: its predicted cost is repaid by the predicted gain within `payback`
    iterations, or within `payback_share` of the iterations the run has left when that is longer
    (`total_steps` known): a job of thousands of steps does not give up a lasting gain to save a
    move of a second, and a short one still makes no move it cannot earn back. The cost is bytes
    that change hands (`moved_units` x `unit_bytes`, weights and
    AdamW moments) / `bandwidth_Bps` + `move_fixed_s` until a move was measured, then the move
    model refitted from the last five measured moves (`observe_move`; `refit.fit_move`: a fixed
    part and a part per byte, so a small move's fixed cost is not read as a slow link),
  - and both held at `confirm` consecutive evaluations (hysteresis: noise must persist to act).
After a switch the policy discards the first `warmup` iterations under the new layout, then needs
`settle` fresh ones (twice as many for a move within the cooldown), and for `cooldown` iterations
(doubling, up to `max_cooldown`, when the next switch comes within twice the cooldown: back-off
against oscillation) it only makes a move that carries on the last one (`continues`: no rank gets
back units it gave away or gives away units it got) — the correction a first move from a one-share
estimate may need once the two-share refit is in, never a step back. A re-plan that does not fit the
memory caps (the planner refuses, or a node ends over its cap) is not applied; `last_reason` says
why, as it does for every evaluation that kept the plan.

Defaults (`PolicyConfig`): window 12, warmup 2, shift_run 4, shift_tol 0.2, settle 4, anchor_gap
0.2, interval 1, threshold 5 %, noise_margin 2, payback 10, payback_share 0.25, confirm 2, cooldown
20, max_cooldown 320, reach 2. A box slowed 2x is followed 5 iterations after the change (4 samples show the shift,
then two evaluations agree); steady boxes with +-10 % jitter and 5 % of 2x outliers do not move the
plan.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from xronos.gateway.plan.costmodel import NodeCost, kind_time
from xronos.gateway.plan.planner import plan
from xronos.gateway.plan.refit import (
    barrier_time, continues, fit_move, level_shift, measured_costs, moved_units, noise, reach_fraction,
    speed_factors, step_within_caps, with_rest,
)
from xronos.protocol.layout import KINDS, Layout, Sizes

NO_CAP = 1e18  # memory cap of a node whose cap nobody stated (xronos run without a profile)


@dataclass(frozen=True)
class PolicyConfig:
    window: int = 12  # samples per (node, kind) whose median is the speed factor
    warmup: int = 2  # iterations not measured at the start and after every switch
    shift_run: int = 4  # consecutive levels beyond shift_tol, on one side: the box changed
    shift_tol: float = 0.2  # relative distance from the previous level that counts as beyond
    settle: int = 4  # samples every node needs at its current level before a decision
    anchor_gap: float = 0.2  # least relative share difference for a two-share (affine) refit
    interval: int = 1  # iterations between evaluations
    threshold: float = 0.05  # least predicted gain, a fraction of the current iteration's barriers
    noise_margin: float = 2.0  # ... plus this many relative standard errors of the measurement
    payback: int = 10  # the move's predicted cost must be repaid within this many iterations ...
    payback_share: float = 0.25  # ... or this share of the iterations left, when more (total_steps known)
    confirm: int = 2  # consecutive evaluations that must call for a switch
    cooldown: int = 20  # iterations after a switch before the next evaluation
    max_cooldown: int = 320  # back-off ceiling
    budget: int = 200  # planner box evaluations
    reach: float = 2.0  # a move takes a node's share of a kind to at most this x the largest it was measured at

    def __post_init__(self) -> None:
        for name in ("warmup", "payback", "cooldown", "budget"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("window", "interval", "confirm", "settle"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shift_run < 2:
            raise ValueError(f"shift_run must be >= 2, got {self.shift_run}")
        if not self.shift_tol > 0 or not 0 <= self.anchor_gap < 1:
            raise ValueError(f"shift_tol must be > 0 and anchor_gap in [0, 1), got {self.shift_tol}, {self.anchor_gap}")
        if not self.reach >= 1:
            raise ValueError(f"reach must be >= 1 (math.inf: no limit), got {self.reach}")
        if not self.noise_margin >= 0:
            raise ValueError(f"noise_margin must be >= 0, got {self.noise_margin}")
        if not 0 <= self.payback_share <= 1:
            raise ValueError(f"payback_share must be in [0, 1], got {self.payback_share}")
        if not self.threshold >= 0 or self.max_cooldown < self.cooldown:
            raise ValueError(f"threshold must be >= 0 and max_cooldown >= cooldown, got {self.threshold}, "
                             f"{self.max_cooldown} < {self.cooldown}")


@dataclass(frozen=True)
class Replan:
    """A decision to move: at `step`'s boundary, from `old` to `new`."""

    step: int
    old: Layout
    new: Layout
    predicted_old_s: float  # barrier compute per iteration, refitted model, current layout
    predicted_new_s: float
    move_s: float  # predicted cost of the move
    reason: str

    @property
    def gain(self) -> float:
        return (self.predicted_old_s - self.predicted_new_s) / self.predicted_old_s


@dataclass
class Rebalancer:
    """The policy's state over a run. Feed `observe` every iteration, ask `decide` at boundaries."""

    sizes: Sizes
    layout: Layout
    base: Sequence[NodeCost]  # rank order
    caps: Sequence[float]  # memory caps, bytes (NO_CAP when unknown)
    unit_bytes: Mapping[str, float]  # bytes that travel per unit of each kind (weights + moments)
    bandwidth_Bps: float = 1e9 / 8  # the move model's prior (scaled by measured moves)
    move_fixed_s: float = 0.0  # a move's cost beyond its bytes, in the prior
    config: PolicyConfig = field(default_factory=PolicyConfig)
    total_steps: int | None = None  # the run's length in iterations (None: not known; `payback` alone)
    samples: list[dict[str, deque]] = field(init=False)  # per rank and kind, the recent factors
    last_reason: str = field(init=False, default="warming up")
    replans: list[Replan] = field(init=False, default_factory=list)
    shifts: list[tuple[int, str]] = field(init=False, default_factory=list)  # (rank, what changed)

    def __post_init__(self) -> None:
        n = self.layout.world_size
        if len(self.base) != n or len(self.caps) != n:
            raise ValueError(f"{len(self.base)} node costs and {len(self.caps)} caps for a layout of {n} ranks")
        self.layout.check(self.sizes, quanta=None)
        if not (self.bandwidth_Bps > 0 and math.isfinite(self.bandwidth_Bps)):
            raise ValueError(f"bandwidth must be finite and > 0, got {self.bandwidth_Bps}")
        w = self.config.window
        self.samples = [{k: deque(maxlen=w) for k in KINDS} for _ in range(n)]
        # per rank: measured / predicted time over the kinds it holds (long enough to see a shift)
        self.levels = [deque(maxlen=max(w, 3 * self.config.shift_run)) for _ in range(n)]
        self.fresh = [0] * n  # per rank: samples at its current level
        self.anchors: list[dict[str, tuple[float, float]]] = [{} for _ in range(n)]  # (share, seconds)
        self.last_factors: list[dict[str, float]] = [{} for _ in range(n)]  # at the last switch
        self.moves: deque = deque(maxlen=5)  # (bytes, seconds) of the last measured moves
        self._measured = 0  # iterations measured since the last switch (or the start)
        self._skip = self.config.warmup
        self._wait = 0  # iterations left in the cooldown
        self._cooldown = self.config.cooldown
        self._since_switch = math.inf
        self._streak = 0
        self._observed = 0  # iterations observed in all
        self._previous: Layout | None = None  # the layout before the last switch

    # -- measurement -----------------------------------------------------------------------
    def observe(self, per_rank: Sequence[Mapping[str, float]]) -> None:
        """One iteration's compute per rank and kind (seconds: compute_{kind}_s), under `layout`;
        optionally "rest" (compute_rest_s: the optimizer step, clipping, the replicated layers),
        booked to the kinds the rank holds in proportion to their bytes (`unit_bytes` x units
        held), as the cost model books a layer's optimizer step in the layer's kind."""
        if len(per_rank) != self.layout.world_size:
            raise ValueError(f"{len(per_rank)} ranks measured, the layout has {self.layout.world_size}")
        for r, times in enumerate(per_rank):
            for k in (*KINDS, "rest") if "rest" in times else KINDS:
                t = times[k]
                if not (t >= 0 and math.isfinite(t)):
                    raise ValueError(f"rank {r}: compute_{k}_s must be finite and >= 0, got {t}")
        per_rank = [self._with_rest(d, times) for d, times in enumerate(per_rank)]
        self._observed += 1
        self._since_switch += 1
        self._wait = max(0, self._wait - 1)
        if self._skip > 0:
            self._skip -= 1
            return
        cfg = self.config
        for d, (node, times) in enumerate(zip(self.base, per_rank)):
            measured = predicted_sum = 0.0
            for k in KINDS:
                share = self.layout.share(k, d)
                predicted = kind_time(node.kind(k), share)
                if share == 0 or predicted <= 0:
                    continue  # a kind the node does not hold: inferred in `_estimate`
                self.samples[d][k].append(times[k] / predicted)
                measured += times[k]
                predicted_sum += predicted
            if predicted_sum <= 0:  # holds nothing: nothing to settle
                self.fresh[d] += 1
                continue
            self.levels[d].append(measured / predicted_sum)
            self.fresh[d] += 1
            ratio = level_shift(list(self.levels[d]), cfg.shift_run, cfg.shift_tol)
            if ratio is not None:
                self._shifted(d, ratio)
        self._measured += 1

    def _with_rest(self, d: int, times: Mapping[str, float]) -> Mapping[str, float]:
        return with_rest(times, self.layout, d, self.unit_bytes, self.sizes)

    def _shifted(self, d: int, ratio: float) -> None:
        """Node d's box changed (it now takes `ratio` x its previous time): only the samples of
        its new level count; what it measured at other shares is scaled to the new level."""
        run = self.config.shift_run
        q = self.levels[d]
        for dq in (q, *self.samples[d].values()):
            while len(dq) > run:
                dq.popleft()
        self.fresh[d] = run
        # A box that changed runs all its work at the new speed (a quota cut, a neighbour taking
        # CPU): what it measured at another share still says how it scales, at the new level.
        for k, (share, seconds) in self.anchors[d].items():
            self.anchors[d][k] = (share, seconds * ratio)
        self.last_factors[d] = {k: f * ratio for k, f in self.last_factors[d].items()}
        self._streak = 0
        self.shifts.append((d, f"rank {d} runs at {ratio:.2f}x its previous time (seen {self._observed})"))

    def observe_move(self, moved_bytes: float, seconds: float) -> None:
        """A finished move's bytes and seconds: the move model is refitted from the last five
        (`move_model`); a broken measurement (not finite, not positive) is ignored."""
        if not (seconds > 0 and math.isfinite(seconds)) or not (moved_bytes >= 0 and math.isfinite(moved_bytes)):
            return
        self.moves.append((float(moved_bytes), float(seconds)))

    @property
    def move_model(self) -> tuple[float, float]:
        """(fixed seconds, seconds per byte) of a move: the prior, refitted from the measured moves."""
        return fit_move(self.moves, 1.0 / self.bandwidth_Bps, self.move_fixed_s)

    def set_caps(self, caps: Sequence[float]) -> None:
        if len(caps) != self.layout.world_size:
            raise ValueError(f"{len(caps)} caps for {self.layout.world_size} ranks")
        self.caps = list(caps)

    def settling(self, need: int | None = None) -> list[int]:
        """The ranks without `need` (`settle`) samples at their current level (no decision until none)."""
        need = self.config.settle if need is None else need
        return [d for d, n in enumerate(self.fresh) if n < need]

    def _estimate(self) -> list[dict[str, float]] | None:
        """Every node's factor per kind, the missing ones inferred; None until every kind has one."""
        return speed_factors(self.samples, self.last_factors)

    def noise(self, nodes: Sequence[NodeCost]) -> float:
        """Relative standard error of the current layout's predicted barrier time (`refit.noise`)."""
        return noise(self.samples, self.layout, nodes)

    def refitted(self) -> list[NodeCost] | None:
        """The nodes' costs as measured: each kind scaled by its factor, or the line through the
        current share and the anchor (`refit.py`'s docstring)."""
        est = self._estimate()
        if est is None:
            return None
        return measured_costs(self.base, est, self.anchors, self.samples, self.layout, self.config.anchor_gap)

    def move_seconds(self, new: Layout) -> float:
        moved = moved_units(self.layout, new)
        nbytes = sum(moved[k] * self.unit_bytes[k] for k in KINDS)
        return self.move_cost(nbytes)

    def move_cost(self, nbytes: float) -> float:
        """Seconds a move of `nbytes` is predicted to take (`move_model`)."""
        fixed, per_byte = self.move_model
        return fixed + nbytes * per_byte

    def payback_horizon(self, step: int) -> float:
        """Iterations within which a move at `step` must be repaid: `payback`, or `payback_share` of
        the iterations the run has left (`total_steps`) when that is more."""
        cfg = self.config
        if self.total_steps is None:
            return float(cfg.payback)
        return max(float(cfg.payback), math.floor(cfg.payback_share * max(0, self.total_steps - step)))

    # -- decision ----------------------------------------------------------------------------
    def decide(self, step: int) -> Replan | None:
        """At the boundary before `step`: a Replan to apply now, or None (`last_reason` says why)."""
        cfg = self.config
        cooling = f"cooling down ({self._wait} iterations left)"
        # In the cooldown a (continuing) move waits for twice the settling samples: the two-share
        # refit it rests on amplifies the noise of a short median.
        if self._wait > 0 and (self._measured == 0 or self._skip > 0 or self.settling(2 * cfg.settle)):
            self.last_reason = cooling
            return None
        if self._measured == 0 or self._skip > 0:
            self.last_reason = "warming up"
            return None
        unsettled = self.settling()
        if unsettled:
            self._streak = 0
            self.last_reason = (f"settling: ranks {unsettled} have fewer than {cfg.settle} samples since their "
                                f"last change")
            return None
        if self._measured % cfg.interval:
            return None
        nodes = self.refitted()
        if nodes is None:
            self.last_reason = "warming up"
            return None
        current = barrier_time(nodes, self.layout)
        try:
            result = plan(nodes, self.sizes, "segment", list(self.caps), budget=cfg.budget)
        except ValueError as exc:  # InfeasiblePlan included
            self._streak = 0
            self.last_reason = f"kept: no re-plan fits the memory caps ({exc})"
            return None
        if not result.feasible:
            self._streak = 0
            over = [r.node_id for r in result.rows if r.over_cap]
            self.last_reason = f"kept: the re-plan puts {over} over their memory caps"
            return None
        # Judged on the whole re-plan (is there something worth fixing, and does fixing it pay?);
        # made as far as the evidence reaches (`_within_reach`), carried on once measured there.
        target = result.layout
        full = barrier_time(nodes, target)
        gain = (current - full) / current if current > 0 else 0.0
        need = cfg.threshold + cfg.noise_margin * self.noise(nodes)  # noise raises the bar
        if target == self.layout or gain <= need:
            self._streak = 0
            self.last_reason = (f"kept: predicted gain {100 * gain:.1f}% <= {100 * need:.1f}% (threshold "
                                f"{100 * cfg.threshold:.1f}% + measurement noise)")
            return None
        whole_s = self.move_seconds(target)
        horizon = self.payback_horizon(step)
        if whole_s > horizon * (current - full):
            self._streak = 0
            self.last_reason = (f"kept: the move ({whole_s:.3f} s) is not repaid within {horizon:g} "
                                f"iterations by the gain ({current - full:.4f} s per iteration)")
            return None
        new, alpha = self._within_reach(target)
        planned = barrier_time(nodes, new)
        if new == self.layout or planned >= current:
            self._streak = 0
            self.last_reason = (f"kept: the re-plan ({target.to_text()}) gives nodes more than {cfg.reach:g}x "
                                f"the work they were measured at, and no step towards it gains")
            return None
        move_s = self.move_seconds(new)
        if self._wait > 0 and not continues(self._previous, self.layout, new):
            self._streak = 0
            self.last_reason = f"{cooling}: the re-plan would take back part of the last move"
            return None
        self._streak += 1
        if self._streak < cfg.confirm:
            self.last_reason = f"kept: gain {100 * gain:.1f}% seen {self._streak} of {cfg.confirm} times"
            return None
        step_gain = (current - planned) / current
        reason = (f"predicted {current:.4f} -> {planned:.4f} s per iteration ({100 * step_gain:.1f}% faster), "
                  f"move {move_s:.3f} s repaid in {move_s / (current - planned):.1f} iterations")
        if alpha < 1:
            reason += (f"; {100 * alpha:.0f}% of the way to {target.to_text()} ({full:.4f} s), within reach "
                       f"of the measured shares")
        replan = Replan(step, self.layout, new, current, planned, move_s, reason)
        self._switched(new)
        self.replans.append(replan)
        self.last_reason = f"re-planned at step {step}: {reason}"
        return replan

    def _within_reach(self, target: Layout) -> tuple[Layout, float]:
        """`target`, or the layout part of the way to it (and that fraction) that gives no node more
        of a kind than `reach` x the largest share it was measured at (now, or at its anchor), nor
        more than the even share of a kind it was never measured at — the factors are local: a node
        given a sliver measures its per-call and replicated part, or (under a CPU quota) runs the
        sliver inside its banked quota, and looks faster per unit than it is at several times the
        work (`make demo` moved a Pi 4 from 128 to 576 MLP columns on such a factor and ran slower).
        The step stays within the memory caps. A move cut short is carried on once the node has
        been measured at its new share (the cooldown lets such a move continue)."""
        if not math.isfinite(self.config.reach):
            return target, 1.0
        alpha = reach_fraction(self.layout, target, self.samples, self.anchors, self.config.reach)
        return step_within_caps(self.layout, target, alpha, self.base, self.caps, self.sizes)

    def moved_to(self, new: Layout) -> None:
        """The run now runs under `new` by someone else's decision (a calibration, an operator):
        the same bookkeeping as a switch of the policy's own (anchors, fresh samples, cooldown)."""
        new.check(self.sizes, world_size=self.layout.world_size, quanta=None)
        self._switched(new)

    def _switched(self, new: Layout) -> None:
        cfg = self.config
        # Back-off: a switch soon after the previous one doubles the cooldown; a calm spell resets it.
        if self._since_switch <= 2 * self._cooldown:
            self._cooldown = min(cfg.max_cooldown, 2 * self._cooldown)
        else:
            self._cooldown = cfg.cooldown
        # Each (node, kind)'s estimate at the old share becomes its anchor; the samples start over
        # (a factor measured at one share is biased at another unless the model's intercept is right).
        est = self._estimate()
        for d, node in enumerate(self.base):
            if est is not None:
                self.last_factors[d] = dict(est[d])
            for k in KINDS:
                share = self.layout.share(k, d)
                if est is not None and share > 0 and self.samples[d][k]:
                    self.anchors[d][k] = (share, est[d][k] * kind_time(node.kind(k), share))
                self.samples[d][k].clear()
            self.levels[d].clear()
            self.fresh[d] = 0
        self._previous, self.layout = self.layout, new
        self._wait = self._cooldown
        self._skip = cfg.warmup
        self._measured = 0
        self._streak = 0
        self._since_switch = 0
