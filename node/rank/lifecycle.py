"""The one rank runtime: every training rank — `xronos run`'s, a job's, the baselines' — lives
this lifecycle, in this order:

    join      `TPGroup.join`: Gloo over tcp://host:port (a world of one: no Gloo, traced)
    facts     the owner (rank 0) reads config.json and the data file and shares, once and typed,
              what only it knows (`Facts`: config.json, rows, the tokenizer's pad id, token types,
              the classes of a classification run)
    build     `torch.manual_seed(seed)` on every rank, then the engine builds its model and
              optimizer from a weight source: `LocalFiles` (every rank reads its own slices of the
              checkpoint) or `FromOwner` (the owner reads — the base checkpoint, or on resume its
              last consolidated checkpoint, AdamW moments included — and streams every other rank
              its slices over Gloo)
    loop      evaluation before training; then per step, at the iteration boundary, the control
              source's word (`NoControl`, or a job's pause/resume/cancel), the engine's step, the
              metrics sink, a consolidated checkpoint when one is due; evaluation after
    export    the engine's export (collective; the owner writes), then a barrier, so nobody
              reports completion before the export exists
    report    the sink's `finish` (collective for a metrics file: every rank's records, gathered
              untimed; a job's sink tells the node service)
    leave     `TPGroup.leave`: an untimed barrier, then the group is destroyed

An `Engine` is what a rank trains: our TP model (`xronos.node.rank.tpengine.TPEngine`), a DP×TP mesh of
them (`xronos.node.rank.dpengine.DPEngine`, when the settings have shares) or a baseline's
(`xronos.bench.hftp_worker`, `xronos.bench.pp_worker`). The process entry modules are thin: a
settings class (`xronos.node.runconfig`), an engine, a weight source, a control source and a sink,
handed to `run`.

Where a rank's loop is extended: the iteration boundary in `_loop` — every rank stands there
together, between two steps, after the control source's word. A live re-shard is such a word: a
`Reshard` carrying a new layout, which every rank hears at the same boundary and hands to the
engine's `reshard` (it moves its slices and optimizer state there, `xronos.node.tp.reshard`; a
data-parallel run's word carries new shares instead, a new split of the batch that moves no
weights), and then to the sink's `resharded`; a change to what trains (frozen base weights and
adapter parameters) belongs in the engine's `build` (the optimizer, clipping, checkpoints and
moments cover the parameters that require a gradient).
"""

from __future__ import annotations

import enum
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from xronos.node.data.batches import Batch, BatchChannel, BatchSource, owner_batches
from xronos.node.data.labels import LabelSpace
from xronos.node.emulate import process_clock
import xronos.node.measure.memwatch as memwatch  # (the module alone: not the measuring room)
from xronos.node.models.loading import SafetensorsSource, ShardSource, materialize
from xronos.node.runconfig import RankConfig
from xronos.node.rank.streaming import load_shard, share_json
from xronos.node.tp.group import TPGroup
from xronos.node.tp.groupkey import prove
from xronos.node.rank.validate import read_config
from xronos.protocol.layout import Layout, LayoutError

MAX_ROWS = 2**40


class JobFault(RuntimeError):
    """A failure of the training itself, which any nodes running the same job from the same
    checkpoint would meet again: a non-finite loss or gradient (a learning rate that diverges,
    data the model cannot take). A job's gateway fails the job on it instead of re-planning it on
    other nodes (`NodeJobStatus.job_fault`); `xronos run` exits non-zero, and nothing is exported."""


