"""A running TP engine changes layout at an iteration boundary (the runtime's `Reshard` word).

`move(engine, rank, word, step)` is `TPEngine.reshard`: the transfer plan between the two
layouts' spec tables (meta-device builds, cached), the exchange of weights and AdamW state
(`xronos.node.tp.reshard`), then an untimed barrier so every rank leaves the boundary together;
the wall time of all that is the re-shard's cost, booked on the next iteration's record
(`reshard_s`) and in the engine's list of moves (`Move`), which the metrics document reports.

Two environment settings let a test act while a move is in progress (they only signal and wait;
nothing fails on purpose): `XRONOS_RESHARD_MARK=DIR` makes every rank write `DIR/rank<r>-step<s>.pid`
(its process id) as it enters the exchange, and `XRONOS_RESHARD_HOLD=<rank>:<seconds>` makes that
rank wait there (< 60 s) while its peers wait for its slices.

`resplit(engine, rank, word, step)` is `DPEngine.reshard`: a data-parallel run's new split of the
batch (rows per group), which moves nothing (`Move.moved_bytes` 0).

`ScheduledReshards` is the control of `xronos run --reshard-at`: the same settings on every rank,
so no communication is needed to agree on the word. `LiveRebalance` is the control of `xronos run
--rebalance`: rank 0 runs a re-balancing policy on every rank's measured per-kind compute;
`LiveResplit` is its data-parallel counterpart (`--shares ... --rebalance`): a re-split policy on
every group's measured compute.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import xronos.node.measure.allocator as allocator  # (the module alone: not the measuring room)
from xronos.node.runconfig import ReshardAt
from xronos.node.rank.lifecycle import Rank, Reshard, Word
from xronos.node.tp.group import TPGroup
from xronos.node.tp.layout import ShardLayout
from xronos.node.tp.reshard import move_peak_bytes, moved_bytes, reshard, specs_per_rank, transfer_plan
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
    # A data-parallel run's re-split (`resplit`): rows per group before and after (old == new layout)
    old_shares: tuple[int, ...] | None = None
    new_shares: tuple[int, ...] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def counts_row(layout: Layout) -> list[int]:
    """A layout as the ranks broadcast it at a boundary: every rank's attn counts, then mlp, then vocab."""
    return [*layout.attn, *layout.mlp, *layout.vocab]


def from_counts_row(counts: list[int], world_size: int) -> Layout:
    """`counts_row` read back (3 x world_size counts)."""
    n = world_size
    return Layout(attn=tuple(counts[:n]), mlp=tuple(counts[n:2 * n]), vocab=tuple(counts[2 * n:3 * n]))


class ScheduledReshards:
    """Re-shard (or, with shares, re-split a data-parallel run's batch) at the given steps
    (`RunConfig.reshard_at`), else go on."""

    def __init__(self, schedule: tuple[ReshardAt, ...], layout: Layout | None = None) -> None:
        """`layout`: the run's, which a share entry keeps (its word carries it)."""
        self.at = {r.step: r for r in schedule}
        self.layout = layout

    def at_boundary(self, group: TPGroup, step: int) -> Word | Reshard:
        r = self.at.get(step)
        if r is None:
            return Word.GO
        if r.shares is not None:
            assert self.layout is not None, "a share entry needs the run's layout"
            return Reshard(self.layout, f"--reshard-at {step}", shares=r.shares)
        assert r.layout is not None
        return Reshard(r.layout, f"--reshard-at {step}")


class SpecCache:
    """Every rank's spec table per layout (a few meta-device builds per new layout)."""

    def __init__(self, family: Any, config: dict[str, Any], task: str, dropout: float | None,
                 lora: Any = None) -> None:
        self.family, self.config, self.task, self.dropout, self.lora = family, config, task, dropout, lora
        self.cache: dict[Layout, list] = {}

    def __call__(self, layout: Layout) -> list:
        if layout not in self.cache:
            if len(self.cache) >= 4:
                self.cache.pop(next(iter(self.cache)))
            self.cache[layout] = specs_per_rank(self.family, self.config, self.task, layout, self.dropout, self.lora)
        return self.cache[layout]


