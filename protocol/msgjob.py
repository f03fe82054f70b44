"""Messages of a job's life: its spec, the owner's inspection of it, the plan, each node's
assignment and ack, and the gateway's controls of the running ranks (`JobControl`, one union on the
control topic). Re-exported by `xronos.protocol.messages`."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, TypeAdapter, model_validator

from .layout import Layout, LayoutError, Sizes
from .msgnode import ArchSpec
from .msgtypes import (
    MAX_NODES, ByteFloat, Count, HostName, Id, Megabytes, Message, Name, NonNegInt, Rank, Seconds, Steps, Strategy,
    JobStrategy,
    Text4k, Text256, UnitCount, WorldSize,
)
from .recipe import Part, Recipe


# The job spec's own schema version: 3 made it a `Recipe` plus the job's own fields. A spec file
# of version 2 (every setting at top level) is mapped once, where files are read
# (`xronos.protocol.specfile.upgrade_spec`); on the wire the gateway and the nodes speak one version.
SPEC_VERSION = 3


# Forward chunks a plan may ask for (node/tp/overlap.py): past a few, each chunk's GEMMs get too
# small to gain; the bound keeps a message from asking a rank for millions of tiny chunks.
MAX_CHUNKS = 64
OverlapChoice = Literal["auto", "off", "on"]


class Overlap(Part):
    """How a tensor-parallel plan hides its all-reduces behind compute (issue #37,
    `xronos.node.tp.overlap`): `backward` runs each column-parallel region's input-gradient
    all-reduce while the region's weight gradients compute; `chunks` > 1 instead cuts the batch
    rows into that many chunks, each chunk's all-reduces travelling while the next chunk computes,
    in forward and backward alike.
    Only the timing changes: the sums are the same ones."""

    backward: bool
    chunks: Annotated[int, Field(ge=1, le=MAX_CHUNKS)] = 1


def check_overlap_rows(overlap: Overlap | None, rows: int, field: str) -> None:
    """ValueError naming `field` when a chunk would have no row of a batch of `rows`."""
    if overlap is not None and overlap.chunks > rows:
        raise ValueError(f"{field}: chunks {overlap.chunks} leaves a chunk without a row: the batch has {rows} "
                         f"rows (at most {rows} chunks)")


def overlap_label(overlap: Overlap | None) -> str:
    """`off`, `bwd` or `cN`: the mode's name as the planner and `xronos run --overlap` spell it."""
    if overlap is None or (not overlap.backward and overlap.chunks == 1):
        return "off"
    return f"c{overlap.chunks}" if overlap.chunks > 1 else "bwd"


MAX_TRIAL_MODES = 4
OverlapLabel = Annotated[str, Field(pattern=r"^(off|bwd|c[0-9]{1,2})$")]  # overlap_label's names


class ModeForecast(Part):
    """What the planner predicted for one of a trial's modes once kept: its iteration, on the layout
    it runs then (its own where `OverlapTrial.layouts` gives one, else the plan's), and, on a layout
    of its own, each rank's compute and peak memory there (what the plan's entries give for the
    plan's layout), and the communication the iteration waits for with it (`Plan.comm_s`). The job
    then sets what it measures against the prediction for what it runs."""

    iteration_s: Seconds
    comm_s: Seconds | None = None
    compute_s: Annotated[list[Seconds], Field(max_length=MAX_NODES)] | None = None
    memory: Annotated[list[ByteFloat], Field(max_length=MAX_NODES)] | None = None


