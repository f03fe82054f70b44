"""Live re-balancing policy: when to move a running job to a new layout. Pure (no torch, no I/O).

**Speed estimate.** Each node's cost per kind is a base model (a profile's `NodeCost`, or — with
no profile — `unit_costs`: one second per whole kind, so the fit below is seconds per share)
times a *speed factor* c[d][k] = measured / predicted at the node's current share. The measured
figure is the rank's `compute_{kind}_s` of an iteration; the factor is the median of the last
`window` iterations' (smoothed robustly: a spike shorter than half the window does not move it at
all, a lasting change moves it after half the window). A node holding none of a kind measures only
that kind's replicated part, which says little about its slope: its factor for that kind is the
node's relative slowness (the median, over the kinds it does hold, of its factor over the kind's
mean) times the kind's factor at average slowness (the holders' factors over their own slowness). Refitting is scaling every coefficient of the kind (fixed,
intercept, slope) by the factor: `refit(base, factors)`.

**Re-plan.** Every `interval` iterations after `warmup` measured ones: the existing segment
planner (`planner.plan(..., "segment")`) over the refitted costs, under the memory caps. The
current and the planned layout are compared in the same refitted model (the sum over kinds of
the slowest node's time: what the barriers cost). Switch only when
  - the predicted gain (current - planned) / current exceeds `threshold` plus `noise_margin`
    relative standard errors of the current prediction (`noise`: noisy boxes need a larger gain),
  - the move pays for itself: bytes that change hands (`moved_units` x `unit_bytes`, weights and
    AdamW moments) / the measured bandwidth + the measured fixed cost of a move, is repaid by the
    gain within `payback` iterations,
  - and both held at `confirm` consecutive evaluations (hysteresis: noise must persist to act).
After a switch the policy waits `cooldown` iterations (doubling, up to `max_cooldown`, when the
next switch comes within twice the cooldown: back-off against oscillation) and discards the first
`warmup` iterations under the new layout. A re-plan that does not fit the memory caps (the
planner refuses, or a node ends over its cap) is not applied; `last_reason` says why, as it does
for every evaluation that kept the plan.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from xronos.gateway.costmodel import KindCost, NodeCost, kind_time
from xronos.gateway.planner import plan
from xronos.protocol.layout import KINDS, Layout, Sizes

NO_CAP = 1e18  # memory cap of a node whose cap nobody stated (xronos run without a profile)


@dataclass(frozen=True)
class PolicyConfig:
    window: int = 7  # iterations whose median is the speed factor
    warmup: int = 2  # iterations not measured at the start and after every switch
    interval: int = 2  # iterations between evaluations
    threshold: float = 0.05  # least predicted gain, a fraction of the current iteration's barriers
    noise_margin: float = 2.0  # ... plus this many relative standard errors of the measurement
    payback: int = 10  # the move's predicted cost must be repaid within this many iterations
    confirm: int = 2  # consecutive evaluations that must call for a switch
    cooldown: int = 20  # iterations after a switch before the next evaluation
    max_cooldown: int = 320  # back-off ceiling
    budget: int = 200  # planner box evaluations

    def __post_init__(self) -> None:
        for name in ("warmup", "payback", "cooldown", "budget"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("window", "interval", "confirm"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.noise_margin >= 0:
            raise ValueError(f"noise_margin must be >= 0, got {self.noise_margin}")
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


def unit_costs(node_ids: Sequence[str]) -> list[NodeCost]:
    """The base model without a profile: one second per whole kind, nothing fixed, no memory."""
    one = KindCost(fixed_s=0.0, icpt_s=0.0, slope_s=1.0, mem_slope=0.0, temp_slope=0.0)
    return [NodeCost(n, one, one, one, const_s=0.0, mem_repl=0.0, temp_repl=0.0) for n in node_ids]


def refit(base: NodeCost, factors: Mapping[str, float]) -> NodeCost:
    """`base` with every coefficient of kind k scaled by factors[k] (memory unchanged)."""
    def scale(kc: KindCost, f: float) -> KindCost:
        return replace(kc, fixed_s=kc.fixed_s * f, icpt_s=kc.icpt_s * f, slope_s=kc.slope_s * f)

    return replace(base, **{k: scale(base.kind(k), factors[k]) for k in KINDS})


def barrier_time(nodes: Sequence[NodeCost], layout: Layout) -> float:
    """Sum over kinds of the slowest node's time (the layout-dependent part of an iteration)."""
    return sum(max(kind_time(n.kind(k), layout.share(k, d)) for d, n in enumerate(nodes)) for k in KINDS)


