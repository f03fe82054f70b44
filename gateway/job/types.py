"""Typed data of the job state machine: the job record, the events it reacts to, the effects it
asks for, and the context it decides in. Frozen dataclasses over the protocol's pydantic models
(a job's spec is a `JobSpec`, its plan a `Plan`, its profiles `ProfileReport`s): what arrives is
validated once, at the wire, and the core never re-reads dicts with string keys. The store
persists a record as it is, through pydantic (`store.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Union

from pydantic import ConfigDict, with_config

from xronos.gateway.plan.compatible import job_settings, settings_diff
from xronos.protocol import messages as m
from xronos.protocol.layout import Layout

TERMINAL = frozenset({"completed", "failed", "cancelled"})
# Phases in which a job holds its nodes: only one such job runs at a time.
ACTIVE = frozenset({"assigning", "running", "paused", "recovering"})
# "plan" is only found in job tables written before planning moved into the core.
Awaiting = Literal["", "inspect", "profiles", "plan", "acks", "retry"]
RespondTo = Literal["job/submit", "plan/preview"]


@dataclass(frozen=True)
class Timeouts:
    inspect_s: float = 120.0  # the owner's first inspection imports torch, transformers, datasets
    profile_s: float = 600.0
    # A node that drops off the broker while it profiles (a Wi-Fi blip, a broker restart) keeps
    # profiling: its report is awaited this long before its profile counts as failed.
    profile_offline_s: float = 60.0
    ack_s: float = 60.0
    stall_s: float = 300.0  # running without a metric this long = a silent failure
    recover_s: float = 900.0  # give up re-planning after this long
    retry_s: float = 5.0  # re-plan attempt interval while recovering
    regroup_s: float = 3.0  # after a rank failure, time for a dead peer's last-will to arrive
    max_recoveries: int = 5


@dataclass(frozen=True)
class Net:
    """The LAN the data plane runs on, for the planner's communication term."""

    bandwidth_Bps: float = 125e6
    latency_s: float = 0.0005


class Agg(NamedTuple):
    """Running sums of one node's iterations under the current plan version."""

    n: int
    compute_s: float
    idle_s: float
    iteration_s: float
    comm_s: float = 0.0