class Facts(BaseModel):
    """What only the owner knows when a run starts, shared with every rank once (`share_facts`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    # config.json as every rank builds its model: pad_token_id set to the tokenizer's and, for
    # classify, num_labels/id2label/label2id set to the owner's classes (`BatchSource.config_fields`);
    # checkpoints and the export carry it.
    config: dict[str, Any]
    n_train: int = Field(ge=0, le=MAX_ROWS)
    n_eval: int = Field(ge=0, le=MAX_ROWS)
    pad_token_id: int  # GPT-2/LLaMA classification pick the last non-pad token: it must be the tokenizer's
    token_types: bool  # whether the tokenizer feeds segment ids (every rank then allocates them)
    # classify: the classes the owner decided from the data and the checkpoint (names — the
    # checkpoint's, or the data's in sorted order — and whether the data's labels are names)
    labels: LabelSpace | None

    @model_validator(mode="after")
    def _config_agrees(self) -> Facts:
        """The config every rank builds from says what the typed fields say."""
        want = {"pad_token_id": self.pad_token_id, **(self.labels.config_fields() if self.labels else {})}
        wrong = sorted(k for k, v in want.items() if self.config.get(k) != v)
        if wrong:
            raise ValueError(f"config.json fields {wrong} disagree with the owner's data facts")
        return self


def share_facts(cfg: RankConfig, group: TPGroup, allowed_dirs: list[str] | None = None,
                ) -> tuple[Facts, BatchSource | None]:
    """The owner reads config.json and the data (its BatchSource is returned: `owner_batches`, which
    decides a classification run's classes; with `allowed_dirs`, a job's, the checkpoint's files
    must lie inside them); every rank gets the facts, checked field by field where they arrive."""
    if group.rank != 0:
        facts = Facts.model_validate(share_json(group, None))
        if (facts.labels is None) != (cfg.recipe.task != "classify"):
            raise ValueError(f"the owner's data facts {'lack' if facts.labels is None else 'have'} classes, "
                             f"but the task is {cfg.recipe.task!r}")
        return facts, None
    config = read_config(cfg.recipe.model_dir)
    source = owner_batches(cfg.recipe, config, allowed_dirs)
    config.update(source.config_fields())
    facts = Facts(config=config, n_train=source.n_train, n_eval=source.n_eval, pad_token_id=source.pad_token_id,
                  token_types=source.has_token_types, labels=source.label_space)
    share_json(group, facts.model_dump(mode="json"))
    return facts, source


# -- weight sources -----------------------------------------------------------------------------
Then = Callable[[ShardSource], None]  # runs on every rank once the weights are in (e.g. AdamW moments)


class WeightSource(Protocol):
    def load(self, model: torch.nn.Module, group: TPGroup, then: Then) -> None:
        """Fill the meta-device `model` (collective where slices travel), then `then(source)`."""
        ...


@dataclass(frozen=True)
class LocalFiles:
    """Every rank reads its own slices from the checkpoint in `model_dir` (`xronos run`, the
    baselines: every rank sees the same files)."""

    model_dir: str
    allowed_dirs: list[str] | None = None

    def load(self, model: torch.nn.Module, group: TPGroup, then: Then) -> None:
        source = SafetensorsSource(self.model_dir, self.allowed_dirs)
        materialize(model, source)
        then(source)


@dataclass(frozen=True)
class FromOwner:
    """The owner reads (`open(model)` on rank 0: the base checkpoint, or a consolidated one on
    resume) and streams every other rank its slices: other ranks need no model files."""

    open: Callable[[torch.nn.Module], ShardSource] | None  # None on every rank but the owner

    def load(self, model: torch.nn.Module, group: TPGroup, then: Then) -> None:
        load_shard(model, group, self.open(model) if group.rank == 0 and self.open else None, then=then)


# -- control sources ----------------------------------------------------------------------------
class Word(enum.IntEnum):
    """What the ranks agree on at an iteration boundary."""

    GO = 0
    STOP = 2


@dataclass(frozen=True)
class Reshard:
    """A word that carries a new layout (same world): every rank moves to it at this boundary,
    before the step. `reason` says why (shown in the metrics and a job's events). With `shares`
    (a data-parallel run's: rows of each global batch per data-parallel group, the run's layout
    kept) it is a re-split of the batch instead: from this step on each group trains its new rows,
    and no weights move (`xronos.node.rank.dpengine.DPEngine.reshard`)."""

    layout: Layout
    reason: str = "scheduled"
    shares: tuple[int, ...] | None = None


class Control(Protocol):
    def at_boundary(self, group: TPGroup, step: int) -> Word | Reshard:
        """Collective: every rank asks before step `step`, and all get the same word."""
        ...


class NoControl:
    """Nobody steers the run: always go on (no communication)."""

    def at_boundary(self, group: TPGroup, step: int) -> Word:
        return Word.GO


# -- the rank, its engine, its sink --------------------------------------------------------------
@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float | None  # classify
    perplexity: float | None  # causal-lm
    rows: int


class Record(Protocol):
    """One iteration's numbers on one rank (an engine's own dataclass)."""

    step: int
    epoch: int
    loss: float

    def as_row(self) -> list[float]: ...


@dataclass
class RankResult:
    records: list[Any]
    eval_before: EvalResult | None
    eval_after: EvalResult | None
    completed: bool  # False: stopped at a boundary by the control source


@dataclass
class Rank:
    """This rank as the engine and the sink see it."""

    cfg: Any  # the engine's RankConfig subclass
    group: TPGroup
    facts: Facts
    data: BatchChannel
    steps: int  # the run's length (from the settings and the owner's rows)
    engine: Engine

    @property
    def owner(self) -> bool:
        return self.group.rank == 0

    @property
    def per_epoch(self) -> int:
        return self.facts.n_train // self.cfg.recipe.batch_size


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do besides building, stepping and evaluating: asked, never probed."""

    live_reshard: bool = False  # `reshard` moves it to another layout at a boundary; `last_move` tells the cost
    checkpoints: bool = False  # `checkpoint` writes consolidated checkpoints (every job's rank keeps them)