class OverlapTrial(Part):
    """Overlap modes measured against each other at the start of a run (issue #37): the planner's
    prediction of a mode's gain is off by up to a quarter on some boxes (a launched call's CPU),
    while the modes differ only in timing — the same sums, the same layout — so the ranks can try
    each for a few steps and keep the fastest. After `after` steps under `modes[0]` (the plan's
    own mode: warm-up), the modes take turns step by step (so a drift of the host falls on every
    mode alike) for `rounds` + 1 rounds, the first not measured (a mode's first step pays its
    one-time costs); the mode whose median iteration, the slowest rank's, is least is kept for
    the rest of the run (a tie goes to the earlier). `Overlap(backward=False, chunks=1)` is no
    overlap. `layouts[i]`: the layout planned for modes[i] where it is not the plan's (None: the
    plan's); every mode is measured on the plan's layout, and the ranks move to the kept mode's
    own layout right after the trial (a live re-shard). `forecasts[i]`: the planner's prediction
    for modes[i] once kept (None: not given, as from `xronos run --overlap-trial`)."""

    modes: Annotated[list[Overlap], Field(min_length=2, max_length=MAX_TRIAL_MODES)]
    rounds: Annotated[int, Field(ge=1, le=16)] = 3
    after: Annotated[int, Field(ge=0, le=64)] = 2
    layouts: Annotated[list[Layout | None], Field(max_length=MAX_TRIAL_MODES)] | None = None
    forecasts: Annotated[list[ModeForecast], Field(max_length=MAX_TRIAL_MODES)] | None = None

    @model_validator(mode="after")
    def _distinct(self) -> OverlapTrial:
        labels = [overlap_label(m) for m in self.modes]
        if len(set(labels)) != len(labels):
            raise ValueError(f"modes: each mode once, got {labels}")
        if self.layouts is not None:
            if len(self.layouts) != len(self.modes):
                raise ValueError(f"layouts: one per mode ({len(self.modes)}), got {len(self.layouts)}")
            if self.layouts[0] is not None:
                raise ValueError("layouts: the first mode runs on the plan's layout (None)")
        if self.forecasts is not None:
            if len(self.forecasts) != len(self.modes):
                raise ValueError(f"forecasts: one per mode ({len(self.modes)}), got {len(self.forecasts)}")
            for i, f in enumerate(self.forecasts):
                own = self.layout_for(i)
                for name, per_rank in (("compute_s", f.compute_s), ("memory", f.memory)):
                    if own is None and per_rank is not None:
                        raise ValueError(f"forecasts: {labels[i]} runs on the plan's layout, whose entries give "
                                         f"its {name}; a forecast gives it only for a layout of the mode's own")
                    if own is not None and per_rank is not None and len(per_rank) != own.world_size:
                        raise ValueError(f"forecasts: {labels[i]}'s {name} has {len(per_rank)} ranks, its layout "
                                         f"{own.world_size}")
        return self

    def layout_for(self, i: int) -> Layout | None:
        """The layout mode `i` moves to when kept (None: the plan's, no move)."""
        return self.layouts[i] if self.layouts is not None else None

    def index(self, label: str) -> int | None:
        """The position of the mode named `label` (`overlap_label`), or None: not one of the trial's."""
        labels = [overlap_label(m) for m in self.modes]
        return labels.index(label) if label in labels else None

    def forecast(self, label: str) -> ModeForecast | None:
        """The planner's forecast for the mode named `label` once kept (None: none given)."""
        i = self.index(label)
        return None if i is None or self.forecasts is None else self.forecasts[i]

    @property
    def steps(self) -> int:
        """Steps from the run's start to the decision, warm-up and the unmeasured round included."""
        return self.after + (self.rounds + 1) * len(self.modes)