def moved_units(old: Layout, new: Layout) -> dict[str, int]:
    """Per kind, the units that change rank (each rank's new range minus what it already held)."""
    out = {}
    for k in KINDS:
        moved = 0
        for r in range(old.world_size):
            (a, b), (c, d) = old.range(k, r), new.range(k, r)
            moved += (d - c) - max(0, min(b, d) - max(a, c))
        out[k] = moved
    return out


@dataclass
class Rebalancer:
    """The policy's state over a run. Feed `observe` every iteration, ask `decide` at boundaries."""

    sizes: Sizes
    layout: Layout
    base: Sequence[NodeCost]  # rank order
    caps: Sequence[float]  # memory caps, bytes (NO_CAP when unknown)
    unit_bytes: Mapping[str, float]  # bytes that travel per unit of each kind (weights + moments)
    bandwidth_Bps: float = 1e9 / 8  # until a move is measured
    move_fixed_s: float = 0.0  # a move's cost beyond its bytes, once measured
    config: PolicyConfig = field(default_factory=PolicyConfig)
    samples: list[dict[str, deque]] = field(init=False)  # per rank and kind, the recent factors
    last_reason: str = field(init=False, default="warming up")
    replans: list[Replan] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        n = self.layout.world_size
        if len(self.base) != n or len(self.caps) != n:
            raise ValueError(f"{len(self.base)} node costs and {len(self.caps)} caps for a layout of {n} ranks")
        self.layout.check(self.sizes, quanta=None)
        if not (self.bandwidth_Bps > 0 and math.isfinite(self.bandwidth_Bps)):
            raise ValueError(f"bandwidth must be finite and > 0, got {self.bandwidth_Bps}")
        self.samples = [{k: deque(maxlen=self.config.window) for k in KINDS} for _ in range(n)]
        self._measured = 0  # iterations measured since the last switch (or the start)
        self._skip = self.config.warmup
        self._wait = 0  # iterations left in the cooldown
        self._cooldown = self.config.cooldown
        self._since_switch = math.inf
        self._streak = 0

    # -- measurement -----------------------------------------------------------------------
    def observe(self, per_rank: Sequence[Mapping[str, float]]) -> None:
        """One iteration's compute per rank and kind (seconds: compute_{kind}_s), under `layout`."""
        if len(per_rank) != self.layout.world_size:
            raise ValueError(f"{len(per_rank)} ranks measured, the layout has {self.layout.world_size}")
        for r, times in enumerate(per_rank):
            for k in KINDS:
                t = times[k]
                if not (t >= 0 and math.isfinite(t)):
                    raise ValueError(f"rank {r}: compute_{k}_s must be finite and >= 0, got {t}")
        self._since_switch += 1
        self._wait = max(0, self._wait - 1)
        if self._skip > 0:
            self._skip -= 1
            return
        for d, (node, times) in enumerate(zip(self.base, per_rank)):
            for k in KINDS:
                share = self.layout.share(k, d)
                predicted = kind_time(node.kind(k), share)
                if share == 0 or predicted <= 0:
                    continue  # a kind the node does not hold: inferred in `_estimate`
                self.samples[d][k].append(times[k] / predicted)
        self._measured += 1

    def observe_move(self, moved_bytes: float, seconds: float) -> None:
        """A finished move's cost: refits the bandwidth and the fixed part (one sample each way)."""
        if not (seconds > 0 and math.isfinite(seconds)) or moved_bytes < 0:
            return
        predicted_bytes_s = moved_bytes / self.bandwidth_Bps
        if predicted_bytes_s < seconds / 2 and moved_bytes > 0:
            self.move_fixed_s = max(0.0, seconds - predicted_bytes_s)
        elif moved_bytes > 0:
            self.bandwidth_Bps = moved_bytes / seconds
        else:
            self.move_fixed_s = seconds

    def set_caps(self, caps: Sequence[float]) -> None:
        if len(caps) != self.layout.world_size:
            raise ValueError(f"{len(caps)} caps for {self.layout.world_size} ranks")
        self.caps = list(caps)

    def _estimate(self) -> list[dict[str, float]] | None:
        """Every node's factor per kind, the missing ones inferred; None until every kind has one."""
        factors = [{k: statistics.median(q) if q else None for k, q in node.items()} for node in self.samples]
        means = {}
        for k in KINDS:
            known = [f[k] for f in factors if f[k] is not None]
            if not known:
                return None
            means[k] = statistics.fmean(known)
        # Each node's relative slowness (its factors over the kinds' means), then each kind's
        # factor at average slowness (the holders' factors divided by their own slowness).
        slow = []
        for f in factors:
            rel = [f[k] / means[k] for k in KINDS if f[k] is not None and means[k] > 0]
            slow.append(statistics.median(rel) if rel else 1.0)  # a node holding nothing: average
        typical = {k: statistics.fmean(f[k] / sl for f, sl in zip(factors, slow) if f[k] is not None and sl > 0)
                   for k in KINDS}
        return [{k: f[k] if f[k] is not None else sl * typical[k] for k in KINDS} for f, sl in zip(factors, slow)]

    def noise(self, nodes: Sequence[NodeCost]) -> float:
        """Relative standard error of the current layout's predicted barrier time: per kind, the
        slowest node's median factor's (1.25 x the spread / sqrt(n), the spread from the median
        absolute deviation), weighted by the kind's part of the barrier time."""
        total = err = 0.0
        for k in KINDS:
            times = [kind_time(n.kind(k), self.layout.share(k, d)) for d, n in enumerate(nodes)]
            d = max(range(len(times)), key=times.__getitem__)
            total += times[d]
            q = self.samples[d][k]
            if len(q) >= 3:
                med = statistics.median(q)
                mad = statistics.median(abs(x - med) for x in q)
                if med > 0:
                    err += times[d] * 1.25 * 1.4826 * mad / math.sqrt(len(q)) / med
        return err / total if total > 0 else 0.0

    def refitted(self) -> list[NodeCost] | None:
        est = self._estimate()
        return None if est is None else [refit(b, f) for b, f in zip(self.base, est)]

    def move_seconds(self, new: Layout) -> float:
        moved = moved_units(self.layout, new)
        nbytes = sum(moved[k] * self.unit_bytes[k] for k in KINDS)
        return nbytes / self.bandwidth_Bps + self.move_fixed_s

    # -- decision ----------------------------------------------------------------------------
    def decide(self, step: int) -> Replan | None:
        """At the boundary before `step`: a Replan to apply now, or None (`last_reason` says why)."""
        cfg = self.config
        if self._measured == 0 or self._skip > 0:
            self.last_reason = "warming up"
            return None
        if self._wait > 0:
            self.last_reason = f"cooling down ({self._wait} iterations left)"
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
        new = result.layout
        planned = barrier_time(nodes, new)
        gain = (current - planned) / current if current > 0 else 0.0
        move_s = self.move_seconds(new)
        need = cfg.threshold + cfg.noise_margin * self.noise(nodes)  # noise raises the bar
        if new == self.layout or gain <= need:
            self._streak = 0
            self.last_reason = (f"kept: predicted gain {100 * gain:.1f}% <= {100 * need:.1f}% (threshold "
                                f"{100 * cfg.threshold:.1f}% + measurement noise)")
            return None
        if move_s > cfg.payback * (current - planned):
            self._streak = 0
            self.last_reason = (f"kept: the move ({move_s:.3f} s) is not repaid within {cfg.payback} "
                                f"iterations by the gain ({current - planned:.4f} s per iteration)")
            return None
        self._streak += 1
        if self._streak < cfg.confirm:
            self.last_reason = f"kept: gain {100 * gain:.1f}% seen {self._streak} of {cfg.confirm} times"
            return None
        reason = (f"predicted {current:.4f} -> {planned:.4f} s per iteration ({100 * gain:.1f}% faster), "
                  f"move {move_s:.3f} s repaid in {move_s / (current - planned):.1f} iterations")
        replan = Replan(step, self.layout, new, current, planned, move_s, reason)
        self._switched(new)
        self.replans.append(replan)
        self.last_reason = f"re-planned at step {step}: {reason}"
        return replan

    def _switched(self, new: Layout) -> None:
        cfg = self.config
        # Back-off: a switch soon after the previous one doubles the cooldown; a calm spell resets it.
        if self._since_switch <= 2 * self._cooldown:
            self._cooldown = min(cfg.max_cooldown, 2 * self._cooldown)
        else:
            self._cooldown = cfg.cooldown
        self.layout = new
        for node in self.samples:  # factors measured at the old shares stay, but fresh ones win soon
            for q in node.values():
                while len(q) > self.config.window // 2:
                    q.popleft()
        self._wait = self._cooldown
        self._skip = cfg.warmup
        self._measured = 0
        self._streak = 0
        self._since_switch = 0
