"""Home Assistant against the real gateway and node services (over the FakeBus): starting a job
from a job spec in the gateway's job_dir, the refusal reason, state published on change only,
removing a retired node for good, retained commands ignored, retained job states cleared,
Participate persisted across a node restart."""

from __future__ import annotations

import json

import pytest

from nodekit import pump
from test_gateway_glue import NODES, SPEC, T, Harness, announce, report  # noqa: F401  (tests/services)
from xronos.gateway.config import GatewayConfig
from xronos.gateway.job import machine as J
from xronos.gateway.service import GatewayService
from xronos.node.agent.config import NodeConfig
from xronos.node.agent.service import NodeService
from xronos.protocol import messages as m
from xronos.protocol.codec import decode
from fakebus import FakeBroker

from protocol_samples import ARCH  # noqa: E402

SPEC_TOML = """
name = "Reviews"
owner = "a"
model_dir = "/m"
data_path = "/d.csv"
task = "causal-lm"
batch_size = 4
seq_len = 64
lr = 1e-4
max_steps = 10
export_dir = "/out"
reserve_mb = 0
"""


class HAHarness(Harness):
    def __init__(self, tmp, broker=None, job_dir=None):
        self.broker = broker or FakeBroker()
        jobs = job_dir or tmp / "jobs"
        jobs.mkdir(exist_ok=True)
        self.cfg = GatewayConfig(state_dir=tmp / "gw", homeassistant={"enabled": True, "job_dir": str(jobs)},
                                 rendezvous_port_min=40000, rendezvous_port_max=40009)
        self.gw = GatewayService(self.cfg, self.broker.bus("gw", will=(T.build("gateway.availability"),
                                                                        "offline", True), table=T),
                                 timeouts=J.Timeouts(inspect_s=5, ack_s=5, stall_s=60, recover_s=60, retry_s=0.0))
        self.client = self.broker.bus("client")
        self.client.subscribe("#")
        self.client.start()
        self.gw.start()

    def ha(self, command: dict | bytes, retain: bool = False):
        data = command if isinstance(command, bytes) else json.dumps(command).encode()
        self.client.publish("xronos/gateway/set", data, retain=retain)
        self.pump()
        return self.state()

    def state(self) -> dict:
        return json.loads(self.broker.retained["xronos/gateway/state"])

    def discovery(self) -> dict:
        return json.loads(self.broker.retained["homeassistant/device/xronos_gateway/config"])


def test_start_a_job_from_home_assistant(tmp_path):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "reviews.toml").write_text(SPEC_TOML)
    (tmp_path / "jobs" / "other.yaml").write_text(SPEC_TOML.replace(" = ", ": ").replace('"Reviews"', "Other"))
    (tmp_path / "jobs" / "notes.txt").write_text("not a spec")
    h = HAHarness(tmp_path)
    announce(h)
    cmps = h.discovery()["cmps"]
    assert cmps["job_spec"]["p"] == "select" and cmps["job_spec"]["options"] == ["other", "reviews"]
    assert cmps["start"]["p"] == "button" and json.loads(cmps["start"]["payload_press"]) == {"action": "start"}
    assert h.state()["selected_spec"] == "other"
    select = cmps["job_spec"]["command_template"].replace("{{ value | tojson }}", json.dumps("reviews"))
    assert h.ha(json.loads(select))["selected_spec"] == "reviews"
    h.client.drain()
    state = h.ha(json.loads(cmps["start"]["payload_press"]))
    assert state["last_command"].startswith("start: submitted reviews as reviews-")
    (params, insp), = h.seen("node.inspect_request")
    assert params["node_id"] == "a" and insp.spec.name == "Reviews" and insp.spec.recipe.max_steps == 10
    # The documented automation action: a spec by name, without touching the select.
    h.client.drain()
    assert h.ha({"action": "start", "spec": "other"})["last_command"].startswith("start: submitted other as other-")
    assert h.ha({"action": "start", "spec": "missing"})["last_command"].startswith("start: error: no job spec 'missing'")


