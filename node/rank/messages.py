"""What crosses the boundary between the node service and a job's rank process, typed once.

    rank -> node   `RankEvent`: one JSON line per event on the events pipe (node/rank/spawn.py)
    node -> rank   `RankOrder`: one JSON line per order on the rank's stdin

Each is a tagged union of frozen, strict pydantic models (the tag: `kind`), validated once where it
arrives (`read_event` in the node service's `RankProcess`, `read_order` in the rank); a layout
travels as the protocol's `Layout` — the same JSON as in the rank's config file and on the wire.
The node service turns events into the protocol's messages (`NodeJobStatus`, `IterationMetrics`);
orders come from the gateway's `JobControl` (`order_for`).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from xronos.protocol import messages as m
from xronos.protocol.layout import Layout
from xronos.protocol.msgtypes import Bytes, Count, Metric, NonNegInt, PathText, Seconds, Text4k, Text256

DETAIL = 2000  # characters of a failure's or a refusal's detail


class _Message(BaseModel):
    # NaN and inf travel as JSON's constants: a diverged loss is worth seeing (IterationMetrics.loss)
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", ser_json_inf_nan="constants")


# -- rank -> node ---------------------------------------------------------------------------------
class Status(_Message):
    """Training (again), or held at a boundary by a pause."""

    kind: Literal["status"] = "status"
    status: Literal["running", "paused"]


class Metrics(_Message):
    """One iteration on this rank: `IterationMetrics` without the job's ids."""

    kind: Literal["metrics"] = "metrics"
    step: Count  # steps done (1 after the first)
    epoch: Count
    loss: Metric
    compute_s: Seconds
    compute_attn_s: Seconds | None = None
    compute_mlp_s: Seconds | None = None
    compute_vocab_s: Seconds | None = None
    compute_rest_s: Seconds | None = None
    comm_s: Seconds
    idle_s: Seconds
    iteration_s: Seconds
    voluntary_ctx_switches: NonNegInt
    involuntary_ctx_switches: NonNegInt
    peak_rss: Bytes
    clock: Literal["wall", "virtual"]
    wall_s: Seconds

    def numbers(self) -> dict[str, object]:
        return self.model_dump(exclude={"kind"})


class Evaluated(_Message):
    """The owner's evaluation before or after training."""

    kind: Literal["eval"] = "eval"
    when: Literal["before", "after"]
    name: Literal["accuracy", "perplexity"]
    metric: Metric | None
    loss: Metric


class Checkpointed(_Message):
    """The owner saved a consolidated checkpoint after `step` steps."""

    kind: Literal["checkpoint"] = "checkpoint"
    step: Count


class Resharded(_Message):
    """The owner's: every rank moved to `layout` at the boundary before `step` (a data-parallel
    job's re-split: its layout kept, `shares` the rows per group from then on, 0 bytes moved)."""

    kind: Literal["resharded"] = "resharded"
    step: Count
    layout: Layout
    reason: Text256
    seconds: Seconds | None = None
    moved_bytes: Bytes | None = None
    shares: Annotated[list[NonNegInt], Field(min_length=1, max_length=m.MAX_NODES)] | None = None


class OverlapTried(_Message):
    """The owner's: the overlap trial kept `kept` from step `step` on; each mode's median
    iteration (the slowest rank's, on the ranks' clock)."""

    kind: Literal["overlap_tried"] = "overlap_tried"
    step: Count
    kept: m.OverlapLabel
    seconds: Annotated[dict[m.OverlapLabel, Seconds], Field(max_length=m.MAX_TRIAL_MODES)]


class ReshardRefused(_Message):
    """The owner's: an order it could not follow (the job goes on as it was)."""

    kind: Literal["reshard_refused"] = "reshard_refused"
    detail: Text4k


class Cancelled(_Message):
    kind: Literal["cancelled"] = "cancelled"
    step: Count


class Completed(_Message):
    kind: Literal["completed"] = "completed"
    step: Count
    epoch: Count
    export_dir: PathText | None  # the owner's


class Failed(_Message):
    """The rank failed; `job_fault`: the training itself (`lifecycle.JobFault`), which re-planning
    would only repeat."""

    kind: Literal["failed"] = "failed"
    detail: Text4k
    job_fault: bool = False


RankEvent = Annotated[Union[Status, Metrics, Evaluated, Checkpointed, Resharded, ReshardRefused, OverlapTried,
                            Cancelled, Completed, Failed], Field(discriminator="kind")]
ENDED = (Completed, Failed, Cancelled)  # the events after which a rank reports nothing more


# -- node -> rank ---------------------------------------------------------------------------------
class Pause(_Message):
    kind: Literal["pause"] = "pause"


class Resume(_Message):
    kind: Literal["resume"] = "resume"


class Cancel(_Message):
    kind: Literal["cancel"] = "cancel"


class Reshard(_Message):
    """The owner's only: move every rank to `layout` at the first boundary at or after `at_step`;
    with `shares` (a data-parallel job, its layout kept), re-split the batch into those rows per group."""

    kind: Literal["reshard"] = "reshard"
    at_step: Count
    layout: Layout
    reason: Text256 = "rebalance"
    shares: Annotated[list[NonNegInt], Field(min_length=1, max_length=m.MAX_NODES)] | None = None


RankOrder = Annotated[Union[Pause, Resume, Cancel, Reshard], Field(discriminator="kind")]

_EVENT: TypeAdapter[RankEvent] = TypeAdapter(RankEvent)
_ORDER: TypeAdapter[RankOrder] = TypeAdapter(RankOrder)


def read_event(line: str | bytes) -> RankEvent:
    """One line from a rank (pydantic's ValidationError, naming the field, if it is not an event)."""
    return _EVENT.validate_json(line)


def read_order(line: str | bytes) -> RankOrder:
    return _ORDER.validate_json(line)


def order_for(control: m.JobPause | m.JobResume | m.JobCancel | m.JobReshard) -> RankOrder:
    """The rank's order for the gateway's control of a running job."""
    if isinstance(control, m.JobReshard):
        return Reshard(at_step=control.at_step, layout=control.layout, reason=control.reason, shares=control.shares)
    return {"pause": Pause, "resume": Resume, "cancel": Cancel}[control.action]()
