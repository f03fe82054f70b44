"""The settings of a training rank: a `Recipe` (what is trained and how, typed once in the
protocol: `xronos.protocol.recipe`) plus where the rank runs. Frozen pydantic models, JSON on disk,
one file per rank:

- `RankConfig`: every training rank's (ours and the baselines', `xronos.bench`): the recipe plus
  its placement — the threads, where to meet, the rank, where the numbers go;
- `RunConfig(RankConfig)`: our TP engine's rank — the world's per-segment `layout` (world size =
  `layout.world_size`), forced or live re-shards. `xronos run` writes one per rank;
  `RunConfig.for_job(spec, ...)` is the one a job's rank takes from its JobSpec;
- `JobRankConfig`: a job's rank process (`xronos.node.rank.jobrank`): its `RunConfig` plus what a job
  adds (ids, checkpoints, resume, the node's allowed directories, the events pipe).

Everything is identical across ranks except `rank`. What only the owner can know (the data's
size, the tokenizer's pad id, the classes it decided from the data, config.json for ranks without
model files) is not a setting: the runtime shares it at start (`xronos.node.rank.lifecycle.Facts`).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from xronos.protocol.layout import Layout
from xronos.protocol.messages import JobSpec, Overlap, OverlapTrial, Recipe, check_overlap_rows, check_trial


class RankConfig(BaseModel):
    """Every training rank's settings (ours and the baselines'): the recipe and the rank's
    placement. Each subclass has `world_size` (a field, or a property of its own fields)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    recipe: Recipe
    threads: int = Field(default=1, gt=0)
    gloo_timeout_s: float = Field(default=300.0, gt=0)
    metrics_path: str | None = None
    # Per-rank part: who am I and where is the rendezvous.
    rank: int = Field(default=0, ge=0)
    rendezvous_host: str = "127.0.0.1"
    rendezvous_port: int = Field(default=29500, gt=0, lt=65536)
    # The world's key, proved by every rank right after joining (node/tp/groupkey.py): a job's from
    # its Assignment, a local run's from spawn_ranks. None: no proof (tests joining by hand).
    group_key: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$", repr=False)

    @model_validator(mode="after")
    def _check(self) -> RankConfig:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size} ranks")
        return self

    def total_steps(self, n_train: int) -> int:
        return self.recipe.total_steps(n_train)

    def for_rank(self, rank: int, port: int | None = None):
        update: dict[str, object] = {"rank": rank}
        if port is not None:
            update["rendezvous_port"] = port
        return type(self).model_validate({**self.model_dump(), **update})

    def write(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=1))

    @classmethod
    def read(cls, path: Path):
        return cls.model_validate_json(Path(path).read_text())