def move(engine: Any, rank: Rank, word: Reshard, step: int) -> Move:
    """Collective: `engine` (a TPEngine: model, opt, layout, specs, replicated) goes on under
    `word.layout`. A layout of another world or model, or a move some rank has no memory for
    (`check_room`), is refused on every rank alike, before anything moves."""
    group, cfg = rank.group, rank.cfg
    old = engine.layout.layout()
    new = word.layout
    if word.shares is not None:
        raise LayoutError(f"re-split at step {step}: shares {list(word.shares)}, but the run is tensor-parallel "
                          "(no data-parallel groups)")
    if new.world_size != group.world_size:
        raise LayoutError(f"re-shard at step {step}: layout has {new.world_size} ranks, the world {group.world_size}")
    # The kinds' quanta too, as for an Assignment: every layout a plan or the policy makes cuts on them.
    new.check(engine.family.sizes(rank.facts.config))
    t0 = group.now()  # the group's clock (an emulated box's virtual time, else wall), once the order holds
    plan = transfer_plan(engine.spec_cache(old), engine.spec_cache(new))
    shard = ShardLayout.of(new, group.rank)
    sent = moved_bytes(plan, engine.model, engine.opt)
    # The heap's free chunks go back to the kernel first (the ranks' allocator keeps them,
    # `node/measure/allocator.py`): fragmented, they may not fit the move's tensors, so the room is
    # what the kernel will still give this process.
    allocator.trim()
    check_room(group, move_peak_bytes(plan, engine.model, engine.opt, group.rank), memory_room(), step)
    lora = engine.lora

    def build_new() -> Any:  # the engine's build at the new layout (adapters included), on the meta device
        from xronos.node.tp.lora import add_lora

        model = engine.family.build(rank.facts.config, cfg.recipe.task, shard, group, dropout=cfg.recipe.dropout)
        if lora is not None:
            engine.lora_modules = add_lora(model, lora)
        return model

    _announce(group.rank, step)
    engine.model = reshard(engine.model, engine.opt, plan, build_new, group)
    # The old shard and the buffers are free now: handed back, not kept as holes beside the new
    # shard (a Set-B TinyLlama rank, kept, was killed under its cap after its second move).
    allocator.trim()
    engine.layout = shard
    engine.specs = engine.model.tensor_specs()
    engine.replicated = {name for name, s in engine.specs.items() if s.dim is None}
    group.barrier(timed=False)  # everyone leaves the boundary together: the move's cost is its time
    group.drain_timings()
    group.drain_spans()
    return Move(step, word.reason, old.to_text(), new.to_text(), group.now() - t0, sent)


def memory_room() -> int:
    """Bytes this process may still allocate: the memory available to it (its cgroup's limit less
    its usage where that is tighter than the host's MemAvailable)."""
    from xronos.node.box.capabilities import memory

    try:
        return memory()[1]
    except (OSError, KeyError, ValueError):  # no /proc/meminfo to read: nothing to refuse on
        return 1 << 62


def check_room(group: TPGroup, need: int, room: int, step: int) -> None:
    """Collective: every rank tells its (need, room) and all refuse alike (LayoutError, naming the
    first rank short and its figures) when any rank would have to allocate more than it has: the
    kernel would kill that rank mid-move (a Set-B TinyLlama rank was, under its memory cap,
    moving from uniform's layout to xronos's), and a refused move leaves the run as it was."""
    import torch

    mine = torch.tensor([float(need), float(room)], dtype=torch.float64)
    for r, t in enumerate(group.all_gather(mine, timed=False)):
        n, m = float(t[0]), float(t[1])
        if n > m:
            raise LayoutError(f"re-shard at step {step}: rank {r} would need {n / 2**20:,.0f} MiB more during the "
                              f"move (its new parts, less the old ones freed batch by batch, and a batch's pieces in flight) "
                              f"and has room for {m / 2**20:,.0f} MiB")


