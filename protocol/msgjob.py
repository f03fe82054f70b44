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
    Text4k, Text256, UnitCount, WorldSize,
)
from .recipe import Recipe


# The job spec's own schema version: 3 made it a `Recipe` plus the job's own fields. A spec file
# of version 2 (every setting at top level) is mapped once, where files are read
# (`xronos.protocol.specfile.upgrade_spec`); on the wire the gateway and the nodes speak one version.
SPEC_VERSION = 3


class JobSpec(Message):
    """A job: its recipe (what is trained and how) plus what only a job has — its name and owner,
    the planner's strategy and the memory it leaves each node, the nodes it may use, checkpoints,
    live re-balancing."""

    schema_version: Literal[3] = SPEC_VERSION  # type: ignore[assignment]  (the spec's own, see SPEC_VERSION)
    name: Name
    owner: Id
    recipe: Recipe
    strategy: Strategy = "segment"
    checkpoint_interval: Steps = 100
    nodes: Annotated[list[Id], Field(min_length=1, max_length=MAX_NODES)] | None = None
    reserve_mb: Megabytes = 512
    # Live re-balancing (issue 14): the gateway re-plans from the ranks' measured per-kind compute
    # and re-shards the running job at an iteration boundary when the predicted gain repays the move.
    # On by default: a job runs on boxes whose other work changes their speed, the case it is for.
    rebalance: bool = True

    @model_validator(mode="after")
    def _has_export(self) -> JobSpec:
        if self.recipe.export_dir is None:
            raise ValueError("recipe.export_dir: a job must name where its export goes")
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
    comm_s: Seconds

    @model_validator(mode="after")
    def _covers_model(self) -> Plan:
        if [e.rank for e in self.entries] != list(range(len(self.entries))):
            raise ValueError(f"entries: ranks must be 0..N-1 in order, got {[e.rank for e in self.entries]}")
        if self.entries:
            try:
                self.layout().check(self.sizes, quanta=None)
            except LayoutError as exc:
                raise ValueError(f"entries: {exc}") from None
        return self

    def layout(self) -> Layout:
        """The entries' counts as a Layout (rank order)."""
        return Layout(attn=tuple(e.attn for e in self.entries), mlp=tuple(e.mlp for e in self.entries),
                      vocab=tuple(e.vocab for e in self.entries))


class Assignment(Message):
    job_id: Id
    plan_version: Count
    node_id: Id
    rank: Rank
    world_size: WorldSize
    rendezvous_host: HostName
    rendezvous_port: Annotated[int, Field(gt=0, lt=65536)]
    layout: Layout  # every rank's counts per segment kind; this node's ranges follow from `rank`
    spec: JobSpec
    resume_step: Count = 0
    # The world's key (32 random bytes, hex; one per plan version): the ranks prove it to each
    # other right after joining, so a stranger at the rendezvous port gets no data
    # (node/tp/groupkey.py). Never logged, never retained; kept out of reprs.
    group_key: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", repr=False)]

    @model_validator(mode="after")
    def _consistent(self) -> Assignment:
        if self.rank >= self.world_size:
            raise ValueError(f"rank: {self.rank} is not below world_size {self.world_size}")
        if self.layout.world_size != self.world_size:
            raise ValueError(f"layout: {self.layout.world_size} ranks for world_size {self.world_size}")
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
    late); the owner broadcasts it to every rank through the job's group (`xronos.node.rank.jobrank`)."""

    action: Literal["reshard"] = "reshard"
    at_step: Count
    layout: Layout
    reason: Text256


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