def check_trial(trial: OverlapTrial | None, overlap: Overlap | None, shares: object, field: str,
                rows: int | None = None, layout: Layout | None = None, sizes: Sizes | None = None) -> None:
    """ValueError naming `field` when a trial does not fit its plan: a data-parallel one (nothing
    to overlap), a first mode that is not the plan's `overlap`, (given the batch's `rows`) a mode
    with a chunk of no row, or (given the plan's `layout` and the model's `sizes`) a mode's layout
    of another world or model."""
    if trial is None:
        return
    for i, other in enumerate(trial.layouts or ()):
        if other is None:
            continue
        if layout is not None and other.world_size != layout.world_size:
            raise ValueError(f"{field}: the layout for {overlap_label(trial.modes[i])} has {other.world_size} ranks, "
                             f"the plan {layout.world_size}")
        if sizes is not None:
            try:
                other.check(sizes, quanta=None)
            except LayoutError as exc:
                raise ValueError(f"{field}: the layout for {overlap_label(trial.modes[i])}: {exc}") from None
    if shares is not None:
        raise ValueError(f"{field}: a data-parallel plan (shares) has no overlap modes to try")
    if overlap_label(trial.modes[0]) != overlap_label(overlap):
        raise ValueError(f"{field}: the first mode ({overlap_label(trial.modes[0])}) must be the plan's overlap "
                         f"({overlap_label(overlap)}): it runs the warm-up")
    for mode in trial.modes if rows is not None else ():
        check_overlap_rows(mode, rows, field)


class JobSpec(Message):
    """A job: its recipe (what is trained and how) plus what only a job has — its name and owner,
    the planner's strategy and the memory it leaves each node, the nodes it may use, checkpoints,
    live re-balancing."""

    schema_version: Literal[3] = SPEC_VERSION  # type: ignore[assignment]  (the spec's own, see SPEC_VERSION)
    name: Name
    owner: Id
    recipe: Recipe
    strategy: JobStrategy = "auto"
    checkpoint_interval: Steps = 100
    nodes: Annotated[list[Id], Field(min_length=1, max_length=MAX_NODES)] | None = None
    # Memory (MiB) each node keeps for its day job; None: the gateway's reserve_mb (gateway.toml,
    # 512 by default), filled in when the job is submitted. A node's own reserve_mb (node.toml,
    # `Capabilities.reserve_bytes`) is kept whatever this says: the planner takes the larger.
    reserve_mb: Megabytes | None = None
    # Live re-balancing (issue 14): the gateway re-plans from the ranks' measured per-kind compute
    # and re-shards the running job at an iteration boundary when the predicted gain repays the move.
    # On by default: a job runs on boxes whose other work changes their speed, the case it is for.
    rebalance: bool = True
    # Overlap of a tensor-parallel plan's all-reduces with compute (`Overlap`): `auto` lets the
    # planner pick the mode it predicts fastest (none among them), `on` the fastest overlapping
    # one, `off` none. `chunks` forces the chunk count (with `on`). Off by default: the
    # prediction is checked on the bench's cells only (docs/planning.md).
    overlap: OverlapChoice = "off"
    chunks: Annotated[int, Field(ge=1, le=MAX_CHUNKS)] | None = None

    @model_validator(mode="after")
    def _has_export(self) -> JobSpec:
        if self.recipe.export_dir is None:
            raise ValueError("recipe.export_dir: a job must name where its export goes")
        return self

    @model_validator(mode="after")
    def _overlap(self) -> JobSpec:
        if self.overlap == "on" and self.strategy == "dp":
            raise ValueError("overlap: 'on' overlaps a tensor-parallel plan's all-reduces; strategy 'dp' has none "
                             "(its gradient all-reduce already runs beside backward)")
        if self.chunks is not None:
            if self.overlap != "on":
                raise ValueError(f"chunks: {self.chunks} chunks need overlap 'on', not {self.overlap!r}")
            check_overlap_rows(Overlap(backward=True, chunks=self.chunks), self.recipe.batch_size, "chunks")
        return self


class PlanEntry(Message):
    node_id: Id
    rank: Rank
    # This node's count of each segment kind (attention units, MLP columns, vocabulary rows).
    attn: UnitCount
    mlp: UnitCount
    vocab: UnitCount
    predicted_compute_s: Seconds
    predicted_memory: ByteFloat
    memory_cap: ByteFloat