def resplit(engine: Any, rank: Rank, word: Reshard, step: int) -> Move:
    """`DPEngine.reshard`: the data-parallel run trains `word.shares` rows per group from `step` on.
    Nothing moves (every rank holds its whole TP shard and the same optimizer state whatever its
    rows) and nothing is exchanged (every rank heard the same word): the engine's shares and its
    rows channel's change, on every rank at the same boundary. A word of another layout, group
    count or batch is refused (LayoutError) before anything changes, the same on every rank."""
    cfg = rank.cfg
    old, new, layout = tuple(engine.shares), word.shares, cfg.layout
    if new is None:
        raise LayoutError(f"re-shard at step {step}: a data-parallel run keeps its layout live ({layout.to_text()}); "
                          "its live change is a new split of the batch (shares)")
    if word.layout != layout:
        raise LayoutError(f"re-split at step {step}: layout {word.layout.to_text()} differs from the run's "
                          f"{layout.to_text()}: a data-parallel run keeps its layout live")
    new = tuple(new)
    if len(new) != len(old):
        raise LayoutError(f"re-split at step {step}: shares {list(new)} name {len(new)} data-parallel groups, the "
                          f"run has {len(old)}")
    if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in new):
        raise LayoutError(f"re-split at step {step}: shares {list(new)}: rows per group must be integers >= 0")
    if sum(new) != cfg.recipe.batch_size:
        raise LayoutError(f"re-split at step {step}: shares {list(new)} sum to {sum(new)} rows, the batch has "
                          f"{cfg.recipe.batch_size}")
    t0 = rank.group.now()
    engine.set_shares(rank, new)
    return Move(step, word.reason, layout.to_text(), layout.to_text(), rank.group.now() - t0, 0, old, new)


MARK_ENV, HOLD_ENV = "XRONOS_RESHARD_MARK", "XRONOS_RESHARD_HOLD"


def _announce(rank: int, step: int) -> None:
    """The test hooks of the module docstring: a mark file, and a wait on the named rank."""
    mark = os.environ.get(MARK_ENV)
    if mark:
        path = Path(mark) / f"rank{rank}-step{step}.pid"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(str(os.getpid()))
        tmp.rename(path)  # whole or absent: the test reads the pid as soon as the name appears
    hold = os.environ.get(HOLD_ENV)
    if hold:
        who, _, seconds = hold.partition(":")
        try:
            target, wait = int(who), float(seconds)
        except ValueError:
            target, wait = -1, -1.0
        if not 0 <= wait < 60:
            raise ValueError(f"{HOLD_ENV}={hold[:40]!r}: expected <rank>:<seconds, 0 to 60>")
        if target == rank:
            time.sleep(wait)


def unit_bytes(family: Any, config: dict[str, Any], task: str, dropout: float | None = None,
               moments: int = 2) -> dict[str, float]:
    # Under LoRA the partitioned base is frozen (no moments): pass moments=0; the adapters' own
    # slices are small next to the base's and are left out.
    """Per kind, the bytes one unit moves in a re-shard: the partitioned tensors that follow the
    kind (found from a two-rank probe layout where rank 1 holds all of that kind and nothing
    else), their elements per unit, times the weight and its `moments` (AdamW: 2)."""
    sizes = family.sizes(config)
    out = {}
    for k in ("attn", "mlp", "vocab"):
        counts = {j: (0, sizes.total(j)) if j == k else (sizes.total(j), 0) for j in ("attn", "mlp", "vocab")}
        specs = specs_per_rank(family, config, task, Layout(**counts), dropout)[1]
        elements = sum(math.prod(s.local_shape) for s in specs.values() if s.dim is not None)
        out[k] = elements * 4 * (1 + moments) / sizes.total(k)  # fp32 weights and moments
    return out


class Policy(Protocol):
    """What `LiveRebalance` asks of a re-balancing policy (`xronos.gateway.plan.rebalance.Rebalancer`)."""

    last_reason: str
    replans: list

    layout: Layout  # the layout it believes the ranks run

    def observe(self, per_rank: list[dict[str, float]]) -> None: ...
    def observe_move(self, moved_bytes: float, seconds: float) -> None: ...
    def moved_to(self, new: Layout) -> None: ...
    def decide(self, step: int) -> Any: ...