class Engine:
    """What a rank trains. `run` calls build, evaluate, begin, then step per iteration (and
    checkpoint when due), evaluate, export, and on rank 0 report. Defaults: no evaluation, no
    export, no checkpoints, no live re-shard (`capabilities` says which an engine adds)."""

    capabilities: ClassVar[Capabilities] = Capabilities()

    def build(self, rank: Rank, weights: WeightSource, start: int) -> None:
        raise NotImplementedError

    def evaluate(self, rank: Rank) -> EvalResult | None:
        return None

    def begin(self, rank: Rank, start: int) -> None:
        """Just before the first step (after the evaluation before training)."""

    def step(self, rank: Rank, batches: Iterator[tuple[int, Batch]], step: int) -> Record:
        raise NotImplementedError

    def reshard(self, rank: Rank, word: Reshard, step: int) -> None:
        """Collective, at the boundary before `step`: go on under `word.layout`."""
        raise NotImplementedError(f"{type(self).__name__} cannot re-shard live")

    def last_move(self) -> Any | None:
        """The latest live re-shard (`relayout.Move`: its seconds and bytes), if it made one."""
        return None

    def checkpoint(self, rank: Rank, ckpt_dir: str | None, meta: dict[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} keeps no checkpoints")

    def export(self, rank: Rank) -> None:
        pass

    def report(self, rank: Rank, per_rank: list[torch.Tensor], result: RankResult) -> dict | None:
        """Rank 0: the metrics document from every rank's rows ([steps, fields] each)."""
        return None

    def tried(self) -> Any | None:
        """An overlap trial's outcome (`node/rank/trial.TrialOutcome`), once, after the step that
        decided it; None otherwise (an engine without overlap modes never has one)."""
        return None

    def own_move(self) -> Reshard | None:
        """A move the engine itself calls for at this boundary (an overlap trial that kept a mode
        with a layout of its own), once; every rank's engine calls for the same one."""
        return None


class Sink:
    """Where a rank's numbers and milestones go. Every rank calls every method."""

    def started(self, rank: Rank, start: int) -> None: ...
    def evaluated(self, rank: Rank, when: str, result: EvalResult | None) -> None: ...
    def iteration(self, rank: Rank, rec: Record) -> None: ...
    def checkpointed(self, rank: Rank, step: int) -> None: ...
    def resharded(self, rank: Rank, step: int, word: Reshard) -> None: ...
    def reshard_refused(self, rank: Rank, step: int, word: Reshard, reason: str) -> None: ...
    def tried(self, rank: Rank, outcome: Any) -> None: ...
    def cancelled(self, rank: Rank, step: int) -> None: ...

    def finish(self, rank: Rank, result: RankResult) -> None:
        """After the export (collective where the sink gathers)."""


class MetricsFile(Sink):
    """`xronos run` and the baselines: rank 0 gathers every rank's records (one float tensor per
    rank, untimed: reporting, not training), has the engine make the document and writes it to
    `metrics_path`; optionally a progress bar on rank 0."""

    def __init__(self, progress: bool = False) -> None:
        self.progress, self.bar = progress, None

    def started(self, rank: Rank, start: int) -> None:
        if self.progress and rank.owner:
            from tqdm import tqdm

            self.bar = tqdm(total=rank.steps - start, desc="xronos run", unit="step", mininterval=1.0,
                            dynamic_ncols=True)

    def iteration(self, rank: Rank, rec: Record) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{rec.loss:.4f}", epoch=rec.epoch, refresh=False)
            self.bar.update(1)
            if rec.step + 1 == rank.steps:
                self._close()

    def cancelled(self, rank: Rank, step: int) -> None:
        self._close()

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def finish(self, rank: Rank, result: RankResult) -> None:
        self._close()
        per_rank = gather_rows(result.records, rank.group)
        # Each rank's peak resident set over its whole life (the export included), untimed.
        peaks = rank.group.all_gather(torch.tensor([float(memwatch.watch().peak())], dtype=torch.float64), timed=False)
        if not rank.owner:
            return
        doc = rank.engine.report(rank, per_rank, result)
        if doc is not None:
            doc["memory"] = {"peak_rss_bytes": [int(p.item()) for p in peaks]}
        if doc is not None and rank.cfg.metrics_path is not None:
            import json

            Path(rank.cfg.metrics_path).write_text(json.dumps(doc, indent=1))


def gather_rows(records: list[Record], group: TPGroup) -> list[torch.Tensor]:
    """Every rank's records as [steps, fields] float64 tensors, on every rank (same number of
    iterations everywhere; untimed)."""
    mine = torch.tensor([r.as_row() for r in records], dtype=torch.float64)
    return group.all_gather(mine, timed=False)


@dataclass(frozen=True)
class Checkpoints:
    """A consolidated checkpoint every `interval` steps (not after the last: the export follows)
    into `dir` (the owner's; None on the other ranks), `meta` going into its state.json."""

    dir: str | None
    interval: int
    meta: dict[str, Any] = field(default_factory=dict)

    def due(self, done: int, steps: int) -> bool:
        return done % self.interval == 0 and done < steps


# -- the lifecycle --------------------------------------------------------------------------------
def run(cfg: RankConfig, engine: Engine, *, weights: WeightSource, control: Control | None = None,
        sink: Sink | None = None, checkpoints: Checkpoints | None = None, start: int = 0,
        allowed_dirs: list[str] | None = None) -> RankResult:
    """One rank, joined to its world, from `start` (> 0: resumed; the weight source then serves the
    checkpoint of that step) to its export and report. `allowed_dirs` (a job's: its paths came
    from the network) confine the checkpoint files the owner reads for the facts. A failure
    anywhere raises: the process exits non-zero, and its peers' next collective fails or times out
    after `gloo_timeout_s`."""
    if checkpoints is not None and not engine.capabilities.checkpoints:  # before anyone joins
        raise ValueError(f"{type(engine).__name__} keeps no checkpoints, and this run asks for them")
    control = control or NoControl()
    sink = sink or Sink()
    torch.set_num_threads(cfg.threads)
    group = TPGroup.join(cfg.rank, cfg.world_size, cfg.rendezvous_host, cfg.rendezvous_port, cfg.gloo_timeout_s,
                         clock=process_clock())  # an emulated box's clock (node/emulate), else wall time
    if cfg.group_key is not None:
        prove(group, cfg.group_key)  # before anything of the job's goes out
    memwatch.phase("join")
    facts, source = share_facts(cfg, group, allowed_dirs)
    rank = Rank(cfg, group, facts, BatchChannel(cfg.recipe, group, source, facts.token_types),
                cfg.total_steps(facts.n_train), engine)
    memwatch.phase("facts")
    torch.manual_seed(cfg.recipe.seed)  # anything random outside the dropout streams agrees across ranks
    engine.build(rank, weights, start)
    result = _loop(rank, control, sink, checkpoints, start)
    if result.completed:
        engine.export(rank)
        group.barrier(timed=False)  # nobody reports completion before the export exists
        sink.finish(rank, result)
    group.leave()
    memwatch.watch().write(cfg.rank)
    return result


def _loop(rank: Rank, control: Control, sink: Sink, checkpoints: Checkpoints | None, start: int) -> RankResult:
    engine, cfg = rank.engine, rank.cfg
    before = engine.evaluate(rank) if start == 0 else None
    sink.evaluated(rank, "before", before)
    engine.begin(rank, start)
    sink.started(rank, start)
    records: list[Any] = []
    batches = rank.data.train(rank.facts.n_train, start)
    for step in range(start, rank.steps):
        # The iteration boundary: every rank is here, between two steps, and hears the same word.
        word = control.at_boundary(rank.group, step)
        if word is Word.STOP:
            sink.cancelled(rank, step)
            return RankResult(records, before, None, completed=False)
        if word is Word.GO:  # an ordered move goes first; the engine's own then waits for a free boundary
            word = engine.own_move() or word
        if isinstance(word, Reshard):
            try:
                engine.reshard(rank, word, step)
            except LayoutError as exc:
                # A layout of another world or model is refused before anything moves, by the same
                # check on every rank (they all hold the same word): the run goes on as it was.
                sink.reshard_refused(rank, step, word, str(exc))
            else:
                sink.resharded(rank, step, word)
        rec = engine.step(rank, batches, step)
        records.append(rec)
        sink.iteration(rank, rec)
        outcome = engine.tried()
        if outcome is not None:
            sink.tried(rank, outcome)
        done = step + 1
        if checkpoints is not None and checkpoints.due(done, rank.steps):
            engine.checkpoint(rank, checkpoints.dir, {**checkpoints.meta, "step": done, "epoch": done // rank.per_epoch,
                                                      "seed": cfg.recipe.seed, "saved_at": time.time()})
            sink.checkpointed(rank, done)
    after = engine.evaluate(rank)
    sink.evaluated(rank, "after", after)
    return RankResult(records, before, after, completed=True)


def read_settings(argv: list[str], cls: type[RankConfig], module: str):
    """The settings file of `python -m module CONFIG.json` (exit status 2 on a wrong command line)."""
    if len(argv) != 2:
        print(f"usage: python -m {module} CONFIG.json", file=sys.stderr)
        raise SystemExit(2)
    import logging

    import structlog

    # structlog's unconfigured default prints every level (a LoRA run's per-tensor debug lines)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    return cls.read(Path(argv[1]))