class Plan(Message):
    job_id: Id
    version: Count
    strategy: Strategy
    sizes: Sizes
    entries: Annotated[list[PlanEntry], Field(min_length=1, max_length=MAX_NODES)]
    predicted_iteration_s: Seconds
    # inf when nothing fits: the planner's honest "no bound" for an over-cap uniform plan.
    ideal_iteration_s: Annotated[float, Field(ge=0)]
    # The communication the iteration waits for beyond compute: every all-reduce's, or with an
    # `overlap` (and a data-parallel plan's gradient all-reduce) what the mode does not hide.
    comm_s: Seconds
    # Data parallelism: rows of each global batch per data-parallel group, in group order (see
    # `mesh_of`). None: one tensor-parallel group over every entry (the TP strategies).
    shares: Annotated[list[NonNegInt], Field(min_length=1, max_length=MAX_NODES)] | None = None
    # A tensor-parallel plan's overlap of communication with compute (None: every all-reduce blocks).
    overlap: Overlap | None = None
    # The modes the ranks measure against each other before keeping one (None: `overlap` throughout).
    trial: OverlapTrial | None = None

    @model_validator(mode="after")
    def _covers_model(self) -> Plan:
        if self.overlap is not None and self.shares is not None:
            raise ValueError("overlap: a data-parallel plan (shares) does not overlap; only a tensor-parallel one")
        if [e.rank for e in self.entries] != list(range(len(self.entries))):
            raise ValueError(f"entries: ranks must be 0..N-1 in order, got {[e.rank for e in self.entries]}")
        if self.entries:
            tp = mesh_of(len(self.entries), self.shares, "entries")
            layouts = {Layout(attn=tuple(e.attn for e in g), mlp=tuple(e.mlp for e in g),
                              vocab=tuple(e.vocab for e in g))
                       for g in (self.entries[i:i + tp] for i in range(0, len(self.entries), tp))}
            if len(layouts) > 1:
                raise ValueError(f"entries: every data-parallel group holds the same layout, got "
                                 f"{sorted(x.to_text() for x in layouts)}")
            try:
                self.layout().check(self.sizes, quanta=None)
            except LayoutError as exc:
                raise ValueError(f"entries: {exc}") from None
        check_trial(self.trial, self.overlap, self.shares, "trial", layout=self.layout(), sizes=self.sizes)
        return self

    @property
    def tp_size(self) -> int:
        """Ranks per tensor-parallel group (every entry without shares)."""
        return len(self.entries) // len(self.shares) if self.shares else len(self.entries)

    def layout(self) -> Layout:
        """The tensor-parallel layout (the first group's entries' counts; every group holds the same)."""
        first = self.entries[:self.tp_size]
        return Layout(attn=tuple(e.attn for e in first), mlp=tuple(e.mlp for e in first),
                      vocab=tuple(e.vocab for e in first))


def mesh_of(world_size: int, shares: list[int] | tuple[int, ...] | None, field: str = "shares") -> int:
    """Ranks per tensor-parallel group of a world of `world_size` ranks cut into one data-parallel
    group per share: rank r is in group r // tp and holds TP rank r % tp of the layout. ValueError
    naming `field` when the shares do not divide the world."""
    if shares is None:
        return world_size
    if world_size % len(shares):
        raise ValueError(f"{field}: {world_size} ranks cannot form {len(shares)} equal data-parallel groups "
                         f"(shares {list(shares)})")
    return world_size // len(shares)


