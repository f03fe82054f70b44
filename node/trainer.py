"""The per-rank training loop: same batches, same seeds, same optimizer on every rank.

Rank 0 owns the data: it tokenises each batch and broadcasts the tensors (booked as data time,
not as TP communication). Every rank then runs its shard of the model; the engine's collectives
go through the `TPGroup`, whose timings are drained each iteration and compared across ranks
(one untimed all_gather) to split idle time from communication, and whose tagged timeline splits
the compute by segment kind (`metrics.segment_compute`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from xronos.node.data import Batch, BatchSource, eval_row_groups, owner_source, share_facts
from xronos.node.metrics import IterationRecord, Rusage, comm_and_idle, segment_compute
from xronos.node.models.export import gather_full, save_hf_dir
from xronos.node.models.loading import SafetensorsSource, materialize
from xronos.node.models.registry import family_for
from xronos.node.optim import adamw
from xronos.node.runconfig import RunConfig
from xronos.node.tp.group import TPGroup
from xronos.node.tp.layout import ShardLayout
from xronos.node.validate import read_config

OnIteration = Callable[[IterationRecord], None]


@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float | None  # classify
    perplexity: float | None  # causal-lm
    rows: int


@dataclass(frozen=True)
class RankResult:
    records: list[IterationRecord]
    eval_before: EvalResult | None
    eval_after: EvalResult | None


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
        sq = p.grad.detach().double().pow(2).sum()
        (rep if name in replicated else part).add_(sq)
    group.all_reduce(part)
    total = float((part + rep).sqrt())
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total


class BatchChannel:
    """Batches from rank 0 to all ranks. Every rank knows the shapes (from the header), so only
    the tensors travel."""

    def __init__(self, cfg: RunConfig, group: TPGroup, source: BatchSource | None, token_types: bool):
        self.cfg, self.group, self.source, self.token_types = cfg, group, source, token_types

    def _recv(self, rows: int, batch: Batch | None) -> Batch:
        S = self.cfg.seq_len
        if batch is None:
            shape_lbl = (rows,) if self.cfg.task == "classify" else (rows, S)
            batch = Batch(
                torch.empty(rows, S, dtype=torch.long),
                torch.empty(rows, S, dtype=torch.long),
                torch.empty(shape_lbl, dtype=torch.long),
                torch.empty(rows, S, dtype=torch.long) if self.token_types else None,
            )
        with self.group.segment("data"):
            for t in (batch.input_ids, batch.attention_mask, batch.labels, batch.token_type_ids):
                if t is not None:
                    self.group.broadcast(t, src=0)
        return batch

    def train(self, n_train: int) -> Iterator[tuple[int, Batch]]:
        if self.source is not None:
            for epoch, b in self.source.train_batches():
                yield epoch, self._recv(self.cfg.batch_size, b)
        else:
            per_epoch = n_train // self.cfg.batch_size
            step = 0
            while True:
                yield step // per_epoch, self._recv(self.cfg.batch_size, None)
                step += 1

    def eval(self, n_train: int, n_eval: int) -> Iterator[Batch]:
        src = self.source.eval_batches() if self.source is not None else None
        for rows in eval_row_groups(n_train, n_eval, self.cfg.batch_size):
            yield self._recv(len(rows), next(src) if src is not None else None)


@torch.no_grad()
def evaluate(model, cfg: RunConfig, channel: BatchChannel, n_train: int, n_eval: int) -> EvalResult | None:
    if n_eval == 0:
        return None
    model.eval()
    loss_sum, weight, correct = 0.0, 0, 0
    for b in channel.eval(n_train, n_eval):
        if cfg.task == "classify":
            logits = model.logits(b.input_ids, b.attention_mask, b.token_type_ids)  # [b, labels]
            loss_sum += float(torch.nn.functional.cross_entropy(logits.float(), b.labels, reduction="sum"))
            correct += int((logits.argmax(-1) == b.labels).sum())
            weight += b.labels.numel()
        else:
            tokens = int((b.labels[:, 1:] != -100).sum())  # the loss is a mean over shifted targets
            loss_sum += float(model(b.input_ids, b.attention_mask, b.labels, b.token_type_ids)) * tokens
            weight += tokens
    model.train()
    loss = loss_sum / max(weight, 1)
    if cfg.task == "classify":
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
    """One training iteration on this rank and its measurements — the step `xronos run` and a
    job's rank process (`xronos.node.jobproc`) both take, so both train the same model."""
    group.drain_timings()  # whatever ran since the last step (evaluation, checkpoint) is not this step's
    group.drain_spans()
    t0 = time.perf_counter()
    epoch, batch = next(batches)
    loss = model(batch.input_ids, batch.attention_mask, batch.labels, batch.token_type_ids)
    loss.backward()
    if cfg.max_grad_norm is not None:
        with group.segment("rest"):
            clip_global_grad_norm(model, replicated, cfg.max_grad_norm, group)
    lr = opt.param_groups[0]["lr"]
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    loss_v = float(loss.detach())
    t1 = time.perf_counter()
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
        voluntary_ctx_switches=vol, involuntary_ctx_switches=invol, peak_rss=Rusage.peak_rss(),
        **{f"compute_{k}_s": v for k, v in per_kind.items()},
    )


