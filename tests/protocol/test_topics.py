import pytest

from protocol_samples import SAMPLES, params_for
from xronos.protocol import messages as m
from xronos.protocol.topics import BY_KEY, ENTRIES, TopicTable, encoding_for


def test_build_and_match_every_entry_with_custom_base():
    table = TopicTable("home/xronos")
    for entry in ENTRIES:
        params = params_for(entry.key)
        topic = table.build(entry, **params)
        assert topic.startswith("home/xronos/" if entry.root == "base" else "homeassistant/")
        assert table.match(topic) == (entry, params)


def test_table_values_match_the_contract():
    t = TopicTable()
    assert t.build("node.availability", node_id="a") == "xronos/node/a/availability"
    assert t.build("gateway.request.job/submit") == "xronos/gateway/request/job/submit"
    assert t.build("gateway.response", name="plan/preview") == "xronos/gateway/response/plan/preview"
    retained = {e.key for e in ENTRIES if e.retained}
    assert retained == {"node.availability", "node.capabilities", "node.job", "node.catalog", "job.state",
                        "gateway.availability", "gateway.ha_state", "node.ha_state", "ha.status"}
    assert {e.key for e in ENTRIES if e.command} == {"gateway.set", "node.set"}
    assert t.build("ha.status") == "homeassistant/status"
    assert TopicTable(discovery_prefix="ha").build("ha.status") == "ha/status"
    assert BY_KEY["node.metrics"].encoding == "msgpack" and BY_KEY["job.state"].encoding == "json"
    assert [e.key.split(".", 2)[2] for e in ENTRIES if e.is_request] == list(m.REQUEST_MODELS)


def test_filters():
    t = TopicTable()
    assert t.filter("node.metrics") == "xronos/node/+/metrics"
    assert t.filter("node.metrics", node_id="x") == "xronos/node/x/metrics"
    assert t.filter("gateway.response") == "xronos/gateway/response/#"


def test_no_match_and_bad_params():
    t = TopicTable()
    assert t.match("xronos/node/a/b/availability") is None
    assert t.match("other/node/a/availability") is None
    assert t.match("xronos/gateway/response/job/explode") is None
    with pytest.raises(ValueError, match="node_id"):
        t.build("node.metrics", node_id="a/b")
    with pytest.raises(ValueError, match="node_id"):
        t.build("node.metrics", node_id="+")
    with pytest.raises(ValueError, match="needs parameters"):
        t.build("node.metrics")
    with pytest.raises(ValueError, match="not one of"):
        t.build("gateway.response", name="job/explode")
    with pytest.raises(ValueError, match="base"):
        TopicTable("xronos/")


def test_topic_for_message_type():
    t = TopicTable()
    assert t.topic_for(SAMPLES["node.metrics"], node_id="a")[0] == "xronos/node/a/metrics"
    assert t.topic_for(m.Availability.ONLINE)[0] == "xronos/gateway/availability"
    assert t.topic_for("offline", node_id="a")[0] == "xronos/node/a/availability"
    assert t.topic_for(m.JobCancel(job_id="j", plan_version=1), node_id="a")[1].key == "node.control"
    assert t.topic_for(SAMPLES["gateway.response"], name="nodes/list")[0].endswith("response/nodes/list")
    with pytest.raises(TypeError):
        t.topic_for(SAMPLES["node.metrics"])
    assert encoding_for(SAMPLES["job.state"]) == "json"
    with pytest.raises(TypeError):
        encoding_for(object())