def test_a_spec_link_out_of_job_dir_is_not_a_spec_and_a_yaml_error_quotes_no_line(tmp_path):
    """A link in job_dir to a file elsewhere is neither listed nor started (its parse error would
    have quoted its first line into the retained state); a YAML error says what and where only."""
    (tmp_path / "jobs").mkdir()
    (tmp_path / "secret.txt").write_text("password: hunter2: topsecret\n")
    (tmp_path / "jobs" / "evil.yaml").symlink_to(tmp_path / "secret.txt")
    (tmp_path / "jobs" / "broken.yaml").write_text("name: x\npassword: hunter2: topsecret\n")
    (tmp_path / "jobs" / "reviews.toml").write_text(SPEC_TOML)
    (tmp_path / "jobs" / "same.toml").symlink_to(tmp_path / "jobs" / "reviews.toml")  # inside: fine
    h = HAHarness(tmp_path)
    announce(h)
    assert h.discovery()["cmps"]["job_spec"]["options"] == ["broken", "reviews", "same"]
    state = h.ha({"action": "start", "spec": "evil"})
    assert state["last_command"].startswith("start: error: no job spec 'evil'"), state
    state = h.ha({"action": "start", "spec": "broken"})
    assert "not valid YAML: mapping values are not allowed here at line 2, column 18" in state["last_command"]
    assert "hunter2" not in json.dumps(state) and "hunter2" not in repr(h.broker.retained)


def test_refusal_reason_is_a_sensor(tmp_path):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "reviews.toml").write_text(SPEC_TOML)
    h = HAHarness(tmp_path)
    announce(h, ("b",))  # the owner "a" is offline: refused at submit
    state = h.ha({"action": "start"})
    assert "owner node 'a' is offline" in state["error"], state
    sensor = h.discovery()["cmps"]["error"]
    assert sensor["value_template"] == "{{ value_json.error }}" and sensor["state_topic"] == "xronos/gateway/state"
    assert len(state["error"]) <= 255


def test_the_current_and_last_job_say_how_they_train(tmp_path):
    """Task and Data format come from the spec of the job the gateway shows: the one just
    started, and still the last one once it is over."""
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "chat.toml").write_text(SPEC_TOML + 'data_format = "chat"\n')
    h = HAHarness(tmp_path)
    announce(h)
    assert (h.state()["task"], h.state()["data_format"]) == (None, None)  # no job yet
    cmps = h.discovery()["cmps"]
    assert [cmps[k]["value_template"] for k in ("task", "data_format")] == [
        "{{ value_json.task }}", "{{ value_json.data_format }}"]
    state = h.ha({"action": "start", "spec": "chat"})
    assert state["last_command"].startswith("start: submitted chat as")
    assert (state["task"], state["data_format"]) == ("causal-lm", "chat")
    state = h.ha({"action": "cancel"})
    assert state["phase"] == "cancelled", state
    assert (state["task"], state["data_format"]) == ("causal-lm", "chat")
    # A restarted gateway shows the last job's from its stored spec.
    h.gw.bus.stop()
    h2 = HAHarness(tmp_path, h.broker)
    h2.pump()
    h2.gw._flush(force=True)
    assert (h2.state()["task"], h2.state()["data_format"]) == ("causal-lm", "chat")


def test_gateway_state_is_published_on_change_only(tmp_path):
    h = HAHarness(tmp_path)
    announce(h)
    h.gw._flush(force=True)  # what the throttle (at most every 0.5 s) held back
    before = [t for t, _, _ in h.broker.log if t == "xronos/gateway/state"]
    for _ in range(30):
        h.gw.step(0)
        h.gw._flush(force=True)
    after = [(t, p) for t, p, _ in h.broker.log if t == "xronos/gateway/state"]
    assert len(after) == len(before), after[-2:]
    h.client.publish(T.build("node.availability", node_id="c"), "offline", retain=True)
    h.pump()
    h.gw._flush(force=True)
    assert len([t for t, _, _ in h.broker.log if t == "xronos/gateway/state"]) == len(before) + 1
    assert h.state()["nodes_online"] == 2


