"""A running TP engine changes layout at an iteration boundary (the runtime's `Reshard` word).

`move(engine, rank, word, step)` is `TPEngine.reshard`: the transfer plan between the two
layouts' spec tables (meta-device builds, cached), the exchange of weights and AdamW state
(`xronos.node.tp.reshard`), then an untimed barrier so every rank leaves the boundary together;
the wall time of all that is the re-shard's cost, booked on the next iteration's record
(`reshard_s`) and in the engine's list of moves (`Move`), which the metrics document reports.

`ScheduledReshards` is the control of `xronos run --reshard-at`: the same settings on every rank,
so no communication is needed to agree on the word.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from xronos.node.runconfig import ReshardAt
from xronos.node.runtime import Rank, Reshard, Word
from xronos.node.tp.group import TPGroup
from xronos.node.tp.layout import ShardLayout
from xronos.node.tp.reshard import moved_bytes, reshard, specs_per_rank, transfer_plan
from xronos.protocol.layout import Layout, LayoutError


@dataclass(frozen=True)
class Move:
    """One live re-shard, as this rank saw it."""

    step: int  # before this step
    reason: str
    old: str  # Layout.to_text()
    new: str
    seconds: float  # this rank's wall time at the boundary
    moved_bytes: int  # over the network, all ranks together (weights and moments)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ScheduledReshards:
    """Re-shard at the given steps (`RunConfig.reshard_at`), else go on."""

    def __init__(self, schedule: tuple[ReshardAt, ...]) -> None:
        self.at = {r.step: r.layout for r in schedule}

    def at_boundary(self, group: TPGroup, step: int) -> Word | Reshard:
        layout = self.at.get(step)
        return Word.GO if layout is None else Reshard(layout, f"--reshard-at {step}")


class SpecCache:
    """Every rank's spec table per layout (a few meta-device builds per new layout)."""

    def __init__(self, family: Any, config: dict[str, Any], task: str, dropout: float | None) -> None:
        self.family, self.config, self.task, self.dropout = family, config, task, dropout
        self.cache: dict[Layout, list] = {}

    def __call__(self, layout: Layout) -> list:
        if layout not in self.cache:
            if len(self.cache) >= 4:
                self.cache.pop(next(iter(self.cache)))
            self.cache[layout] = specs_per_rank(self.family, self.config, self.task, layout, self.dropout)
        return self.cache[layout]


def move(engine: Any, rank: Rank, word: Reshard, step: int) -> Move:
    """Collective: `engine` (a TPEngine: model, opt, layout, specs, replicated) goes on under
    `word.layout`. A layout of another world or model is refused on every rank alike."""
    t0 = time.perf_counter()
    group, cfg = rank.group, rank.cfg
    old = engine.layout.layout()
    new = word.layout
    if new.world_size != group.world_size:
        raise LayoutError(f"re-shard at step {step}: layout has {new.world_size} ranks, the world {group.world_size}")
    new.check(engine.family.sizes(rank.facts.config), quanta=None)
    plan = transfer_plan(engine.spec_cache(old), engine.spec_cache(new))
    shard = ShardLayout.of(new, group.rank)
    sent = moved_bytes(plan, engine.model, engine.opt)
    engine.model = reshard(engine.model, engine.opt, plan,
                           lambda: engine.family.build(rank.facts.config, cfg.task, shard, group, dropout=cfg.dropout),
                           group)
    engine.layout = shard
    engine.specs = engine.model.tensor_specs()
    engine.replicated = {name for name, s in engine.specs.items() if s.dim is None}
    group.barrier(timed=False)  # everyone leaves the boundary together: the move's cost is its wall time
    group.drain_timings()
    group.drain_spans()
    return Move(step, word.reason, old.to_text(), new.to_text(), time.perf_counter() - t0, sent)