class LiveRebalance:
    """`xronos run --rebalance`: rank 0 (the owner) hosts the policy, which `make_policy(engine,
    world_size)` makes on the first boundary (the composition, `xronos.cli.liverank`, passes the
    gateway's `Rebalancer`: this plane does not import the gateway).
    At every boundary after the first step one untimed all_gather carries each rank's last
    iteration's per-kind compute (and the rest, which the policy books to the kinds) and, in rank 0's row, the decision rank 0 took at the previous
    boundary (a flag and the new counts), which every rank then applies: a `Reshard` word. Rank 0
    then feeds the policy and asks it about the next boundary (`decide(step + 1)`): a re-plan lands
    one iteration after the measurements that called for it, for one collective per boundary.
    A re-plan decided at the last boundary is never applied (`applied: false` in the report).
    The finished moves' cost refits the policy's bandwidth. The re-plans and the policy's last
    reason go into the metrics document (`engine.report_extra["rebalance"]`), with the mean time
    rank 0 spends on this at a boundary (`boundary_s_mean`: gather, policy, broadcast; the cost of
    re-balancing when nothing moves; making the policy once is `setup_s`) and the mean time of the
    policy itself (`policy_s_mean`: observe and decide, over `decisions` boundaries)."""

    def __init__(self, engine: Any, make_policy: Callable[[Any, int], Policy]) -> None:
        self.engine, self.make_policy = engine, make_policy
        self.policy: Policy | None = None
        self.pending: Any = None  # rank 0: the re-plan decided at the last boundary, applied at this one
        self.moves_seen = 0
        self.spent_s, self.boundaries = 0.0, 0  # rank 0's time in the policy's boundary work
        self.setup_s = 0.0  # making the policy (once, on the first measured boundary)
        self.policy_s, self.decisions = 0.0, 0  # rank 0's time in the policy itself (observe, decide)

    def at_boundary(self, group: TPGroup, step: int) -> Word | Reshard:
        t0 = time.perf_counter()
        word = self._at_boundary(group, step)
        self.spent_s += time.perf_counter() - t0
        self.boundaries += 1
        if "rebalance" in self.engine.report_extra:
            self.engine.report_extra["rebalance"].update(
                boundary_s_mean=(self.spent_s - self.setup_s) / self.boundaries, setup_s=self.setup_s)
        return word

    def _at_boundary(self, group: TPGroup, step: int) -> Word | Reshard:
        import torch

        eng = self.engine
        rec = eng.last
        if rec is None or group.world_size == 1:  # nothing measured yet; one rank has nothing to balance
            return Word.GO
        if getattr(eng, "trying", False):  # an overlap trial's steps (every rank alike): not the speeds to fit
            return Word.GO
        n = group.world_size
        # One collective per boundary: every rank's last per-kind compute, and in rank 0's row the
        # decision it took at the previous boundary (a flag and the counts), applied now by all.
        row = torch.zeros(4 + 1 + 3 * n, dtype=torch.float64)
        row[:4] = torch.tensor([rec.compute_attn_s, rec.compute_mlp_s, rec.compute_vocab_s, rec.compute_rest_s],
                               dtype=torch.float64)
        if group.rank == 0 and self.pending is not None:
            row[4] = 1
            row[5:] = torch.tensor(counts_row(self.pending.new), dtype=torch.float64)
        rows = group.all_gather(row, timed=False)
        decided = rows[0][4:]
        if group.rank == 0:
            reason = f"rebalance: {self.pending.reason}" if self.pending is not None else ""
            self.pending = None
            self._decide([r[:4] for r in rows], step)
        else:
            reason = "rebalance"
        if not int(decided[0]):
            return Word.GO
        return Reshard(from_counts_row([int(c) for c in decided[1:].tolist()], n), reason)

    def _decide(self, rows: list, step: int) -> None:
        """Rank 0: feed the policy this boundary's measurements and ask it about the next boundary
        (its decision travels with the next gather; the policy skips its first measurements under
        a new layout, which covers the step still run under the old one)."""
        eng = self.engine
        if self.policy is None:
            t0 = time.perf_counter()
            self.policy = self.make_policy(eng, len(rows))
            self.setup_s = time.perf_counter() - t0
        per_rank = [dict(zip(("attn", "mlp", "vocab", "rest"), r.tolist())) for r in rows]
        t0 = time.perf_counter()
        for m in eng.moves[self.moves_seen:]:
            self.policy.observe_move(m.moved_bytes, m.seconds)
        self.moves_seen = len(eng.moves)
        if self.policy.layout != eng.layout.layout():  # a move the policy did not decide (an overlap trial's)
            self.policy.moved_to(eng.layout.layout())
        self.policy.observe(per_rank)
        self.pending = self.policy.decide(step + 1)
        self.policy_s += time.perf_counter() - t0
        self.decisions += 1
        moved = {m.step for m in eng.moves}
        eng.report_extra["rebalance"] = {
            "last_reason": self.policy.last_reason,
            "policy_s_mean": self.policy_s / self.decisions, "decisions": self.decisions,
            "replans": [{"step": r.step, "old": r.old.to_text(), "new": r.new.to_text(),
                         "predicted_old_s": r.predicted_old_s, "predicted_new_s": r.predicted_new_s,
                         "gain": r.gain, "move_s": r.move_s, "reason": r.reason,
                         "applied": r.step in moved} for r in self.policy.replans],
        }


