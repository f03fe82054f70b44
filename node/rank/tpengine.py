"""Our engine on a rank (`TPEngine`, driven by `xronos.node.rank.lifecycle`): same batches, same seeds,
same optimizer on every rank.

Rank 0 owns the data: it tokenises each batch and broadcasts the tensors (booked as data time,
not as TP communication). Every rank then runs its shard of the model; the engine's collectives
go through the `TPGroup`, whose timings are drained each iteration and compared across ranks
(one untimed all_gather) to split idle time from communication, and whose tagged timeline splits
the compute by segment kind (`metrics.segment_compute`). `xronos run` and a job's ranks train
with this engine, so a job and a local run of the same spec and plan export the same model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from typing import Any

import torch

from xronos.node.rank.checkpoint import load_moments, save_checkpoint
from xronos.node.data.batches import Batch, BatchChannel
from xronos.node.rank.gradnorm import all_finite, squared_norm
import xronos.node.measure.memwatch as memwatch  # (the module alone: not the measuring room)
from xronos.node.rank.metrics import IterationRecord, Rusage, comm_and_idle, format_table, segment_compute, summarize
from xronos.node.models.adapters import exported, save_lora_exports
from xronos.node.models.export import gather_full, save_hf_dir
from xronos.node.models.exportfiles import remove_leftovers
from xronos.node.models.gguf import save_gguf_export
from xronos.node.models.registry import family_for
from xronos.node.rank.optim import adamw
from xronos.node.rank.optstate import allocate_state
from xronos.node.rank.trial import Trial, TrialOutcome
from xronos.node.runconfig import RunConfig
from xronos.node.rank.lifecycle import (Capabilities, Engine, EvalResult, JobFault, Rank, RankResult, Reshard,
                                        WeightSource)
from xronos.node.tp.group import TPGroup
from xronos.node.tp.layout import ShardLayout
from xronos.node.tp.lora import add_lora
from xronos.protocol.layout import LayoutError
from xronos.protocol.messages import Overlap


def lr_factor(step: int, warmup_steps: int) -> float:
    """Linear warmup to the full rate over `warmup_steps` (step 0 already at 1/warmup), then constant."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0


def clip_global_grad_norm(model: torch.nn.Module, replicated: set[str], max_norm: float, group: TPGroup) -> float:
    """torch.nn.utils.clip_grad_norm_ over the *unsharded* model: partitioned parts' squares are
    summed across ranks, replicated parts (identical everywhere) counted once."""
    part = torch.zeros(1, dtype=torch.float64)
    rep = torch.zeros(1, dtype=torch.float64)
    grads = []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        grads.append(p.grad)
        sq = squared_norm(p.grad)  # chunked: no float64 copy of the whole gradient
        (rep if name in replicated else part).add_(sq)
    group.all_reduce(part)
    total = float((part + rep).sqrt())
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total


def stop_unless_finite(what: str, value: float, step: int) -> None:
    """End the run at this step, before the optimizer steps, when the loss or the gradient norm is
    not finite: nothing of it reaches the weights, the last checkpoint stays the newest, nothing is
    exported. The loss is the same on every rank (the model all-reduces it) and so is the clipped
    gradient's norm (all-reduced in `clip_global_grad_norm`): every rank stops at the same step with
    no collective of its own."""
    if not math.isfinite(value):
        raise JobFault(f"step {step + 1}: the {what} is {value}, not finite: training diverged (learning rate too "
                       "high?) or the data is bad; stopped before the optimizer step, nothing exported")


@torch.no_grad()
def evaluate(model, cfg: RunConfig, channel: BatchChannel, n_train: int, n_eval: int) -> EvalResult | None:
    """Loss and accuracy (classify) or perplexity (causal LM) over the held-out tail."""
    if n_eval == 0:
        return None
    return eval_result(cfg.recipe.task, eval_sums(model, cfg.recipe.task, channel.eval(n_train, n_eval)), n_eval)


