"""A node's bad ProfileReport on the MQTT topic (over the FakeBus, the gateway service in process):
one the codec refuses (a NaN time) and one the planner cannot use (no attention layer). Before,
the first left the job waiting out the profile timeout (600 s) and the second failed the whole
submit; now the job leaves that node out at once, its events naming the node and the field, and
plans on the others; the service keeps running."""

from __future__ import annotations

import math

import msgpack
import pytest

from test_gateway_glue import NODES, SPEC, Harness, announce, report, submit_to_inspection
from xronos.protocol import messages as m
from xronos.protocol.codec import decode, encode
from xronos.protocol.topics import TopicTable

T = TopicTable()


def _nan_time(r: m.ProfileReport) -> bytes:
    doc = r.model_dump(mode="json")
    doc["layers"][1]["time_s"] = math.nan
    return msgpack.packb(doc, use_bin_type=True)


def _no_attention(r: m.ProfileReport) -> bytes:
    layers = [lay for lay in r.layers if lay.segment != "attn"]
    return encode(r.model_copy(update={"layers": layers}))


@pytest.mark.parametrize("bad, why", [
    (_nan_time, "field 'layers.1.time_s' invalid: Input should be a finite number"),
    (_no_attention, "node c's profile: field layers: no partitioned layer of segment 'attn'"),
])
def test_a_bad_report_leaves_its_node_out_at_once(tmp_path, bad, why):
    h = Harness(tmp_path)
    announce(h)
    insp = submit_to_inspection(h)
    h.node_says(m.InspectReport(node_id="a", request_id=insp.request_id, job_id=insp.job_id, ok=True,
                                arch=report("a", "x", "y").arch, train_rows=40, eval_rows=4, total_steps=10), "a")
    h.pump()
    for params, req in h.seen("node.profile_request"):
        node, r = params["node_id"], report(params["node_id"], req.request_id, req.job_id)
        topic = T.build("node.profile_report", node_id=node)
        h.client.publish(topic, bad(r) if node == "c" else encode(r))
    h.pump()
    resp = [decode(t, p) for t, p in h.client.drain() if t.endswith("response/job/submit")]
    assert resp and resp[0].status == "ok", resp  # answered now, not after the profile timeout
    plan = m.Plan.model_validate(resp[0].data["plan"])
    assert [e.node_id for e in plan.entries] == [n for n in NODES if n != "c"]
    job = h.gw.jobs[insp.job_id]
    (event,) = [e for e in job.events if "leaving out 'c'" in e]
    assert "could not profile" in event and why in event, event
    assert not h.gw.stopping and h.gw.internal_errors == 0
