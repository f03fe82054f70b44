"""A job's rank: `python -m xronos.node.rank.jobrank CONFIG.json` (a JobRankConfig), started by the
node service through `process.RankProcess` (so its control loop stays responsive and a cancel can
free all the memory by killing it).

A thin caller of the rank lifecycle (`xronos.node.rank.lifecycle`) with `xronos run`'s engine, so a
job and a local run of the same spec and plan export the same model. What a job brings:
- its weight source: the owner (rank 0) streams every rank its slices (other nodes need no model
  files) — from the base checkpoint, or on resume from its last consolidated checkpoint (weights
  and AdamW moments, saved under any layout of this model);
- its control source (`JobControl`): the node service's orders (`messages.RankOrder` on stdin:
  pause, resume, cancel, and on the owner a live re-shard, or a data-parallel job's re-split of its
  batch), of which the owner broadcasts its latest
  at every iteration boundary, so all ranks pause, resume, stop or move at the same boundary; EOF on
  stdin means the node service died, and so does this process (as it does through PR_SET_PDEATHSIG);
- consolidated checkpoints every `checkpoint_interval` steps;
- its sink (`JobEvents`): `messages.RankEvent`s to the node service on the events pipe.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import torch

from pydantic import ValidationError

from xronos.node.models.loading import SafetensorsSource, ShardSource
from xronos.node.models.registry import family_for
from xronos.node.rank import messages as msg
from xronos.node.rank.checkpoint import CheckpointSource, check_saved_layout, find_checkpoint
from xronos.node.rank.lifecycle import (Checkpoints, EvalResult, FromOwner, JobFault, Rank, RankResult, Reshard,
                                        Sink, Word, run)
from xronos.node.rank.relayout import counts_row, from_counts_row
from xronos.node.rank.spawn import EventPipe, main_process
from xronos.node.rank.tpengine import TPEngine
from xronos.node.rank.dpengine import DPEngine
from xronos.node.runconfig import JobRankConfig
from xronos.node.tp.group import TPGroup

PAUSE = 1  # besides Word.GO and Word.STOP: the owner holds every rank at the boundary


RESHARD, RESPLIT = 1, 2  # the control row's flag: a new layout; the layout with new shares (data parallelism)


class JobControl:
    """The node service's latest order, read from stdin on a thread; the owner broadcasts it each
    step. A re-shard order (the owner's only) travels in the same broadcast: every rank moves at
    the same boundary, the first at or after `at_step`. `tp` is the ranks of the layout (every
    rank's, or with data parallelism each group's), `groups` the job's data-parallel groups (0:
    none), whose new shares a data-parallel job's order carries in the same row."""

    CODES = {msg.Pause: PAUSE, msg.Resume: int(Word.GO), msg.Cancel: int(Word.STOP)}

    def __init__(self, events: EventPipe, tp: int, groups: int = 0) -> None:
        self.code, self.paused, self.events = int(Word.GO), False, events
        self.tp, self.groups = tp, groups
        self.reshard: msg.Reshard | None = None  # the owner's pending order
        self.reason = "rebalance"  # the owner's reason for the re-shard it is broadcasting
        self.changed = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            try:
                order = msg.read_order(line)
            except ValidationError as exc:  # not an order of ours: said in the log, nothing done
                print(f"order refused: {exc}"[:msg.DETAIL], file=sys.stderr)
                continue
            if isinstance(order, msg.Reshard):  # a later order replaces one still pending
                why = self._unsendable(order)  # the node service checks these too
                if why:
                    self.events.send(msg.ReshardRefused(detail=why))
                else:
                    self.reshard = order
                continue
            self.code = self.CODES[type(order)]
            self.changed.set()
        os._exit(137)  # stdin closed: the node service is gone, and this rank with it

    def _unsendable(self, order: msg.Reshard) -> str | None:
        """Why an order cannot travel in the control row (its shape is the job's), or None. What
        fits the row but not the run (counts off the model, shares off the batch) is refused at
        the boundary by every rank alike (the engine's `reshard`)."""
        if order.layout.world_size != self.tp:
            return f"layout has {order.layout.world_size} ranks, the job {self.tp}" + (
                " per data-parallel group" if self.groups else "")
        if order.shares is not None and not self.groups:
            return f"shares {order.shares}: the job is tensor-parallel (no data-parallel groups to re-split)"
        if order.shares is not None and len(order.shares) != self.groups:
            return f"shares {order.shares} name {len(order.shares)} data-parallel groups, the job has {self.groups}"
        return None

    def _order(self, group: TPGroup, step: int) -> torch.Tensor:
        """The owner's row: [code, re-shard flag, the layout's counts (3 x tp), the shares (groups)]."""
        row = torch.zeros(2 + 3 * self.tp + self.groups, dtype=torch.int64)
        row[0] = self.code if group.rank == 0 else int(Word.GO)
        order = self.reshard if group.rank == 0 else None
        if order is not None and step >= order.at_step and row[0] == int(Word.GO):
            self.reshard, self.reason = None, order.reason
            row[1] = RESPLIT if order.shares is not None else RESHARD
            row[2:2 + 3 * self.tp] = torch.tensor(counts_row(order.layout), dtype=torch.int64)
            if order.shares is not None:
                row[2 + 3 * self.tp:] = torch.tensor(order.shares, dtype=torch.int64)
        return row

    def at_boundary(self, group: TPGroup, step: int) -> Word | Reshard:
        """Agree on GO, STOP or a re-shard for the next iteration, holding every rank here while
        paused. The broadcast is untimed: it is not part of the training step."""
        while True:
            flag = self._order(group, step)
            group.broadcast(flag, src=0, timed=False)
            code = int(flag[0])
            if code == PAUSE:
                if not self.paused:
                    self.paused = True
                    self.events.send(msg.Status(status="paused"))
                self.changed.wait(0.5)  # heartbeat: keeps peers inside their Gloo timeout
                self.changed.clear()
                continue
            if self.paused:
                self.paused = False
                self.events.send(msg.Status(status="running"))
            if code == int(Word.GO) and int(flag[1]):
                values = [int(x) for x in flag[2:].tolist()]
                layout = from_counts_row(values[:3 * self.tp], self.tp)
                shares = tuple(values[3 * self.tp:]) if int(flag[1]) == RESPLIT else None
                return Reshard(layout, self.reason if group.rank == 0 else "rebalance", shares=shares)
            return Word(code)