class Assignment(Message):
    job_id: Id
    plan_version: Count
    node_id: Id
    rank: Rank
    world_size: WorldSize
    rendezvous_host: HostName
    rendezvous_port: Annotated[int, Field(gt=0, lt=65536)]
    layout: Layout  # every TP rank's counts per segment kind; this node's ranges follow from `rank`
    spec: JobSpec
    # Data parallelism: rows of each global batch per data-parallel group (Plan.shares; `mesh_of`
    # says which group a rank is in). None: one tensor-parallel group of every rank.
    shares: Annotated[list[NonNegInt], Field(min_length=1, max_length=MAX_NODES)] | None = None
    resume_step: Count = 0
    # The world's key (32 random bytes, hex; one per plan version): the ranks prove it to each
    # other right after joining, so a stranger at the rendezvous port gets no data
    # (node/tp/groupkey.py). Never logged, never retained; kept out of reprs.
    group_key: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", repr=False)]
    overlap: Overlap | None = None  # Plan.overlap
    trial: OverlapTrial | None = None  # Plan.trial

    @model_validator(mode="after")
    def _consistent(self) -> Assignment:
        if self.rank >= self.world_size:
            raise ValueError(f"rank: {self.rank} is not below world_size {self.world_size}")
        if self.overlap is not None and self.shares is not None:
            raise ValueError("overlap: a data-parallel assignment (shares) does not overlap; only a tensor-parallel one")
        check_overlap_rows(self.overlap, self.spec.recipe.batch_size, "overlap")
        check_trial(self.trial, self.overlap, self.shares, "trial", self.spec.recipe.batch_size, self.layout)
        tp = mesh_of(self.world_size, self.shares)
        if self.layout.world_size != tp:
            groups = "" if self.shares is None else f" in data-parallel groups of {tp} (shares {self.shares})"
            raise ValueError(f"layout: {self.layout.world_size} ranks for world_size {self.world_size}{groups}")
        if self.shares is not None and sum(self.shares) != self.spec.recipe.batch_size:
            raise ValueError(f"shares: {self.shares} sum to {sum(self.shares)} rows, the batch has "
                             f"{self.spec.recipe.batch_size}")
        return self


class AssignmentAck(Message):
    job_id: Id
    plan_version: Count
    node_id: Id
    accepted: bool
    reason: Text4k | None = None


class _Control(Message):
    job_id: Id
    plan_version: Count


class JobStart(_Control):
    action: Literal["start"] = "start"


class JobPause(_Control):
    action: Literal["pause"] = "pause"


class JobResume(_Control):
    action: Literal["resume"] = "resume"


class JobCancel(_Control):
    action: Literal["cancel"] = "cancel"


class JobReshard(_Control):
    """Gateway -> the owner (rank 0): move the running job to `layout` (same ranks) at the iteration
    boundary before step `at_step` (0-based; or the first boundary after it, when the order comes
    late); the owner broadcasts it to every rank through the job's group (`xronos.node.rank.jobrank`).
    A data-parallel job (its assignment's `shares`) keeps its layout (`layout` is then each group's,
    as in its Assignment) and re-splits its batch: `shares`, rows of each global batch per
    data-parallel group from that boundary on (no weights move). The node checks the group count
    and the sum against its assignment, which this message does not know."""

    action: Literal["reshard"] = "reshard"
    at_step: Count
    layout: Layout
    reason: Text256
    shares: Annotated[list[NonNegInt], Field(min_length=1, max_length=MAX_NODES)] | None = None

    @model_validator(mode="after")
    def _rows(self) -> JobReshard:
        if self.shares is not None and sum(self.shares) < 1:
            raise ValueError(f"shares: {self.shares} hold no rows; a batch has at least one")
        return self


JobControl = Annotated[Union[JobStart, JobPause, JobResume, JobCancel, JobReshard], Field(discriminator="action")]

JobControlAdapter: TypeAdapter[JobStart | JobPause | JobResume | JobCancel] = TypeAdapter(JobControl)


class InspectRequest(Message):
    """Gateway → owner at submit time: can you run this job (paths, model, dataset)?"""

    request_id: Id
    job_id: Id
    spec: JobSpec


class InspectReport(Message):
    node_id: Id
    request_id: Id
    job_id: Id
    ok: bool
    arch: ArchSpec | None = None
    train_rows: NonNegInt | None = None
    eval_rows: NonNegInt | None = None
    total_steps: Count | None = None
    error: Text4k | None = None