@torch.no_grad()
def eval_sums(model, task: str, batches) -> tuple[float, int, int]:
    """(summed loss, weight, correct) over `batches`: the weight is rows (classify) or shifted
    target tokens (causal LM); what `eval_result` averages (and a data-parallel run sums over its
    groups first)."""
    model.eval()
    loss_sum, weight, correct = 0.0, 0, 0
    for b in batches:
        if task == "classify":
            logits = model.logits(b.input_ids, b.attention_mask, b.token_type_ids)  # [b, labels]
            loss_sum += float(torch.nn.functional.cross_entropy(logits.float(), b.labels, reduction="sum"))
            correct += int((logits.argmax(-1) == b.labels).sum())
            weight += b.labels.numel()
        else:
            tokens = int((b.labels[:, 1:] != -100).sum())  # the loss is a mean over shifted targets
            loss_sum += float(model(b.input_ids, b.attention_mask, b.labels, b.token_type_ids)) * tokens
            weight += tokens
    model.train()
    return loss_sum, weight, correct


def eval_result(task: str, sums: tuple[float, int, int], n_eval: int) -> EvalResult:
    loss_sum, weight, correct = sums
    loss = loss_sum / max(weight, 1)
    if task == "classify":
        return EvalResult(loss, correct / weight, None, n_eval)
    return EvalResult(loss, None, math.exp(min(loss, 50.0)), n_eval)