def test_remove_a_retired_node_for_good(tmp_path):
    h = HAHarness(tmp_path)
    announce(h)
    node = json.loads(h.broker.retained["homeassistant/device/xronos_gateway_node_c/config"])
    press = json.loads(node["cmps"]["remove"]["payload_press"])
    assert press == {"action": "remove_node", "node_id": "c"}
    assert h.ha(press)["last_command"] == "remove_node: error: node 'c' is online: stop its service first"
    h.client.publish(T.build("node.availability", node_id="c"), "offline", retain=True)
    h.pump()
    assert h.ha(press)["last_command"] == "remove_node: removed node c"
    for topic in ("xronos/node/c/availability", "xronos/node/c/capabilities",
                  "homeassistant/device/xronos_gateway_node_c/config"):
        assert topic not in h.broker.retained, topic
    assert "c" not in h.gw.reg
    # A restarted gateway does not bring it back (nothing retained says it exists).
    h.gw.bus.stop()
    h2 = HAHarness(tmp_path, h.broker)
    h2.pump()
    assert set(h2.gw.reg) == {"a", "b"}
    (ok,) = h2.request("nodes/list", {"transaction": "n"})
    assert [n["node_id"] for n in ok.data["nodes"]] == ["a", "b"]


def test_a_retained_pause_does_not_pause_again_after_a_restart(tmp_path):
    h = HAHarness(tmp_path)
    announce(h)
    job_id = _running_job(h)
    # Someone (or an automation) publishes the command retained. Subscribers already there get it
    # as a live message (MQTT clears the retain flag for them): it pauses, once.
    assert h.ha({"action": "pause"}, retain=True)["last_command"] == "pause: paused"
    assert h.ha({"action": "resume"})["last_command"] == "resume: running"
    assert "xronos/gateway/set" in h.broker.retained
    h.gw.bus.stop()
    h2 = HAHarness(tmp_path, h.broker)  # a restart: the broker replays it, flagged retained
    h2.pump()
    assert h2.gw.jobs[job_id].phase == "running"  # not paused again
    assert "xronos/gateway/set" not in h.broker.retained  # and cleared
    assert h2.gw.dispatcher.errors["retained_command"] == 1
    assert h2.ha({"action": "pause"})["last_command"] == "pause: paused"  # a fresh press works


def test_bad_home_assistant_commands_are_refused_with_the_reason(tmp_path):
    h = HAHarness(tmp_path)
    announce(h)
    for payload, want in ((b'{"action": "pause", "schema_version": 1}', "schema_version"),
                          (b'{"action": "explode"}', "action"),
                          (b'{"action": "pause", "spec": "x"}', "takes no 'spec'"),
                          (json.dumps({"action": "start", "spec": "a" * 2000}).encode(), "too_large"),
                          (b'{"action": "remove_node", "node_id": "../x"}', "node_id"),
                          (b"\xff\xfe", "bad_encoding")):
        state = h.ha(payload)
        assert state["last_command"].startswith("error:") and want in state["last_command"], (payload, state)
    (ok,) = h.request("nodes/list", {"transaction": "still"})
    assert ok.status == "ok"


def test_retained_job_states_of_pruned_and_unknown_jobs_are_cleared(tmp_path):
    h = HAHarness(tmp_path)
    announce(h)
    job_id = _running_job(h)
    h.gw._flush(force=True)
    assert f"xronos/job/{job_id}/state" in h.broker.retained
    old = h.broker.retained[f"xronos/job/{job_id}/state"]
    h.gw.cfg = h.gw.cfg.model_copy(update={"history_max_jobs": 0})
    h.gw._abort(job_id, "ended for the test")  # a finished job: the history prunes it at once
    h.gw._flush(force=True)
    assert job_id not in h.gw.jobs
    assert f"xronos/job/{job_id}/state" not in h.broker.retained
    # A state left by a job this gateway never had (jobs.json replaced, pruned while down).
    h.client.publish("xronos/job/ghost-1/state", old, retain=True)
    h.gw.bus.stop()
    h2 = HAHarness(tmp_path, h.broker)
    h2.pump()
    assert "xronos/job/ghost-1/state" not in h.broker.retained


