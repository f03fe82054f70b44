"""Messages of a running job's state: every rank's per-iteration metrics, a node's view of its
current job (retained), and the gateway's aggregated job state (retained). Re-exported by
`xronos.protocol.messages`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from .layout import Layout
from .msgjob import MAX_TRIAL_MODES, OverlapLabel, Plan
from .msgtypes import (
    MAX_EVENTS, MAX_NODES, Bytes, Count, Eta, Event, Id, Message, Metric, NonNegInt, PathText, Percent, Phase,
    Rank, Seconds, Text4k, Text256, Timestamp,
)


class IterationMetrics(Message):
    job_id: Id
    plan_version: Count
    node_id: Id
    rank: Rank
    step: Count
    epoch: Count
    loss: Metric  # NaN/inf: the run diverged, which is worth seeing
    compute_s: Seconds
    comm_s: Seconds
    idle_s: Seconds
    iteration_s: Seconds
    voluntary_ctx_switches: NonNegInt
    involuntary_ctx_switches: NonNegInt
    peak_rss: Bytes
    # compute_s split by segment kind (attention, MLP, vocabulary, the rest); they sum to compute_s
    compute_attn_s: Seconds | None = None
    compute_mlp_s: Seconds | None = None
    compute_vocab_s: Seconds | None = None
    compute_rest_s: Seconds | None = None
    # The clock the seconds above are on: "virtual" (an emulated box, node/emulate) or "wall"; the
    # iteration's wall seconds beside them. None: a node from before the clock was reported.
    clock: Literal["wall", "virtual"] | None = None
    wall_s: Seconds | None = None


NodeFloats = Annotated[dict[Id, Seconds], Field(max_length=MAX_NODES)]  # per node: seconds or a ratio
NodeBytes = Annotated[dict[Id, Bytes], Field(max_length=MAX_NODES)]  # per node: bytes


class JobState(Message):
    job_id: Id
    name: Text256
    phase: Phase
    step: Count = 0
    total_steps: Count | None = None
    epoch: Count = 0
    loss: Metric | None = None
    eval_metric: Metric | None = None
    eval_metric_name: Text256 | None = None
    eval_initial: Metric | None = None  # the eval metric before training (eval_metric: after)
    export_dir: PathText | None = None  # where the owner wrote the export (once completed)
    iteration_s: Seconds | None = None
    clock: Literal["wall", "virtual"] | None = None  # what the seconds are on (the ranks' IterationMetrics)
    idle_ratio: NodeFloats = Field(default_factory=dict)
    predicted_s: NodeFloats = Field(default_factory=dict)  # compute seconds per iteration, per node
    measured_s: NodeFloats = Field(default_factory=dict)
    # Peak memory per node: the plan's prediction (the rank's peak resident set) and the highest
    # peak_rss its IterationMetrics reported under the current plan version.
    predicted_peak_bytes: NodeBytes = Field(default_factory=dict)
    peak_rss_bytes: NodeBytes = Field(default_factory=dict)
    # Communication per node: the plan's all-reduce time vs the node's measured comm_s.
    predicted_comm_s: NodeFloats = Field(default_factory=dict)
    measured_comm_s: NodeFloats = Field(default_factory=dict)
    compute_mape_pct: Percent | None = None  # over the nodes with both numbers
    comm_mape_pct: Percent | None = None
    eta_s: Eta | None = None
    plan: Plan | None = None
    # The mode the plan's overlap trial (Plan.trial) kept, which the ranks run from its decision on
    # (the plan's `overlap` is the mode they started with); None: no trial decided.
    overlap_kept: OverlapLabel | None = None
    # Live re-balancing: re-shards ordered so far (the plan's counts follow them) and the last
    # decision's reason (a re-plan's, or why the policy kept the plan).
    replans: Count = 0
    last_replan_reason: Text256 | None = None
    events: Annotated[list[Event], Field(max_length=MAX_EVENTS)] = Field(default_factory=list)
    updated_at: Timestamp
    error: Text4k | None = None


class NodeJobStatus(Message):
    """A node's view of its current job (retained): what a restarted gateway reconciles from."""

    node_id: Id
    job_id: Id
    plan_version: Count
    rank: Rank
    status: Literal["accepted", "running", "paused", "completed", "failed", "cancelled"]
    step: Count = 0
    epoch: Count = 0
    checkpoint_step: Count | None = None
    eval_metric: Metric | None = None
    eval_metric_name: Text256 | None = None
    eval_initial: Metric | None = None
    export_dir: PathText | None = None
    detail: Text4k | None = None
    # failed: by the training itself (a non-finite loss or gradient), which the same job meets on any
    # nodes: the gateway fails the job rather than re-planning it (a node's failure is re-planned).
    job_fault: bool = False
    # The owner's latest live re-shard (a JobReshard it applied): the boundary (before this 0-based
    # step), the layout every rank moved to, the owner's wall time at that boundary and the bytes moved.
    reshard_step: Count | None = None
    reshard_layout: Layout | None = None
    reshard_s: Seconds | None = None
    reshard_bytes: Bytes | None = None  # sent over the network by all ranks together (weights and moments)
    # A data-parallel job's latest re-split (its layout kept): the rows per group from reshard_step on.
    reshard_shares: Annotated[list[NonNegInt], Field(min_length=1, max_length=MAX_NODES)] | None = None
    # The owner's latest refused JobReshard (wrong world, counts that do not fit the model): why.
    # The gateway then drops the order it had pending; the job goes on under its plan.
    reshard_refused: Text256 | None = None
    # The owner's outcome of the plan's overlap trial (Plan.trial): the step it was decided after,
    # the mode kept from then on, and each mode's median iteration (the slowest rank's, seconds on
    # the ranks' clock), in the trial's order.
    trial_step: Count | None = None
    trial_kept: OverlapLabel | None = None
    trial_seconds: Annotated[dict[OverlapLabel, Seconds], Field(max_length=MAX_TRIAL_MODES)] | None = None
    sent_at: Timestamp