def _exchange_timings(own: list[float], group: TPGroup) -> torch.Tensor:
    """[world, C] collective durations of every rank (untimed: it is measurement, not training)."""
    mine = torch.tensor(own, dtype=torch.float64)
    if group.world_size == 1 or not own:
        return mine.unsqueeze(0)
    return torch.stack(group.all_gather(mine, timed=False))


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
               group: TPGroup, cfg: RunConfig, replicated: set[str], batches: Iterator[tuple[int, Batch]],
               step: int, rusage: Rusage) -> IterationRecord:
    """One training iteration on this rank and its measurements (the engine's step)."""
    group.drain_timings()  # whatever ran since the last step (evaluation, checkpoint) is not this step's
    group.drain_spans()
    t0, w0 = group.now(), time.perf_counter()  # the group's clock (virtual on an emulated box); wall beside
    epoch, batch = next(batches)
    loss = model(batch.input_ids, batch.attention_mask, batch.labels, batch.token_type_ids)
    memwatch.phase("forward")
    stop_unless_finite("loss", float(loss.detach()), step)
    loss.backward()
    memwatch.phase("backward")
    if cfg.recipe.max_grad_norm is not None:
        with group.segment("rest"):
            norm = clip_global_grad_norm(model, replicated, cfg.recipe.max_grad_norm, group)
        stop_unless_finite("gradient norm", norm, step)
        memwatch.phase("clip")
    else:  # no norm to read: each rank looks at its own gradients (a non-finite one reaches all ranks'
        with group.segment("rest"):  # replicated gradients through the backward all-reduces)
            finite = all_finite(p.grad for p in model.parameters() if p.grad is not None)
        stop_unless_finite("gradient", 0.0 if finite else math.nan, step)
    lr = opt.param_groups[0]["lr"]
    opt.step()
    memwatch.phase("step")
    sched.step()
    opt.zero_grad(set_to_none=True)
    loss_v = float(loss.detach())
    group.settle()
    t1, wall_s = group.now(), time.perf_counter() - w0
    iteration_s = t1 - t0
    group.drain_timings()
    spans = group.drain_spans()
    data_s = sum(s.seconds for s in spans if s.tag == "data")
    own = [s.seconds for s in spans if s.tag != "data" and s.name != "mark"]
    comm_s, idle_s = comm_and_idle(_exchange_timings(own, group), cfg.rank)
    per_kind = segment_compute(spans, t0, t1)  # sums to iteration_s - data_s - sum(own)
    vol, invol = rusage.delta()
    return IterationRecord(
        step=step, epoch=epoch, loss=loss_v, lr=lr, iteration_s=iteration_s,
        compute_s=sum(per_kind.values()), comm_s=comm_s, idle_s=idle_s, data_s=data_s,
        voluntary_ctx_switches=vol, involuntary_ctx_switches=invol, peak_rss=memwatch.watch().peak(),
        **{f"compute_{k}_s": v for k, v in per_kind.items()}, wall_s=wall_s,
    )


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps (those that require a gradient): every one, or with
    LoRA the adapters (and a classification head); the frozen base gets no AdamW state."""
    return [p for p in model.parameters() if p.requires_grad]


class TPEngine(Engine):
    """The family's tensor-parallel model at this rank's layout, AdamW with linear warm-up (from
    the resumed step on), optional global-norm clipping; evaluation on the held-out tail;
    consolidated checkpoints and the export as a Hugging Face directory, written by the owner."""

    capabilities = Capabilities(live_reshard=True, checkpoints=True)

    def __init__(self) -> None:
        self.lora: Any = None  # the family's LoRA settings (set at build; None: full fine-tuning)
        self.moves: list = []  # live re-shards (relayout.Move), in order
        self.refused: list[dict[str, Any]] = []  # re-shards refused before anything moved: step, reason, why
        self.last: IterationRecord | None = None  # the latest step's record (what a re-balancer measures)
        self.report_extra: dict[str, Any] = {}  # sections others add to the metrics document (re-plans)
        self._reshard_s = 0.0  # booked on the next iteration's record
        self.trial: Trial | None = None  # the overlap modes tried against each other (node/rank/trial.py)
        self.trial_note: str | None = None  # why a trial the plan asked for did not run
        self.outcome: TrialOutcome | None = None
        self._told = self._moved = False

    def build(self, rank: Rank, weights: WeightSource, start: int) -> None:
        overlap = getattr(rank.cfg, "overlap", None)
        if overlap is not None:  # the plan's overlap of the all-reduces with compute (node/tp/overlap.py)
            _apply(rank.group, overlap)
        self.build_model(rank, weights, start, rank.group, rank.cfg.rank)

    def build_model(self, rank: Rank, weights: WeightSource, start: int, group: TPGroup, tp_rank: int) -> None:
        """The model at TP rank `tp_rank` of the layout in `group` (its tensor-parallel group: the
        world here, a mesh's TP group in `dpengine`), its weights from `weights` over the world
        (`rank.group`: the owner serves every rank), AdamW and the schedule."""
        cfg = rank.cfg
        config = rank.facts.config
        self.layout = ShardLayout.of(cfg.layout, tp_rank)
        self.family = family_for(config)
        self.model = self.family.build(config, cfg.recipe.task, self.layout, group, dropout=cfg.recipe.dropout)
        self.lora = self.family.lora_settings(cfg.recipe.lora)
        if self.lora is not None:  # adapters on the target layers, the rest frozen (on the meta device)
            self.lora_modules = add_lora(self.model, self.lora)
        self.specs = self.model.tensor_specs()

        def optimizer(source) -> None:  # the parameters exist now (materialized from meta)
            memwatch.phase("load")
            self.opt = adamw(trainable(self.model), lr=cfg.recipe.lr, weight_decay=cfg.recipe.weight_decay)
            if start > 0:
                load_moments(self.opt, self.model, self.specs, source, start)
            allocate_state(self.opt)  # below the per-iteration working set (node/rank/optstate.py)

        weights.load(self.model, rank.group, then=optimizer)
        memwatch.phase("build")
        self.model.train()
        self.replicated = {name for name, s in self.specs.items() if s.dim is None}
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s + start, cfg.recipe.warmup_steps))

    def evaluate(self, rank: Rank) -> EvalResult | None:
        # Held-out batches may be shorter than the chunks (the last one), and evaluation has no
        # backward to hide: its forward runs unchunked, every all-reduce blocking as ever.
        chunks, rank.group.chunks = rank.group.chunks, 1
        try:
            result = evaluate(self.model, rank.cfg, rank.data, rank.facts.n_train, rank.facts.n_eval)
        finally:
            rank.group.chunks = chunks
        memwatch.phase("eval")
        return result

    def begin(self, rank: Rank, start: int) -> None:
        rank.group.drain_timings()
        self.model.seed(rank.cfg.recipe.seed + start)  # dropout streams start from the same point on every rank
        self.rusage = Rusage()
        spec = getattr(rank.cfg, "trial", None)
        if spec is not None and rank.group.world_size > 1:
            trial = Trial(spec, start)
            if trial.fits(rank.steps):
                self.trial = trial
            else:  # every rank knows the run's length alike: none of them tries
                self.trial_note = (f"overlap trial not run: it needs {spec.steps} steps from step {start}, "
                                   f"the run has {rank.steps - start}")

    def step(self, rank: Rank, batches: Iterator[tuple[int, Batch]], step: int) -> IterationRecord:
        trying = self.trial is not None and self.outcome is None
        if trying:
            _apply(rank.group, self.trial.mode(step))
        rec = train_step(self.model, self.opt, self.sched, rank.group, rank.cfg, self.replicated, batches, step,
                         self.rusage)
        if self._reshard_s:
            rec, self._reshard_s = replace(rec, reshard_s=self._reshard_s), 0.0
        if trying:
            self.trial.record(step, rec.iteration_s)
            if step == self.trial.last:
                self._decide(rank.group)
        self.last = rec
        return rec

    def _decide(self, group: TPGroup) -> None:
        """Every rank gives each mode's median; the slowest rank's counts (untimed: measurement)."""
        worst = group.all_reduce(torch.tensor(self.trial.medians(), dtype=torch.float64), "max", timed=False)
        self.outcome = self.trial.decide(worst.tolist())
        _apply(group, self.outcome.kept)

    @property
    def trying(self) -> bool:
        """Whether the latest step ran in the overlap trial (its time is a mode's, not the plan's)."""
        return self.trial is not None and self.last is not None and self.last.step <= self.trial.last

    def tried(self) -> TrialOutcome | None:
        """The trial's outcome, once, at the boundary after it was decided."""
        if self.outcome is None or self._told:
            return None
        self._told = True
        return self.outcome

    def own_move(self) -> Reshard | None:
        """After a trial that kept a mode with a layout of its own: that layout, once (none when
        the ranks already hold it, e.g. moved there by a re-balancer meanwhile)."""
        if self.outcome is None or self.outcome.layout is None or self._moved:
            return None
        self._moved = True
        if self.outcome.layout == self.layout.layout():
            return None
        return Reshard(self.outcome.layout, f"overlap trial kept {self.outcome.kept_label}: the layout planned for it")

    def reshard(self, rank: Rank, word: Reshard, step: int) -> None:
        """Live, at the boundary: weights and AdamW state move to `word.layout` (xronos.node.rank.relayout)."""
        from xronos.node.rank.relayout import SpecCache, move

        if not hasattr(self, "spec_cache"):
            self.spec_cache = SpecCache(self.family, rank.facts.config, rank.cfg.recipe.task, rank.cfg.recipe.dropout, self.lora)
        try:
            m = move(self, rank, word, step)
        except LayoutError as exc:  # refused alike on every rank, before anything moved (the caller goes on)
            self.refused.append({"step": step, "reason": word.reason, "refused": str(exc)})
            raise
        self.moves.append(m)
        self._reshard_s += m.seconds

    def last_move(self) -> Any | None:
        return self.moves[-1] if self.moves else None

    def checkpoint(self, rank: Rank, ckpt_dir: str | None, meta: dict[str, Any]) -> None:
        meta = {**meta, "layout": self.layout.layout().model_dump(mode="json")}  # the current one
        save_checkpoint(ckpt_dir or "", self.model, self.specs, self.layout, rank.group, self.opt,
                        rank.facts.config, rank.cfg.recipe.task, meta)
        memwatch.phase("checkpoint")
        rank.group.drain_timings()

    def export(self, rank: Rank) -> None:
        r = rank.cfg.recipe
        if r.export_dir is None:
            return
        specs = self.specs
        if self.lora is not None and not (r.export_merged or r.export_gguf):
            # An adapter-only export writes the adapters (and a classifier's head): gathering the
            # frozen base as well put the whole model on the owner for nothing (1.2 GiB of a
            # qwen2.5-1.5b 2-block LoRA run, bench/results/mem-peak-lora.md).
            specs = {n: s for n, s in specs.items() if exported(s.hf_name, r.task)}
        state = gather_full(self.model, specs, self.layout, rank.group, dst=0)
        if rank.owner and not all_finite(state.values()):  # the last step's update overflowed
            raise JobFault("the trained weights are not finite (inf or nan): nothing exported")
        if rank.owner and self.lora is not None:  # a PEFT adapter directory (+ the merged model)
            save_lora_exports(r.export_dir, rank.facts.config, r.task, state, self.lora, self.lora_modules,
                              r.model_dir, merged=r.export_merged)
        elif rank.owner:
            save_hf_dir(r.export_dir, rank.facts.config, r.task, state, r.model_dir)
        if rank.owner and r.export_gguf:  # llama.cpp / Ollama: model-<type>.gguf + Modelfile (merged under LoRA)
            save_gguf_export(r.export_dir, rank.facts.config, state, r.model_dir, r.export_gguf, self.lora)
        if rank.owner:  # an earlier export's files this one did not replace (an old adapter, GGUF, ...)
            remove_leftovers(r.export_dir, r)
        del state
        memwatch.phase("export")
        rank.group.drain_timings()

    def report(self, rank: Rank, per_rank: list[torch.Tensor], result: RankResult) -> dict:
        """Rank 0 of `xronos run`: the per-rank table and evaluations on stdout, the metrics document."""
        cfg = rank.cfg
        records = [[IterationRecord.from_row(row) for row in p.tolist()] for p in per_rank]
        summaries = [summarize(r, self.layout.layout(), recs) for r, recs in enumerate(records)]  # final layout
        print(format_table(summaries), flush=True)
        for name, ev in (("before", result.eval_before), ("after", result.eval_after)):
            if ev is not None:
                metric = f"accuracy {ev.accuracy:.4f}" if ev.accuracy is not None else f"perplexity {ev.perplexity:.3f}"
                print(f"eval {name} training: loss {ev.loss:.4f}, {metric} ({ev.rows} rows)", flush=True)
        for m in self.moves:
            print(f"re-sharded before step {m.step} ({m.reason}): {m.old} -> {m.new}, {m.moved_bytes} bytes, "
                  f"{m.seconds:.3f} s", flush=True)
        for r in self.refused:
            print(f"re-shard before step {r['step']} ({r['reason']}) refused, the run went on as it was: "
                  f"{r['refused']}", flush=True)
        if self.outcome is not None:
            print(f"{self.outcome.text(rank.group.clock.name)} from step {self.outcome.step}", flush=True)
        elif self.trial_note is not None:
            print(self.trial_note, flush=True)
        from xronos.node.rank.relayout import settled_extra  # (lazy, as reshard's: relayout is above the engines)

        return {
            "clock": rank.group.clock.describe(),  # what the seconds below are: virtual or wall
            # overlap of the all-reduces with compute: rank 0's asynchronous ones (0: none ran)
            "async_allreduces": rank.group.launched,
            "config": cfg.model_dump(exclude={"rank", "rendezvous_host", "rendezvous_port", "group_key"}),
            "eval_before": asdict(result.eval_before) if result.eval_before else None,
            "eval_after": asdict(result.eval_after) if result.eval_after else None,
            # live re-shards: when, why, old and new layout, bytes moved, the slowest rank's seconds
            "reshards": [{**m.as_dict(), "seconds": max(r.reshard_s for recs in records for r in recs
                                                        if r.step == m.step)}
                         for m in self.moves],
            "reshards_refused": self.refused,
            # the overlap trial: each mode's median iteration (the slowest rank's), the kept one, from when
            "overlap_trial": None if self.outcome is None else {
                "seconds": self.outcome.seconds, "kept": self.outcome.kept_label, "from_step": self.outcome.step},
            "overlap_trial_note": self.trial_note,
            "ranks": [{"summary": asdict(s), "iterations": [asdict(r) for r in recs]}
                      for s, recs in zip(summaries, records)],
            **settled_extra(self),
        }


def _apply(group: TPGroup, overlap: Overlap) -> None:
    """The group's all-reduces from now on as `overlap` says (node/tp/overlap.py reads them per call)."""
    group.overlap, group.chunks = overlap.backward, overlap.chunks