def _running_job(h: HAHarness) -> str:
    h.client.drain()
    h.client.publish("xronos/gateway/request/job/submit",
                     json.dumps({"transaction": "t1", "spec": SPEC.model_dump(mode="json")}).encode())
    h.pump()
    (_, insp), = h.seen("node.inspect_request")
    h.node_says(m.InspectReport(node_id="a", request_id=insp.request_id, job_id=insp.job_id, ok=True, arch=ARCH,
                                train_rows=40, eval_rows=4, total_steps=10), "a")
    h.pump()
    for params, req in h.seen("node.profile_request"):
        h.node_says(report(params["node_id"], req.request_id, req.job_id), params["node_id"])
    h.pump()
    assigned = [decode(t, p) for t, p in h.client.drain() if t.endswith("/assignment")]
    for a in assigned:
        h.node_says(m.AssignmentAck(job_id=insp.job_id, plan_version=a.plan_version, node_id=a.node_id,
                                    accepted=True), a.node_id)
    h.pump()
    h.node_says(m.NodeJobStatus(node_id="a", job_id=insp.job_id, plan_version=1, rank=0, status="running",
                                step=1, sent_at=1.0), "a")
    h.pump()
    assert h.gw.jobs[insp.job_id].phase == "running"
    return insp.job_id


# --- the node side -----------------------------------------------------------------------------

def _node(tmp_path, broker, participate=True):
    cfg = NodeConfig(node_id="n0", state_dir=tmp_path / "state", allowed_dirs=[tmp_path],
                     data_host="127.0.0.1", threads=1, participate=participate)
    svc = NodeService(cfg, broker.bus("n0", will=(T.build("node.availability", node_id="n0"), "offline", True)))
    svc.start()
    # Its own availability and capabilities come back to it first: then it hears what a test sends.
    pump(svc, until=lambda: svc.availability.confirmed and svc.owncaps.confirmed)
    return svc


def _caps(broker) -> m.Capabilities:
    return decode("xronos/node/n0/capabilities", broker.retained["xronos/node/n0/capabilities"])


def test_participate_survives_a_node_restart(tmp_path):
    broker = FakeBroker()
    client = broker.bus("ha")
    client.start()
    svc = _node(tmp_path, broker)
    assert _caps(broker).participate is True
    client.publish("xronos/node/n0/set", b'{"participate": false}')
    svc.step(0.1)
    assert _caps(broker).participate is False
    svc.shutdown()
    svc.work.shutdown(wait=True)
    again = _node(tmp_path, broker)  # node.toml still says participate = true
    try:
        assert again.participate is False and _caps(broker).participate is False
        assert json.loads(broker.retained["xronos/node/n0/state"])["participate"] is False
    finally:
        again.work.shutdown(wait=True)


def test_node_ignores_a_retained_switch_and_publishes_its_state_on_change_only(tmp_path):
    broker = FakeBroker()
    client = broker.bus("ha")
    client.start()
    client.publish("xronos/node/n0/set", b'{"participate": false}', retain=True)
    svc = _node(tmp_path, broker)
    try:
        for _ in range(5):
            svc.step(0.01)
        assert svc.participate is True and "xronos/node/n0/set" not in broker.retained
        states = [t for t, _, _ in broker.log if t == "xronos/node/n0/state"]
        svc._publish_ha()
        svc._publish_ha()
        assert [t for t, _, _ in broker.log if t == "xronos/node/n0/state"] == states
    finally:
        svc.work.shutdown(wait=True)