@with_config(ConfigDict(extra="forbid", ser_json_inf_nan="constants"))
@dataclass(frozen=True)
class Job:
    job_id: str
    spec: m.JobSpec
    created_at: float
    phase: m.Phase = "queued"
    respond_to: RespondTo = "job/submit"  # or "plan/preview": a preview job ends after its plan
    transaction: str | None = None  # submit/preview request still waiting for its answer
    accepted: bool = False
    awaiting: Awaiting = ""
    waiting: tuple[str, ...] = ()  # nodes whose answer is awaited
    # (request id, node id) of the inspection or profile requests in flight: only these answers count.
    requests: tuple[tuple[str, str], ...] = ()
    # Nodes whose profile is awaited and that went offline meanwhile: since when (`profile_offline_s`)
    offline_since: dict[str, float] = field(default_factory=dict)
    request_seq: int = 0  # request ids are "<job id>.<seq>"
    deadline: float | None = None
    recover_deadline: float | None = None
    arch: m.ArchSpec | None = None
    units_total: int | None = None
    total_steps: int = 0
    profiles: dict[str, m.ProfileReport] = field(default_factory=dict)
    excluded: tuple[str, ...] = ()  # refused an assignment; back in when it reconnects
    plan: m.Plan | None = None
    plan_version: int = 0
    want_paused: bool = False
    recoveries: int = 0
    checkpoint_step: int = 0  # the owner's last consolidated checkpoint = resume point
    resume_step: int = 0  # where the current plan version started
    step: int = 0
    epoch: int = 0
    loss: float | None = None
    eval_metric: float | None = None
    eval_metric_name: str | None = None
    eval_initial: float | None = None
    agg: dict[str, Agg] = field(default_factory=dict)
    peak_rss: dict[str, int] = field(default_factory=dict)  # per node, the current plan version's highest
    last_iteration_s: float | None = None
    clock: Literal["wall", "virtual"] | None = None  # what the ranks' seconds are on (IterationMetrics)
    export_dir: str | None = None
    events: tuple[str, ...] = ()
    error: str | None = None
    updated_at: float = 0.0
    replans: int = 0  # live re-shards ordered (the plan's counts follow them)
    last_replan_reason: str | None = None
    last_reshard_step: int | None = None  # the boundary of the owner's latest applied re-shard
    pending_plan: m.Plan | None = None  # a re-shard ordered, not yet applied: the plan it makes
    reshard_refused: str | None = None  # the owner's latest refusal heard (a repeat is not news)
    # The overlap trial's outcome the owner told (Plan.trial): plan version, the step the kept mode
    # runs from, and that mode ("off", "bwd", "cN"). A new plan version tries again.
    trial_kept: tuple[int, int, str] | None = None
    # A node that joins (`join`): its profile requests in flight (apart from `requests`, which
    # the other phases use), the plan taken with it and the checkpoint step it waits to pass, and
    # the predicted seconds per iteration without it (the same planner, the same profiles).
    join_requests: tuple[tuple[str, str], ...] = ()
    join_plan: m.Plan | None = None
    join_after: int = 0
    join_base_s: float = 0.0
    # A restart's cost as this job measured it: from its latest assignment to rank 0's first metrics.
    assigned_at: float | None = None
    restart_s: float | None = None

    @property
    def owner(self) -> str:
        return self.spec.owner

    @property
    def plan_nodes(self) -> tuple[str, ...]:
        return tuple(e.node_id for e in self.plan.entries) if self.plan else ()

    @property
    def join_plan_nodes(self) -> tuple[str, ...]:
        return tuple(e.node_id for e in self.join_plan.entries) if self.join_plan else ()

    @property
    def join_newcomers(self) -> tuple[str, ...]:
        """The nodes a join taken brings: in its plan, not in the current one."""
        return tuple(n for n in self.join_plan_nodes if n not in self.plan_nodes)

    def rank_of(self, node_id: str) -> int | None:
        """The node's rank in the current plan (None if it has none)."""
        if self.plan is not None:
            for e in self.plan.entries:
                if e.node_id == node_id:
                    return e.rank
        return None

    @property
    def rank0(self) -> str | None:
        """The node holding rank 0 of the current plan: the owner, the only one that may report
        completion, checkpoints, evaluations and the export."""
        if self.plan is not None:
            for e in self.plan.entries:
                if e.rank == 0:
                    return e.node_id
        return None


def profile_mismatch(job: Job, report: m.ProfileReport) -> str | None:
    """Why a profile report does not answer this job's request (None if it does). The service
    checks first that the planner can use it at all (`profiles.check_report`)."""
    recipe = job.spec.recipe
    want = {"job_id": job.job_id, "arch": job.arch, "task": recipe.task, "batch_size": recipe.batch_size,
            "seq_len": recipe.seq_len}
    for name, value in want.items():
        got = getattr(report, name)
        if got != value:
            if isinstance(value, m.ArchSpec) and isinstance(got, m.ArchSpec):  # name the field that differs
                name = next(f"arch.{k}" for k in type(value).model_fields if getattr(got, k) != getattr(value, k))
                got, value = getattr(got, name[5:]), getattr(value, name[5:])
            return f"its report's {name} does not match the request (got {got!r}, the job's is {value!r})"
    # The job settings it records (none: an older node's, which honoured the request's; see
    # compatible.check_compatible): a LoRA or full fine-tune, decay, clipping other than the job's
    # are another profile's memory and time.
    diff = None if report.settings is None else settings_diff(report.settings, job_settings(job.spec))
    if diff is not None:
        return f"its report's settings.{diff[0]} does not match the request (got {diff[1]}, the job's is {diff[2]})"
    if report.capabilities.node_id != report.node_id:
        return "its report's capabilities name another node"
    return None


@dataclass(frozen=True)
class Planned:
    """A plan with the candidates the planner weighed (`planning.plan_job`): a line for the job's
    events (the strategy chosen, the runner-up) and the candidates as JSON-able rows (the preview's)."""

    plan: m.Plan
    note: str = ""
    candidates: tuple[dict[str, Any], ...] = ()


def plan_of(planned: m.Plan | Planned) -> m.Plan:
    return planned.plan if isinstance(planned, Planned) else planned


# A planner: (job, nodes in rank order, plan version, ctx) -> Plan (or Planned), or ValueError saying why not.
Planner = Callable[[Job, tuple[str, ...], int, "Ctx"], "m.Plan | Planned"]


