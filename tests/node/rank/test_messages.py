"""The rank boundary's messages (node/rank/messages.py): every event and order survives its one
JSON line, anything else is refused naming what is wrong, and an event's numbers are the protocol's."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from xronos.node.rank import messages as msg
from xronos.protocol import messages as m
from xronos.protocol.layout import Layout

LAYOUT = Layout(attn=(4, 8), mlp=(64, 36), vocab=(32, 5))
METRICS = msg.Metrics(step=3, epoch=0, loss=2.5, compute_s=0.4, compute_attn_s=0.1, compute_mlp_s=0.2,
                      compute_vocab_s=0.05, compute_rest_s=0.05, comm_s=0.1, idle_s=0.02, iteration_s=0.52,
                      voluntary_ctx_switches=3, involuntary_ctx_switches=1, peak_rss=1 << 28, clock="wall",
                      wall_s=0.52)
EVENTS = [msg.Status(status="paused"), METRICS,
          msg.Evaluated(when="before", name="perplexity", metric=math.inf, loss=7.0),
          msg.Checkpointed(step=10), msg.Resharded(step=4, layout=LAYOUT, reason="gain 9%", seconds=0.3, moved_bytes=9),
          msg.ReshardRefused(detail="layout has 2 ranks, the job 3"),
          msg.OverlapTried(step=11, kept="c2", seconds={"c2": 0.2, "off": 0.25, "bwd": 0.21}), msg.Cancelled(step=5),
          msg.Completed(step=20, epoch=2, export_dir="/srv/out"), msg.Failed(detail="boom", job_fault=True)]
ORDERS = [msg.Pause(), msg.Resume(), msg.Cancel(), msg.Reshard(at_step=7, layout=LAYOUT, reason="first")]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.kind)
def test_every_event_survives_its_line(event) -> None:
    line = event.model_dump_json()
    assert "\n" not in line and msg.read_event(line) == event


@pytest.mark.parametrize("order", ORDERS, ids=lambda o: o.kind)
def test_every_order_survives_its_line(order) -> None:
    assert msg.read_order(order.model_dump_json()) == order


def test_a_diverged_loss_still_travels() -> None:
    back = msg.read_event(METRICS.model_copy(update={"loss": math.nan}).model_dump_json())
    assert math.isnan(back.loss)


def test_the_layout_crosses_as_the_protocols_json() -> None:
    line = json.loads(msg.Reshard(at_step=1, layout=LAYOUT).model_dump_json())
    assert line["layout"] == json.loads(LAYOUT.model_dump_json())


@pytest.mark.parametrize(("line", "field"), [
    ({"kind": "exploded"}, "kind"),
    ({"kind": "metrics"}, "step"),
    ({"kind": "checkpoint", "step": 10**30}, "step"),
    ({"kind": "checkpoint", "step": "7"}, "step"),  # strict: no coercion
    ({"kind": "status", "status": "exploded"}, "status"),
    ({"kind": "status", "status": "running", "extra": 1}, "extra"),
    ({"type": "status", "status": "running"}, "kind"),  # the old untyped form
])
def test_anything_else_is_refused_naming_the_field(line, field) -> None:
    with pytest.raises(ValidationError, match=field):
        msg.read_event(json.dumps(line))


def test_an_order_for_another_world_reads_but_an_order_without_a_layout_does_not() -> None:
    assert msg.read_order('{"kind": "reshard", "at_step": 1, "layout": {"attn": [6, 6], "mlp": [50, 50], '
                          '"vocab": [20, 17]}}').layout.world_size == 2  # the rank refuses it by its world
    with pytest.raises(ValidationError, match="layout"):
        msg.read_order('{"kind": "reshard", "at_step": 1}')
    with pytest.raises(ValidationError, match="kind"):
        msg.read_order('{"action": "pause"}')


def test_the_gateways_controls_become_orders() -> None:
    ids = {"job_id": "j", "plan_version": 2}
    assert msg.order_for(m.JobPause(**ids)) == msg.Pause()
    assert msg.order_for(m.JobResume(**ids)) == msg.Resume()
    assert msg.order_for(m.JobCancel(**ids)) == msg.Cancel()
    assert msg.order_for(m.JobReshard(**ids, at_step=4, layout=LAYOUT, reason="r")) == \
        msg.Reshard(at_step=4, layout=LAYOUT, reason="r")


def test_metrics_are_the_protocols_iteration_metrics_without_the_ids() -> None:
    full = m.IterationMetrics(job_id="j", plan_version=1, node_id="n", rank=0, **METRICS.numbers())
    assert full.model_dump(exclude={"job_id", "plan_version", "node_id", "rank", "schema_version"}) == \
        METRICS.numbers()


def test_the_boundary_broadcast_row_reads_back() -> None:
    """Between ranks a re-shard travels as counts in the boundary's broadcast (node/rank/relayout.py)."""
    from xronos.node.rank.relayout import counts_row, from_counts_row

    assert counts_row(LAYOUT) == [4, 8, 64, 36, 32, 5]
    assert from_counts_row(counts_row(LAYOUT), 2) == LAYOUT


def test_the_overlap_trials_outcome_becomes_the_owners_status() -> None:
    from xronos.node.agent.rankstatus import status_update

    ev = msg.OverlapTried(step=11, kept="off", seconds={"bwd": 0.2, "off": 0.19})
    status, fields = status_update("j", ev, "running")
    assert status == "running" and fields == {"trial_step": 11, "trial_kept": "off",
                                              "trial_seconds": {"bwd": 0.2, "off": 0.19}}
    m.NodeJobStatus(node_id="n", job_id="j", plan_version=1, rank=0, status=status, sent_at=1.0, **fields)
    with pytest.raises(ValidationError, match="kept"):
        msg.OverlapTried(step=11, kept="c", seconds={})
