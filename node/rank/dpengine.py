"""The data-parallel engine: a rank of a DP×TP mesh (`RunConfig.shares`), pure DP at tp = 1.

What `TPEngine` is to one tensor-parallel group, this is to several data-parallel with each other.
At build, the rank cuts its tensor-parallel and data-parallel groups out of the world
(`xronos.node.dp.mesh.form_mesh`), builds the family's model at its TP rank of `cfg.layout` inside
its TP group, fills it from the weight source over the *world* (`FromOwner` streams every rank of
every group its own slices: each group gets its replica), and wraps it in `DataParallel` over its
DP group. Its data channel is the owner's rows channel (`xronos.node.data.rowschannel`): each rank
receives only its group's rows and the global batch's target count (the owner sends them to the
group's first rank, which broadcasts them over its TP group).

A step: this rank's rows forward and backward, each rank's loss its part of the global mean, so
that after DDP's summing all-reduce every rank of a DP group holds the global batch's gradient of
its TP shard (`xronos.node.dp.replica`); the reported loss is the global batch's
(`DataParallel.global_loss`); clipping is `TPEngine`'s global norm over the *TP group only* (the
DP ranks already hold the same, whole, gradient: summing over them too would count it once per
group); then AdamW and the warm-up schedule exactly as `TPEngine`. Every DP rank steps the same
optimizer on the same gradient: the replicas and their moments stay one model without a word.

Checkpoints and the export are the owner's group's (DP group 0): it gathers over its TP group only
and the owner (world rank 0) writes, as `TPEngine` does for one group; the other groups hold the
same model and do nothing. A checkpoint is consolidated (full tensors), so it resumes under any
mesh, shares or layout, or under plain TP (`TPEngine`), and vice versa; its state.json says the
layout and shares it was saved under.

Live, the run keeps its layout and re-splits its batch (`capabilities.live_reshard`): a `Reshard`
word with shares (and the run's layout) makes every rank train its group's new rows from the next
step (`relayout.resplit`): the engine's shares, its mesh's and its rows channel's change at the same
boundary on every rank, a group may go to or from 0 rows (its replica then joins the gradient
all-reduce with zeros), and nothing moves — every rank holds its whole TP shard and the same AdamW
state whatever its rows. A word with another layout, group count or batch is refused (LayoutError:
the run goes on as it was). The checkpoints, the evaluation and the report follow the current
shares. Evaluation: each group its share of the held-out batches, whole batches in proportion to
the shares, the sums added over the DP group.

Metrics (`IterationRecord`, as `TPEngine`'s): compute per segment kind from the rank's timeline
(its TP group's spans, its DP group's and the world's data spans on the one clock); comm and idle
of the TP collectives (split against its TP peers, `comm_and_idle`) plus those of the gradient
buckets (against its DP peers: the fastest peer's time is the all-reduce, the rest is waiting).
With the `overlap` sync (wall clock) the buckets run on Gloo's thread beside backward: their
seconds are counted as comm/idle though they partly overlapped compute, so compute + comm + idle
may exceed the iteration there.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from typing import Any

import torch

import xronos.node.measure.memwatch as memwatch  # (the module alone: not the measuring room)
from xronos.node.data.rowschannel import Rows, RowsChannel
from xronos.node.dp.mesh import Mesh, form_mesh
from xronos.node.dp.replica import DataParallel
from xronos.node.rank.gradnorm import all_finite
from xronos.node.rank.lifecycle import Capabilities, EvalResult, Rank, RankResult, Reshard, WeightSource
from xronos.node.rank.metrics import IterationRecord, Rusage, comm_and_idle, format_table, segment_compute, summarize
from xronos.node.rank.tpengine import (TPEngine, _exchange_timings, clip_global_grad_norm, eval_result, eval_sums,
                                       stop_unless_finite)


class DPEngine(TPEngine):
    """`TPEngine` over a DP×TP mesh (module docstring). Inherits the checkpoint and export writers
    (run on the owner's group, over its TP group)."""

    capabilities = Capabilities(live_reshard=True, checkpoints=True)  # live: a new split of the batch

    def build(self, rank: Rank, weights: WeightSource, start: int) -> None:
        cfg, world = rank.cfg, rank.group
        self.world = world
        if not cfg.shares:
            raise ValueError("the data-parallel engine needs shares (RunConfig.shares)")
        self.shares: tuple[int, ...] = tuple(cfg.shares)  # the current rows per group (a re-split changes them)
        self.mesh: Mesh = form_mesh(world, cfg.layout.world_size, cfg.shares)
        # The model in its TP group; its weights over the world: the owner serves every rank of every group.
        self.build_model(rank, weights, start, self.mesh.tp, self.mesh.tp.rank)
        self.dp = DataParallel(self.model, self.mesh.dp)
        rank.data = RowsChannel(cfg.recipe, world, rank.data.source, rank.facts.token_types, cfg.layout.world_size,
                                cfg.shares, self.mesh.tp)

    @property
    def groups(self):
        return (self.world, self.mesh.tp, self.mesh.dp)

    def begin(self, rank: Rank, start: int) -> None:
        for g in self.groups:
            g.drain_timings()
            g.drain_spans()
        self.dp.sync.drain()
        self.dp.seed(rank.cfg.recipe.seed + start)  # the same within a TP group, distinct across groups
        self.rusage = Rusage()

    def step(self, rank: Rank, batches: Iterator[tuple[int, Rows]], step: int) -> IterationRecord:
        rec = dp_step(self, rank, batches, step)
        if self._reshard_s:
            rec, self._reshard_s = replace(rec, reshard_s=self._reshard_s), 0.0
        self.last = rec
        return rec

    def reshard(self, rank: Rank, word: Reshard, step: int) -> None:
        """Live, at the boundary: a new split of the batch (`relayout.resplit`; no weights move). A
        word it cannot take raises LayoutError on every rank alike (lifecycle._loop): the run goes on."""
        from xronos.node.rank.relayout import resplit

        m = resplit(self, rank, word, step)
        self.moves.append(m)
        self._reshard_s += m.seconds

    def set_shares(self, rank: Rank, shares: tuple[int, ...]) -> None:
        """From the next step on, `shares` rows per group: the engine's, the mesh's and the rows
        channel's (the owner sends, and every rank receives, by them)."""
        self.shares = tuple(shares)
        self.mesh = replace(self.mesh, shares=self.shares)
        rank.data.shares = self.shares

    def _owner_group(self, rank: Rank) -> Rank | None:
        """The owner's group as `TPEngine`'s writers see a run: its TP group (None elsewhere)."""
        return replace(rank, group=self.mesh.tp) if self.mesh.dp.rank == 0 else None

    def checkpoint(self, rank: Rank, ckpt_dir: str | None, meta: dict[str, Any]) -> None:
        mine = self._owner_group(rank)
        if mine is not None:
            super().checkpoint(mine, ckpt_dir, {**meta, "shares": list(self.shares)})
        for g in self.groups:
            g.drain_timings()
            g.drain_spans()

    def export(self, rank: Rank) -> None:
        mine = self._owner_group(rank)
        if mine is not None:
            super().export(mine)

    def evaluate(self, rank: Rank) -> EvalResult | None:
        """Each group its share of the held-out batches (`rowschannel.eval_groups`), the groups'
        sums added over the DP group (untimed: a report, not training)."""
        n_train, n_eval, task = rank.facts.n_train, rank.facts.n_eval, rank.cfg.recipe.task
        if n_eval == 0:
            return None
        sums = torch.tensor(eval_sums(self.model, task, rank.data.eval(n_train, n_eval)), dtype=torch.float64)
        if self.mesh.dp.world_size > 1:
            self.mesh.dp.all_reduce(sums, timed=False)
        memwatch.phase("eval")
        for g in self.groups:  # evaluation's collectives are not the next step's
            g.drain_spans()
        loss_sum, weight, correct = sums.tolist()
        return eval_result(task, (loss_sum, int(weight), int(correct)), n_eval)

    def report(self, rank: Rank, per_rank: list[torch.Tensor], result: RankResult) -> dict:
        """The owner: `TPEngine`'s document, one summary per world rank (its TP rank's share of the
        layout), plus the mesh."""
        cfg, tp = rank.cfg, rank.cfg.layout.world_size
        records = [[IterationRecord.from_row(row) for row in p.tolist()] for p in per_rank]
        summaries = [replace(summarize(r % tp, cfg.layout, recs), rank=r) for r, recs in enumerate(records)]
        print(format_table(summaries), flush=True)
        print(f"data parallel: {len(self.shares)} groups of {tp} rank(s), rows per group {list(self.shares)}", flush=True)
        for m in self.moves:
            print(f"re-split before step {m.step} ({m.reason}): rows per group {list(m.old_shares or ())} -> "
                  f"{list(m.new_shares or ())}, nothing moved", flush=True)
        for name, ev in (("before", result.eval_before), ("after", result.eval_after)):
            if ev is not None:
                metric = f"accuracy {ev.accuracy:.4f}" if ev.accuracy is not None else f"perplexity {ev.perplexity:.3f}"
                print(f"eval {name} training: loss {ev.loss:.4f}, {metric} ({ev.rows} rows)", flush=True)
        from xronos.node.rank.relayout import settled_extra  # (lazy, as reshard's: relayout is above the engines)

        return {
            "clock": rank.group.clock.describe(),
            "config": cfg.model_dump(exclude={"rank", "rendezvous_host", "rendezvous_port", "group_key"}),
            "mesh": {"tp": tp, "shares": list(self.shares), "sync": self.dp.sync.mode},  # the final shares
            "eval_before": asdict(result.eval_before) if result.eval_before else None,
            "eval_after": asdict(result.eval_after) if result.eval_after else None,
            # live re-splits: when, why, old and new shares (the layout kept), 0 bytes, the slowest rank's seconds
            "reshards": [{**m.as_dict(), "seconds": max(r.reshard_s for recs in records for r in recs
                                                        if r.step == m.step)}
                         for m in self.moves],
            "ranks": [{"summary": asdict(s), "iterations": [asdict(r) for r in recs]}
                      for s, recs in zip(summaries, records)],
            **settled_extra(self),
        }


def dp_step(engine: DPEngine, rank: Rank, batches: Iterator[tuple[int, Rows]], step: int) -> IterationRecord:
    """One iteration of this rank's rows and its measurements (`tpengine.train_step`'s, for a mesh)."""
    cfg, world, mesh, dp = rank.cfg, engine.world, engine.mesh, engine.dp
    model, opt = engine.model, engine.opt
    for g in engine.groups:  # whatever ran since the last step (evaluation, checkpoint) is not this step's
        g.drain_timings()
        g.drain_spans()
    dp.sync.drain()
    t0, w0 = world.now(), time.perf_counter()  # one clock for every group of this rank
    epoch, got = next(batches)
    part = dp.forward_backward(got.rows, got.total)
    memwatch.phase("backward")
    loss = dp.global_loss(part)  # the same on every rank: all stop at the same step if it is not finite
    stop_unless_finite("loss", loss, step)
    if cfg.recipe.max_grad_norm is not None:
        with mesh.tp.segment("rest"):
            norm = clip_global_grad_norm(model, engine.replicated, cfg.recipe.max_grad_norm, mesh.tp)
        stop_unless_finite("gradient norm", norm, step)
        memwatch.phase("clip")
    else:  # every DP rank holds the same summed gradient: each sees the same non-finite element
        with mesh.tp.segment("rest"):
            finite = all_finite(p.grad for p in model.parameters() if p.grad is not None)
        stop_unless_finite("gradient", 0.0 if finite else math.nan, step)
    lr = opt.param_groups[0]["lr"]
    opt.step()
    memwatch.phase("step")
    engine.sched.step()
    opt.zero_grad(set_to_none=True)
    world.settle()
    t1, wall_s = world.now(), time.perf_counter() - w0
    spans = {id(g): g.drain_spans() for g in engine.groups}
    for g in engine.groups:
        g.drain_timings()
    buckets = dp.sync.drain()
    merged = sorted((s for ss in spans.values() for s in ss), key=lambda s: s.start)
    data_s = sum(s.seconds for s in merged if s.tag == "data")
    tp_own = [s.seconds for s in spans[id(mesh.tp)] if s.tag != "data" and s.name != "mark"]
    if dp.sync.mode == "clocked":  # the buckets met the clock as the DP group's collectives
        dp_own = [s.seconds for s in spans[id(mesh.dp)] if s.tag != "data" and s.name != "mark"]
    else:
        dp_own = [b.seconds for b in buckets]
    tp_comm, tp_idle = comm_and_idle(_exchange_timings(tp_own, mesh.tp), mesh.tp.rank)
    dp_comm, dp_idle = comm_and_idle(_exchange_timings(dp_own, mesh.dp), mesh.dp.rank)
    per_kind = segment_compute(merged, t0, t1)
    vol, invol = engine.rusage.delta()
    return IterationRecord(
        step=step, epoch=epoch, loss=loss, lr=lr, iteration_s=t1 - t0,
        compute_s=sum(per_kind.values()), comm_s=tp_comm + dp_comm, idle_s=tp_idle + dp_idle, data_s=data_s,
        voluntary_ctx_switches=vol, involuntary_ctx_switches=invol, peak_rss=memwatch.watch().peak(),
        **{f"compute_{k}_s": v for k, v in per_kind.items()}, wall_s=wall_s,
    )