def settled_extra(engine: Any) -> dict[str, Any]:
    """`engine.report_extra` with each live re-plan's or re-split's `applied` read off the moves the
    engine made. The controls write it at a boundary, before that boundary's move: a re-plan taken
    at the next-to-last boundary is applied at the last one, after which no boundary rewrote it
    (`applied: false` beside its move in `reshards`)."""
    extra = dict(engine.report_extra)
    section = extra.get("rebalance")
    if section:
        moved = {m.step for m in engine.moves}
        extra["rebalance"] = {**section, **{key: [{**r, "applied": r["step"] in moved} for r in section[key]]
                                            for key in ("replans", "resplits") if key in section}}
    return extra


class SplitPolicy(Protocol):
    """What `LiveResplit` asks of a re-split policy (`xronos.gateway.plan.dpresplit.Resplitter`)."""

    last_reason: str
    resplits: list

    def observe(self, group_s: list[float]) -> None: ...
    def decide(self, step: int) -> Any: ...


class LiveResplit:
    """`xronos run --shares .. --rebalance`: rank 0 hosts a re-split policy (`make_policy(engine,
    groups)`, composed by `xronos.cli.liverank`), fed each complete step's group times (a group's
    slowest rank's compute). As `LiveRebalance`: one untimed all_gather per boundary carries every
    rank's last compute and, in rank 0's row, the re-split it decided at the previous boundary (a
    flag and the shares), which every rank then applies (a `Reshard` word with shares, the run's
    layout kept). The re-splits and the policy's last reason go into the metrics document
    (`engine.report_extra["rebalance"]`)."""

    def __init__(self, engine: Any, make_policy: Callable[[Any, int], SplitPolicy]) -> None:
        self.engine, self.make_policy = engine, make_policy
        self.policy: SplitPolicy | None = None
        self.pending: Any = None  # rank 0: the re-split decided at the last boundary, applied at this one

    def at_boundary(self, group: TPGroup, step: int) -> Word | Reshard:
        import torch

        eng = self.engine
        rec = eng.last
        if rec is None or group.world_size == 1:
            return Word.GO
        groups, tp = len(eng.shares), group.world_size // len(eng.shares)
        row = torch.zeros(2 + groups, dtype=torch.float64)
        row[0] = rec.compute_s
        if group.rank == 0 and self.pending is not None:
            row[1] = 1
            row[2:] = torch.tensor(self.pending.new, dtype=torch.float64)
        rows = group.all_gather(row, timed=False)
        decided = rows[0]
        if group.rank == 0:
            self.pending = None
            if self.policy is None:
                self.policy = self.make_policy(eng, groups)
            self.policy.observe([max(float(rows[r][0]) for r in range(g * tp, (g + 1) * tp)) for g in range(groups)])
            self.pending = self.policy.decide(step + 1)
            moved = {m.step for m in eng.moves}
            eng.report_extra["rebalance"] = {
                "last_reason": self.policy.last_reason,
                "resplits": [{"step": r.step, "old": list(r.old), "new": list(r.new), "predicted_old_s": r.predicted_old_s,
                              "predicted_new_s": r.predicted_new_s, "gain": r.gain, "reason": r.reason,
                              "applied": r.step in moved} for r in self.policy.resplits],
            }
        if not int(decided[1]):
            return Word.GO
        return Reshard(self.engine_layout(), "rebalance", shares=tuple(int(x) for x in decided[2:].tolist()))

    def engine_layout(self) -> Layout:
        return self.engine.layout.layout()