def _no_planner(job: Job, nodes: tuple[str, ...], version: int, ctx: Ctx) -> m.Plan:
    raise ValueError("no planner configured")


@dataclass(frozen=True)
class JoinPolicy:
    """When a node that joins a running job is worth a restart from the next checkpoint (`join`)."""

    min_gain: float = 0.05  # least predicted gain, as the live policy's (`PolicyConfig.threshold`)
    restart_s: float | None = None  # a restart's cost; None: what the job measured, else `default_restart_s`
    default_restart_s: float = 60.0  # a job that has not measured one (e.g. after a gateway restart)


@dataclass(frozen=True)
class Ctx:
    now: float
    online: frozenset[str]  # online and participating nodes
    timeouts: Timeouts = Timeouts()
    busy: bool = False  # another job holds the nodes
    caps: Mapping[str, m.Capabilities] = field(default_factory=dict)  # latest per node
    net: Net = Net()
    planner: Planner = _no_planner
    join: JoinPolicy = JoinPolicy()


# --- events ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Inspected:
    report: m.InspectReport


@dataclass(frozen=True)
class Profiled:
    node_id: str
    request_id: str
    report: m.ProfileReport | None  # None = the node could not (or went offline)
    error: str | None = None
    warnings: tuple[str, ...] = ()  # a usable report that looks disturbed (profiles.falling_times)


@dataclass(frozen=True)
class Acked:
    node_id: str
    plan_version: int
    accepted: bool
    reason: str | None = None


@dataclass(frozen=True)
class NodeDown:
    node_id: str


@dataclass(frozen=True)
class NodeUp:
    node_id: str


@dataclass(frozen=True)
class Metrics:
    m: m.IterationMetrics


@dataclass(frozen=True)
class Status:
    s: m.NodeJobStatus


@dataclass(frozen=True)
class Command:
    action: Literal["pause", "resume", "cancel"]
    transaction: str | None = None


@dataclass(frozen=True)
class Tick:
    pass


@dataclass(frozen=True)
class Rebalanced:
    """The gateway's re-balancing policy decided (`xronos.gateway.job.rebalancers`): a re-plan to `layout`
    at the boundary before `at_step` (a data-parallel plan's: to `shares`, its layout kept), or
    (`layout` None) the plan kept for `reason`."""

    plan_version: int
    at_step: int
    layout: Layout | None
    reason: str
    old: Layout
    gain: float = 0.0
    predicted_compute_s: tuple[float, ...] = ()  # per rank, at the new layout
    predicted_memory: tuple[float, ...] = ()
    predicted_bottleneck_s: float = 0.0
    # A data-parallel plan's re-split (`layout` then the plan's own, kept): rows per group, new and old.
    shares: tuple[int, ...] | None = None
    old_shares: tuple[int, ...] | None = None


Event = Union[Inspected, Profiled, Acked, NodeDown, NodeUp, Metrics, Status, Command, Tick, Rebalanced]


# --- effects ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Respond:
    name: str  # request name, e.g. "job/submit"
    transaction: str | None
    ok: bool
    data: Mapping[str, Any] | None = None
    error: str | None = None


@dataclass(frozen=True)
class Inspect:
    job_id: str
    node_id: str
    request_id: str


@dataclass(frozen=True)
class Profile:
    job_id: str
    requests: tuple[tuple[str, str], ...]  # (request id, node id)


@dataclass(frozen=True)
class Assign:
    job_id: str
    plan: m.Plan
    resume_step: int


@dataclass(frozen=True)
class Control:
    job_id: str
    plan_version: int
    nodes: tuple[str, ...]
    action: Literal["start", "pause", "resume", "cancel"]


@dataclass(frozen=True)
class Reshard:
    """Order the owner to move the running job to `layout` at the boundary before `at_step` (with
    `shares`, a data-parallel job: its layout kept, its batch re-split into those rows per group)."""

    job_id: str
    plan_version: int
    node: str  # the owner
    at_step: int
    layout: Layout
    reason: str
    shares: tuple[int, ...] | None = None


Effect = Union[Respond, Inspect, Profile, Assign, Control, Reshard]
Out = tuple[Job, list[Effect]]