@pytest.mark.parametrize("payload", [b'{"participate": "false"}', b'{"participate": false, "schema_version": 1}',
                                     b'{"participate": false, "x": 1}', b"x" * 5000])
def test_node_refuses_bad_switch_payloads(tmp_path, payload):
    broker = FakeBroker()
    client = broker.bus("ha")
    client.subscribe("xronos/node/n0/error")
    client.start()
    svc = _node(tmp_path, broker)
    try:
        client.publish("xronos/node/n0/set", payload)
        svc.step(0.1)
        assert svc.participate is True
        (topic, err), = [(t, p) for t, p in client.drain() if t.endswith("/error")]
        assert json.loads(err)["topic"] == "xronos/node/n0/set"
    finally:
        svc.work.shutdown(wait=True)


def test_a_refused_start_shows_refused_where_it_said_submitted(tmp_path, caplog):
    """Refused at once (the owner is offline): Last command says refused and why, not "submitted
    as <id>" of a job that does not exist. Refused later (the owner's inspection): the same entity
    turns from "submitted" to "refused" with the owner's reason."""
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "reviews.toml").write_text(SPEC_TOML)
    h = HAHarness(tmp_path)
    announce(h, ("b",))  # the owner "a" is offline
    state = h.ha({"action": "start", "spec": "reviews"})
    assert state["last_command"].startswith("start: refused reviews: owner node 'a' is offline"), state
    assert "submitted" not in state["last_command"] and h.gw.jobs == {}
    announce(h)
    h.client.drain()
    state = h.ha({"action": "start", "spec": "reviews"})
    assert state["last_command"].startswith("start: submitted reviews as reviews-"), state
    job_id = state["last_command"].rsplit(" ", 1)[1]
    (_, insp), = h.seen("node.inspect_request")
    h.node_says(m.InspectReport(node_id="a", request_id=insp.request_id, job_id=insp.job_id, ok=False,
                                error="spec.model_dir '/m' is outside the allowed directories: /srv/xronos"), "a")
    h.pump()
    state = h.state()
    assert state["last_command"] == (f"start: refused reviews ({job_id}): owner 'a' cannot run it: spec.model_dir "
                                     "'/m' is outside the allowed directories: /srv/xronos"), state
    assert job_id not in h.gw.jobs


def test_the_node_publishes_its_catalog_and_rescans_on_request(tmp_path):
    from xronos.node.agent import catalog

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.csv").write_text("x")
    broker = FakeBroker()
    cfg = NodeConfig(node_id="n0", state_dir=tmp_path / "state", allowed_dirs=[tmp_path], data_host="127.0.0.1",
                     threads=1)
    svc = NodeService(cfg, broker.bus("n0", will=(T.build("node.availability", node_id="n0"), "offline", True)))
    svc.start()
    try:
        pump(svc, until=lambda: "xronos/node/n0/catalog" in broker.retained)
        cat = decode("xronos/node/n0/catalog", broker.retained["xronos/node/n0/catalog"])
        assert cat.data == [str(data / "a.csv")] and cat.models == [] and cat.allowed_dirs == [str(tmp_path)]
        (data / "b.jsonl").write_text("x")
        svc.catalog._scanned_at -= catalog.MIN_RESCAN_S  # the last scan is not just now
        client = broker.bus("gw")
        client.start()
        client.publish("xronos/node/n0/catalog/request", json.dumps({"schema_version": 2, "request_id": "c1"}).encode())
        pump(svc, until=lambda: b"b.jsonl" in broker.retained["xronos/node/n0/catalog"])
        cat = decode("xronos/node/n0/catalog", broker.retained["xronos/node/n0/catalog"])
        assert cat.data == [str(data / "a.csv"), str(data / "b.jsonl")]
    finally:
        svc.work.shutdown(wait=True)