class JobEvents(Sink):
    """The node service hears of every milestone; evaluations, checkpoints and the export only
    from the owner."""

    def __init__(self, events: EventPipe) -> None:
        self.events, self.ended = events, False

    def started(self, rank: Rank, start: int) -> None:
        self.events.send(msg.Status(status="running"))

    def evaluated(self, rank: Rank, when: str, result: EvalResult | None) -> None:
        if rank.owner and result is not None:
            accuracy = result.accuracy is not None
            self.events.send(msg.Evaluated(when=when, name="accuracy" if accuracy else "perplexity",
                                           metric=result.accuracy if accuracy else result.perplexity,
                                           loss=result.loss))

    def iteration(self, rank: Rank, rec: Any) -> None:
        self.events.send(msg.Metrics(
            step=rec.step + 1, epoch=rec.epoch, loss=rec.loss, compute_s=rec.compute_s,
            compute_attn_s=rec.compute_attn_s, compute_mlp_s=rec.compute_mlp_s, compute_vocab_s=rec.compute_vocab_s,
            compute_rest_s=rec.compute_rest_s, comm_s=rec.comm_s, idle_s=rec.idle_s, iteration_s=rec.iteration_s,
            voluntary_ctx_switches=rec.voluntary_ctx_switches, involuntary_ctx_switches=rec.involuntary_ctx_switches,
            peak_rss=rec.peak_rss, clock=rank.group.clock.name, wall_s=rec.wall_s))

    def resharded(self, rank: Rank, step: int, word: Reshard) -> None:
        if rank.owner:
            move = rank.engine.last_move()
            self.events.send(msg.Resharded(step=step, layout=word.layout, reason=word.reason[:256],
                                           seconds=move.seconds if move else None,
                                           moved_bytes=move.moved_bytes if move else None,
                                           shares=list(word.shares) if word.shares is not None else None))

    def reshard_refused(self, rank: Rank, step: int, word: Reshard, reason: str) -> None:
        if rank.owner:
            self.events.send(msg.ReshardRefused(detail=f"re-shard at step {step} refused: {reason}"[:msg.DETAIL]))

    def tried(self, rank: Rank, outcome: Any) -> None:
        if rank.owner:
            self.events.send(msg.OverlapTried(step=outcome.step, kept=outcome.kept_label, seconds=outcome.seconds))

    def checkpointed(self, rank: Rank, step: int) -> None:
        if rank.owner:
            self.events.send(msg.Checkpointed(step=step))

    def cancelled(self, rank: Rank, step: int) -> None:
        self.ended = True
        self.events.send(msg.Cancelled(step=step))

    def finish(self, rank: Rank, result: RankResult) -> None:
        self.ended = True
        self.events.send(msg.Completed(step=rank.steps, epoch=max(rank.steps - 1, 0) // rank.per_epoch,
                                       export_dir=rank.cfg.recipe.export_dir if rank.owner else None))