class ReshardAt(BaseModel):
    """A forced live re-shard: at the boundary before step `step` every rank moves to `layout`
    (`xronos run --reshard-at STEP:LAYOUT`, for testing the move; `xronos.node.rank.relayout`), or,
    in a data-parallel run (`RunConfig.shares`), the batch is re-split into `shares` rows per group
    (`--reshard-at STEP:shares=R1,..,RG`; the layout stays, no weights move). Exactly one of the two."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step: int = Field(ge=0)
    layout: Layout | None = None
    shares: tuple[int, ...] | None = None

    @model_validator(mode="after")
    def _one(self) -> ReshardAt:
        if (self.layout is None) == (self.shares is None):
            raise ValueError(f"reshard_at step {self.step}: give a layout or shares, exactly one")
        return self


class RunConfig(RankConfig):
    """A rank of our TP engine: `xronos run`'s, or a job's (`for_job`)."""

    layout: Layout  # each tensor-parallel group's
    # Data parallelism: rows of each global batch per data-parallel group (rank r in group
    # r // layout.world_size, `protocol.mesh_of`). None: one tensor-parallel group of every rank.
    shares: tuple[int, ...] | None = None
    progress: bool = True
    reshard_at: tuple[ReshardAt, ...] = ()  # in increasing step order; layouts of this world's size, or shares
    rebalance: bool = False  # rank 0 re-plans (with shares: re-splits) live from measured speeds (`relayout`)
    # A tensor-parallel run's overlap of its all-reduces with compute (node/tp/overlap.py; None: none)
    overlap: Overlap | None = None
    # Overlap modes measured against each other at the start, the fastest kept (node/rank/trial.py)
    trial: OverlapTrial | None = None

    @model_validator(mode="after")
    def _overlap(self) -> RunConfig:
        if self.overlap is not None and self.shares is not None:
            raise ValueError("overlap: a data-parallel run (shares) does not overlap; only a tensor-parallel one")
        check_overlap_rows(self.overlap, self.recipe.batch_size, "overlap")
        check_trial(self.trial, self.overlap, self.shares, "trial", self.recipe.batch_size, self.layout)
        return self

    @model_validator(mode="after")
    def _reshards(self) -> RunConfig:
        if self.rebalance and self.reshard_at:
            raise ValueError("give reshard_at (forced moves) or rebalance (planned moves), not both")
        steps = [r.step for r in self.reshard_at]
        if steps != sorted(set(steps)):
            raise ValueError(f"reshard_at: steps {steps} must be distinct and increasing")
        for r in self.reshard_at:
            if r.shares is not None:
                self._check_resplit(r)
            elif r.layout is not None and self.shares is not None:  # before its ranks: a group's, not the run's
                raise ValueError("shares: a data-parallel run does not re-shard its layout (reshard_at with a "
                                 "layout); it re-splits its rows (reshard_at with shares, or rebalance)")
            elif r.layout is not None and r.layout.world_size != self.layout.world_size:
                raise ValueError(f"reshard_at step {r.step}: layout has {r.layout.world_size} ranks, the run "
                                 f"{self.layout.world_size}")
            last = self.recipe.max_steps
            if last is not None and r.step >= last:
                raise ValueError(f"reshard_at step {r.step}: the run has only {last} steps (0..{last - 1})")
        return self

    @model_validator(mode="after")
    def _shares(self) -> RunConfig:
        if self.shares is None:
            return self
        if not self.shares or any(isinstance(x, bool) or x < 0 for x in self.shares):
            raise ValueError(f"shares: rows per data-parallel group must be integers >= 0, got {list(self.shares)}")
        if sum(self.shares) != self.recipe.batch_size:
            raise ValueError(f"shares: {list(self.shares)} sum to {sum(self.shares)} rows, the batch has "
                             f"{self.recipe.batch_size}")
        if any(r.layout is not None for r in self.reshard_at):
            raise ValueError("shares: a data-parallel run does not re-shard its layout (reshard_at with a layout); "
                             "it re-splits its rows (reshard_at with shares, or rebalance)")
        return self

    def _check_resplit(self, r: ReshardAt) -> None:
        """A share entry: only in a data-parallel run, one share per group, rows >= 0 summing to the batch."""
        assert r.shares is not None
        if self.shares is None:
            raise ValueError(f"reshard_at step {r.step}: shares {list(r.shares)} re-split a data-parallel run's batch, "
                             "and this run has no shares")
        if len(r.shares) != len(self.shares) or any(isinstance(x, bool) or x < 0 for x in r.shares) \
                or sum(r.shares) != self.recipe.batch_size:
            raise ValueError(f"reshard_at step {r.step}: shares {list(r.shares)} must be {len(self.shares)} integers "
                             f">= 0 (one per data-parallel group) summing to the batch, {self.recipe.batch_size}")

    @property
    def world_size(self) -> int:
        return self.layout.world_size * (len(self.shares) if self.shares else 1)

    @classmethod
    def for_job(cls, spec: JobSpec, *, layout: Layout, rank: int, host: str, port: int, threads: int,
                gloo_timeout_s: float, group_key: str | None = None,
                shares: tuple[int, ...] | None = None, overlap: Overlap | None = None,
                trial: OverlapTrial | None = None) -> RunConfig:
        """The rank settings a JobSpec means: its recipe, placed, with its plan's overlap and trial. (The
        job's live re-balancing is the gateway's, not its rank 0's: `rebalance` stays off.)"""
        return cls(recipe=spec.recipe, layout=layout, shares=shares, threads=threads, gloo_timeout_s=gloo_timeout_s,
                   progress=False, rank=rank, rendezvous_host=host, rendezvous_port=port, group_key=group_key,
                   overlap=overlap, trial=trial)


class JobRankConfig(BaseModel):
    """One rank process of an MQTT job, as the node service writes it (`xronos.node.rank.process`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str
    plan_version: int = Field(ge=0)
    node_id: str
    run: RunConfig  # rank, layout, rendezvous, and the training settings from the JobSpec
    checkpoint_interval: int = Field(gt=0)
    resume_step: int = Field(default=0, ge=0)
    checkpoint_dir: str | None = None  # owner only
    allowed_dirs: list[str] | None = None  # the node's; the base checkpoint's files must lie inside them
    events_fd: int | None = None  # the pipe to the node service (set by `RankProcess`)