def run_rank(cfg: RunConfig, group: TPGroup, on_iteration: OnIteration | None = None) -> RankResult:
    """Train on this rank; rank 0 also writes the export. Returns this rank's measurements."""
    config = read_config(cfg.model_dir)
    family = family_for(config)
    source = owner_source(cfg, config) if cfg.rank == 0 else None
    facts = share_facts(group, source, cfg.task)  # row counts, pad id, segment ids, the classes
    n_train, n_eval, token_types = facts.n_train, facts.n_eval, facts.token_types
    # GPT-2/LLaMA classification pick the last non-pad token: the pad id must be the tokenizer's.
    # The head gets the owner's classes (num_labels, id2label, label2id), and so does the export.
    config.update(facts.config_fields())

    torch.manual_seed(cfg.seed)  # anything random outside the dropout streams agrees across ranks
    layout = ShardLayout.of(cfg.layout, cfg.rank)
    model = family.build(config, cfg.task, layout, group, dropout=cfg.dropout)
    materialize(model, SafetensorsSource(cfg.model_dir))
    model.train()
    specs = model.tensor_specs()
    replicated = {name for name, s in specs.items() if s.dim is None}
    opt = adamw(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg.warmup_steps))
    channel = BatchChannel(cfg, group, source, bool(token_types))

    eval_before = evaluate(model, cfg, channel, n_train, n_eval)
    group.drain_timings()
    model.seed(cfg.seed)  # dropout streams start from the same point on every rank

    records: list[IterationRecord] = []
    rusage = Rusage()
    bar = _progress(cfg)
    batches = channel.train(n_train)
    for step in range(cfg.max_steps):
        rec = train_step(model, opt, sched, group, cfg, replicated, batches, step, rusage)
        records.append(rec)
        if on_iteration is not None:
            on_iteration(rec)
        if bar is not None:
            bar.set_postfix(loss=f"{rec.loss:.4f}", epoch=rec.epoch, refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()

    eval_after = evaluate(model, cfg, channel, n_train, n_eval)
    if cfg.export_dir is not None:
        state = gather_full(model, specs, layout, group, dst=0)
        if cfg.rank == 0:
            save_hf_dir(cfg.export_dir, config, cfg.task, state, cfg.model_dir)
    group.drain_timings()
    return RankResult(records, eval_before, eval_after)


def _progress(cfg: RunConfig):
    if cfg.rank != 0 or not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.max_steps, desc="xronos run", unit="step", mininterval=1.0, dynamic_ncols=True)
