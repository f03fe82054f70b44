"""Plain data of the job state machine: the job record, the events it reacts to, the effects it asks
for. Frozen dataclasses of JSON-able values, so the store can persist a record as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

TERMINAL = frozenset({"completed", "failed", "cancelled"})
# Phases in which a job holds its nodes: only one such job runs at a time.
ACTIVE = frozenset({"assigning", "running", "paused", "recovering"})


@dataclass(frozen=True)
class Timeouts:
    inspect_s: float = 120.0  # the owner's first inspection imports torch, transformers, datasets
    profile_s: float = 600.0
    ack_s: float = 60.0
    stall_s: float = 300.0  # running without a metric this long = a silent failure
    recover_s: float = 900.0  # give up re-planning after this long
    retry_s: float = 5.0  # re-plan attempt interval while recovering
    regroup_s: float = 3.0  # after a rank failure, time for a dead peer's last-will to arrive
    max_recoveries: int = 5


@dataclass(frozen=True)
class Ctx:
    now: float
    online: frozenset[str]  # online and participating nodes
    timeouts: Timeouts = Timeouts()
    busy: bool = False  # another job holds the nodes


@dataclass(frozen=True)
class Job:
    job_id: str
    spec: dict[str, Any]  # JobSpec in JSON form
    created_at: float
    phase: str = "queued"
    respond_to: str = "job/submit"  # or "plan/preview": a preview job ends after its plan
    transaction: str | None = None  # submit/preview request still waiting for its answer
    accepted: bool = False
    awaiting: str = ""  # "inspect" | "profiles" | "plan" | "acks" | "retry" | ""
    waiting: tuple[str, ...] = ()  # nodes whose answer is awaited
    deadline: float | None = None
    recover_deadline: float | None = None
    arch: dict[str, Any] | None = None
    units_total: int | None = None
    total_steps: int = 0
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    excluded: tuple[str, ...] = ()  # refused an assignment; back in when it reconnects
    plan: dict[str, Any] | None = None
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
    agg: dict[str, list[float]] = field(default_factory=dict)  # node -> [n, compute, idle, iteration]
    last_iteration_s: float | None = None
    export_dir: str | None = None
    events: tuple[str, ...] = ()
    error: str | None = None
    updated_at: float = 0.0

    @property
    def owner(self) -> str:
        return self.spec["owner"]

    @property
    def plan_nodes(self) -> tuple[str, ...]:
        return tuple(e["node_id"] for e in self.plan["entries"]) if self.plan else ()


# --- events ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Inspected:
    node_id: str
    ok: bool
    arch: dict[str, Any] | None = None
    total_steps: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class Profiled:
    node_id: str
    report: dict[str, Any] | None  # ProfileReport in JSON form; None = the node could not
    error: str | None = None


@dataclass(frozen=True)
class Planned:
    plan: dict[str, Any] | None  # Plan in JSON form, ranks in the order MakePlan gave the nodes
    error: str | None = None


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
    m: dict[str, Any]  # IterationMetrics fields


@dataclass(frozen=True)
class Status:
    s: dict[str, Any]  # NodeJobStatus fields


@dataclass(frozen=True)
class Command:
    action: str  # pause | resume | cancel
    transaction: str | None = None


@dataclass(frozen=True)
class Tick:
    pass


Event = Union[Inspected, Profiled, Planned, Acked, NodeDown, NodeUp, Metrics, Status, Command, Tick]


# --- effects ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Respond:
    name: str  # request name, e.g. "job/submit"
    transaction: str | None
    ok: bool
    data: dict[str, Any] | None = None
    error: str | None = None


@dataclass(frozen=True)
class Inspect:
    job_id: str
    node_id: str


@dataclass(frozen=True)
class Profile:
    job_id: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class MakePlan:
    job_id: str
    nodes: tuple[str, ...]  # owner first: it becomes rank 0
    version: int


@dataclass(frozen=True)
class Assign:
    job_id: str
    plan: dict[str, Any]
    resume_step: int


@dataclass(frozen=True)
class Control:
    job_id: str
    plan_version: int
    nodes: tuple[str, ...]
    action: str  # start | pause | resume | cancel


Effect = Union[Respond, Inspect, Profile, MakePlan, Assign, Control]
Out = tuple[Job, list[Effect]]