def _catalog(node: str, **kw) -> m.NodeCatalog:
    base = dict(node_id=node, allowed_dirs=["/srv/xronos"], models=["/srv/xronos/models/qwen"],
                data=["/srv/xronos/data/chat.jsonl"], scanned_at=1.0)
    return m.NodeCatalog(**{**base, **kw})


def test_the_form_follows_the_owners_catalogs_and_refresh_asks_them(tmp_path):
    """Catalogs become the selects' options (discovery re-published when they change); a catalog
    on another node's topic is refused; Refresh files asks every known node; a removed node's
    catalog goes with it; the form starts a job whose spec the owner is asked to inspect."""
    h = HAHarness(tmp_path)
    announce(h)
    assert "form_model" not in h.discovery()["cmps"] and h.state()["form"]["owner"] is None
    h.node_says(_catalog("a"), "a")
    h.pump()
    cmps = h.discovery()["cmps"]
    assert cmps["form_model"]["options"] == ["/srv/xronos/models/qwen"] and h.state()["form"]["owner"] == "a"
    h.client.publish(T.build("node.catalog", node_id="b"), _catalog("a", models=["/etc"]).model_dump_json().encode(),
                     retain=True)  # b speaking for a
    h.pump()
    assert h.discovery()["cmps"]["form_model"]["options"] == ["/srv/xronos/models/qwen"]
    h.client.drain()
    assert h.ha({"action": "refresh"})["last_command"] == "refresh: asked 3 node(s) for their files"
    assert sorted(p["node_id"] for p, _ in h.seen("node.catalog_request")) == ["a", "b", "c"]
    state = h.ha({"action": "start_form", "form": {"model": "/srv/xronos/models/qwen",
                                                   "data": "/srv/xronos/data/chat.jsonl", "steps": 7}})
    assert state["last_command"].startswith("start_form: submitted qwen-chat as qwen-chat-"), state
    (_, insp), = h.seen("node.inspect_request")
    assert (insp.spec.recipe.model_dir, insp.spec.recipe.max_steps, insp.spec.recipe.export_dir[:27]) == (
        "/srv/xronos/models/qwen", 7, "/srv/xronos/exports/qwen-ch")
    assert h.state()["form"]["steps"] == 100  # an automation's values are its start's, not the form's
    # A node retired for good: its catalog goes with it (the retained one and the Owner option).
    h.node_says(_catalog("c"), "c")
    h.pump()
    assert h.discovery()["cmps"]["form_owner"]["options"] == ["a", "c"]
    h.client.publish(T.build("node.availability", node_id="c"), "offline", retain=True)
    h.pump()
    assert h.ha({"action": "remove_node", "node_id": "c"})["last_command"] == "remove_node: removed node c"
    assert "xronos/node/c/catalog" not in h.broker.retained
    assert h.discovery()["cmps"]["form_owner"]["options"] == ["a"]


def test_the_form_survives_a_gateway_restart(tmp_path):
    h = HAHarness(tmp_path)
    announce(h)
    h.node_says(_catalog("a"), "a")
    h.pump()
    for field, value in (("model", "/srv/xronos/models/qwen"), ("steps", 250), ("lr", 5e-5), ("gguf", "q8_0")):
        assert h.ha({"action": "set", "field": field, "value": value})["last_command"] == f"set: {field} = {value}"
    h.gw.bus.stop()
    h2 = HAHarness(tmp_path, h.broker)
    h2.pump()
    h2.gw._flush(force=True)
    form = h2.state()["form"]
    assert (form["owner"], form["model"], form["steps"], form["lr"], form["gguf"]) == (
        "a", "/srv/xronos/models/qwen", 250, 5e-5, "q8_0")
    (tmp_path / "gw" / "homeassistant-form.json").write_text('{"steps": "x"}')  # not a form: the defaults
    h2.gw.bus.stop()
    h3 = HAHarness(tmp_path, h.broker)
    h3.pump()
    assert h3.gw.homeassistant.bridge.form.steps == 100 and h3.gw.internal_errors == 0