def weights(job: JobRankConfig) -> FromOwner:
    """The owner serves its base checkpoint, or on resume the consolidated checkpoint of that step
    (saved under any layout of this model; resumed under this one)."""
    if job.run.rank != 0:
        return FromOwner(None)
    k = job.resume_step

    def open_source(model: Any) -> ShardSource:
        if k == 0:
            return SafetensorsSource(job.run.recipe.model_dir, job.allowed_dirs)
        if not job.checkpoint_dir:
            raise ValueError(f"resume from step {k}: this rank has no checkpoint directory")
        # The gateway's resume point may be one checkpoint behind the newest (it decided before it
        # heard of the last one): that one is kept beside it.
        meta = find_checkpoint(job.checkpoint_dir, k)
        check_saved_layout(meta, family_for(model.config).sizes(model.config))
        # A LoRA checkpoint holds the trained tensors only: the frozen base comes from the base checkpoint.
        return CheckpointSource(meta["dir"], base_dir=job.run.recipe.model_dir, allowed_dirs=job.allowed_dirs)

    return FromOwner(open_source)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m xronos.node.rank.jobrank CONFIG.json", file=sys.stderr)
        return 2
    job = JobRankConfig.model_validate_json(Path(argv[1]).read_text())
    events = EventPipe()  # started boxed: dying with the node service (node/box/limits.py)
    sink = JobEvents(events)
    checkpoints = Checkpoints(job.checkpoint_dir, job.checkpoint_interval,
                              {"job_id": job.job_id, "plan_version": job.plan_version})
    try:
        engine = DPEngine() if job.run.shares else TPEngine()  # shares: the plan's data-parallel mesh
        control = JobControl(events, job.run.layout.world_size, len(job.run.shares or ()))
        run(job.run, engine, weights=weights(job), control=control, sink=sink,
            checkpoints=checkpoints, start=job.resume_step, allowed_dirs=job.allowed_dirs)
    except Exception as exc:  # reported to the node service, which tells the gateway
        traceback.print_exc()
        if not sink.ended:  # a failure leaving the group after the end changes nothing reported
            # job_fault: the training itself failed (JobFault), which re-planning would only repeat
            events.send(msg.Failed(detail=f"{type(exc).__name__}: {exc}"[:msg.DETAIL], job_fault=isinstance(exc, JobFault)))
        return 1
    return 0


if __name__ == "__main__":
    main_process(main)
