"""Home Assistant discovery: payloads checked against the documented schema (INTERFACES.md §7),
templates rendered the way HA renders them, and a Home Assistant-like client pressing a button
on a real broker."""

from __future__ import annotations

import json
import queue
import re

import jinja2
import paho.mqtt.client as mqtt
import pytest

from xronos.gateway.homeassistant import discovery as ha
from xronos.protocol import hastate
from xronos.protocol.messages import Capabilities, JobSpec, JobState, NodeCatalog
from xronos.protocol.transport import BrokerSettings, MqttBus

CTX = ha.HAContext(base_topic="xronos", gateway_id="gw1", discovery_prefix="homeassistant")
PLATFORMS = {"sensor", "binary_sensor", "button", "switch", "select", "number"}
JINJA = jinja2.Environment(undefined=jinja2.StrictUndefined)  # a missing field fails loudly


def caps(node_id: str, temp: float | None) -> Capabilities:
    return Capabilities(node_id=node_id, hostname=node_id, arch="aarch64", cpu_model="Cortex-A76",
                        cores=4, memory_total=8 << 30, memory_available=6 << 30,
                        torch_version="2.13.0", data_host="10.0.0.5", cpu_temp_c=temp, sent_at=1.0)


def job(**kw) -> JobState:
    base = dict(job_id="j1", name="sst2", phase="running", step=30, total_steps=120, loss=0.6931,
                eval_metric=0.81, eval_metric_name="accuracy", iteration_s=2.5,
                idle_ratio={"pi5": 0.1, "n100": 0.3}, measured_s={"pi5": 2.4, "n100": 1.1},
                eta_s=225.0, updated_at=10.0)
    return JobState(**{**base, **kw})


def spec(lora_r: int | None = None, lora_targets: list[str] | None = None, **kw) -> JobSpec:
    """A job's spec; `kw` are its recipe's settings, LoRA's rank and targets its LoraSpec."""
    recipe = dict(model_dir="/m", data_path="/d.jsonl", task="causal-lm", data_format="chat", batch_size=4,
                  seq_len=64, lr=1e-4, max_steps=120, export_dir="/out",
                  lora=dict(r=lora_r, targets=lora_targets) if lora_r else None)
    return JobSpec(name="sst2", owner="pi5", recipe={**recipe, **kw})


def states() -> dict[str, list[dict]]:
    """Sample payloads for every state topic: a full one and an all-unknown one."""
    gw_full = ha.gateway_state(job(eval_initial=0.5, export_dir="/srv/xronos/exports/x"), nodes_online=2, now=11.0,
                               last_command="pause: ok", spec=spec(), form=FORM)
    gw_idle = ha.gateway_state(None, nodes_online=0, now=11.0)
    node_full = hastate.NodeHAState(participate=True, job_id="j1", attn=5, attn_total=12,
                                    attn_pct=41.7, mlp_pct=40.0, vocab_pct=38.5, compute_pct=80.0, idle_pct=15.0,
                                    cpu_temp_c=61.5, updated_at=1.0)
    node_none = hastate.NodeHAState(participate=False, updated_at=1.0)
    out = {CTX.topic(hastate.GATEWAY_STATE): [gw_full, gw_idle]}
    for n in ("pi5", "n100"):
        out[CTX.topic(hastate.NODE_STATE, node_id=n)] = [node_full, node_none]
    return {t: [json.loads(s.model_dump_json()) for s in v] for t, v in out.items()}


CATALOGS = {"pi5": NodeCatalog(node_id="pi5", allowed_dirs=["/srv/xronos"], models=["/srv/xronos/models/qwen"],
                               data=["/srv/xronos/data/chat.jsonl"], scanned_at=1.0)}
FORM = hastate.JobForm(owner="pi5", model="/srv/xronos/models/qwen")


def all_configs(specs=("reviews", "sst2-small")) -> list[tuple[str, dict]]:
    return [(t, json.loads(p)) for t, p in
            ha.discovery_messages(CTX, [caps("pi5", 61.5), caps("n100", None)], specs, FORM, CATALOGS)]


def render(template: str, value_json: dict) -> str:
    return JINJA.from_string(template).render(value_json=value_json, value=json.dumps(value_json))


def test_discovery_matches_the_documented_schema():
    configs = all_configs()
    assert [t for t, _ in configs] == ["homeassistant/device/xronos_gw1/config",
                                      "homeassistant/device/xronos_gw1_node_pi5/config",
                                      "homeassistant/device/xronos_gw1_node_n100/config"]
    sample = states()
    availability_topics = {"xronos/gateway/availability", "xronos/node/pi5/availability",
                           "xronos/node/n100/availability"}
    uids, entity_ids = set(), set()
    for topic, cfg in configs:
        assert re.fullmatch(r"homeassistant/device/[A-Za-z0-9_-]+/config", topic)
        assert cfg["dev"]["identifiers"] and cfg["dev"]["name"] and cfg["o"]["name"] == "xronos"
        # Availability once per device (a shared option of device-based discovery); only a
        # component meant for a node that is down overrides it with the gateway's.
        (device_avail,) = cfg["availability"]
        assert device_avail["topic"] in availability_topics
        for key, c in cfg["cmps"].items():
            assert c["p"] in PLATFORMS, key
            assert c["unique_id"] not in uids
            uids.add(c["unique_id"])
            if "availability" in c:
                assert key in ("online", "remove") and c["availability"][0]["topic"] == "xronos/gateway/availability"
            # Entity ids that read well, set with default_entity_id (object_id is deprecated).
            assert "object_id" not in c and re.fullmatch(rf"{c['p']}\.xronos_gw1_[a-z0-9_]+", c["default_entity_id"])
            assert c["default_entity_id"] not in entity_ids
            entity_ids.add(c["default_entity_id"])
            assert c.get("entity_category", "config") in ("config", "diagnostic")
            if "state_topic" in c and c["state_topic"] in sample:
                for value_json in sample[c["state_topic"]]:
                    rendered = render(c["value_template"], value_json)
                    if c.get("state_class") == "measurement":  # numeric, or "None" = unknown
                        assert rendered == "None" or isinstance(float(rendered), float), (key, rendered)
                    if c.get("device_class") == "enum":
                        assert rendered in c["options"]
                    if c["p"] == "select":  # an option, or "None" (Home Assistant: unknown)
                        assert rendered in c["options"] or rendered == "None", (key, rendered)
                    if c["p"] == "number":
                        assert c["min"] <= float(rendered) <= c["max"], (key, rendered)
                    if c["p"] == "switch":
                        assert rendered in (c["state_on"], c["state_off"])
                    if "json_attributes_template" in c:
                        assert isinstance(json.loads(render(c["json_attributes_template"], value_json)), dict)
            elif "state_topic" in c:
                assert c["state_topic"] in availability_topics and c["p"] == "binary_sensor"
            if c["p"] == "button":
                cmd = hastate.parse_command(hastate.GatewayCommand, c["payload_press"].encode(), "t")
                assert c["command_topic"] == "xronos/gateway/set"
                assert cmd.action == ("remove_node" if key == "remove" else key)
            if c["p"] == "select":
                for option in c["options"]:
                    sent = JINJA.from_string(c["command_template"]).render(value=option)
                    cmd = hastate.parse_command(hastate.GatewayCommand, sent.encode(), "t")
                    if key == "job_spec":
                        assert cmd.action == "select" and cmd.spec == option
                    else:  # the job form's: sets its field
                        assert (cmd.action, cmd.field, cmd.value) == ("set", key.removeprefix("form_"), option)
            if c["p"] == "number":  # Home Assistant renders an integral value as an int
                for value in (c["min"], c["max"]):
                    value = int(value) if float(value).is_integer() else value
                    sent = JINJA.from_string(c["command_template"]).render(value=value)
                    cmd = hastate.parse_command(hastate.GatewayCommand, sent.encode(), "t")
                    assert (cmd.action, cmd.field, cmd.value) == ("set", key.removeprefix("form_"), value)
            if c["p"] == "switch":
                assert c["command_topic"] == c["state_topic"].replace("/state", "/set")
                for payload, want in ((c["payload_on"], True), (c["payload_off"], False)):
                    assert hastate.parse_command(hastate.NodeCommand, payload.encode(), "t").participate is want


def test_entities_present():
    (_, gw), (_, pi5), (_, n100) = all_configs()
    form = {"form_owner", "form_model", "form_data", "form_task", "form_data_format", "form_gguf", "form_steps",
            "form_epochs", "form_lora_r", "form_batch_size", "form_seq_len", "form_lr", "start_form", "refresh"}
    assert set(gw["cmps"]) == {"job_phase", "job_name", "progress", "loss", "eval_metric",
                               "iteration_time", "eta", "slowest_node", "idle_ratio",
                               "nodes_online", "last_command", "pause", "resume", "cancel",
                               "steps", "finish_time", "error", "task", "data_format", "lora_rank", "replans",
                               "last_replan", "strategy", "metric_before", "export", "start", "job_spec"} | form
    assert gw["cmps"]["finish_time"]["device_class"] == "timestamp"
    assert gw["cmps"]["form_model"]["options"] == ["/srv/xronos/models/qwen"]
    assert gw["cmps"]["form_data"]["options"] == ["/srv/xronos/data/chat.jsonl"]
    assert gw["cmps"]["form_gguf"]["options"] == ["none", "f32", "f16", "q8_0"]
    diagnostic = {k for k, c in gw["cmps"].items() if c.get("entity_category") == "diagnostic"}
    assert diagnostic == {"iteration_time", "slowest_node", "idle_ratio", "nodes_online", "last_command", "replans",
                          "last_replan", "strategy"}
    assert gw["cmps"]["job_phase"]["default_entity_id"] == "sensor.xronos_gw1_job_phase"
    assert gw["cmps"]["start_form"]["default_entity_id"] == "button.xronos_gw1_start_form"
    (_, bare), *_ = ha.discovery_messages(CTX, [], ())  # no specs, no catalogs: no empty selects
    bare = json.loads(bare)
    assert "job_spec" not in bare["cmps"] and "start" not in bare["cmps"]
    assert not {"form_owner", "form_model", "form_data"} & set(bare["cmps"]) and "start_form" in bare["cmps"]
    node_keys = {"online", "attn_units", "attn_share", "mlp_share", "vocab_share", "compute_share", "idle_share", "participate", "remove"}
    assert set(pi5["cmps"]) == node_keys | {"cpu_temperature"}  # the Pi reports a temperature
    assert set(n100["cmps"]) == node_keys  # this one does not
    assert pi5["dev"]["via_device"] == gw["dev"]["identifiers"][0]


def test_gateway_state_from_job():
    s = ha.gateway_state(job(), nodes_online=2, now=11.0)
    assert s.progress_pct == 25.0 and s.slowest_node == "pi5" and s.idle_ratio_pct == pytest.approx(20.0)
    assert s.phase == "running" and s.eval_metric_name == "accuracy"
    diverged = ha.gateway_state(job(loss=float("nan"), total_steps=None), nodes_online=2, now=1.0)
    assert diverged.loss is None and diverged.progress_pct is None
    assert "NaN" not in diverged.model_dump_json()  # HA's JSON parser would reject it
    assert ha.gateway_state(None, nodes_online=0, now=1.0).phase == "idle"
    # Step x / y, and the finish time (to the minute, so it does not change with every step).
    s = ha.gateway_state(job(), nodes_online=2, now=0.0)
    assert s.steps == "30 / 120" and s.finish_at == "1970-01-01T00:03:00+00:00"
    assert ha.gateway_state(job(phase="paused"), nodes_online=2, now=0.0).finish_at is None
    long = ha.gateway_state(job(phase="failed", error="x" * 1000), nodes_online=2, now=0.0)
    assert long.error.startswith("xxx") and len(long.error) == 255  # HA's state length limit
    refused = ha.gateway_state(job(), nodes_online=2, now=0.0, error="owner node 'a' is offline")
    assert refused.error == "owner node 'a' is offline"


def test_gateway_state_says_how_the_job_trains():
    """Task and Data format come from the job's spec (JobState does not carry them), and are
    unknown (null, rendered "None") without one."""
    (_, gw), *_ = all_configs()
    for key, field in (("task", "task"), ("data_format", "data_format")):
        c = gw["cmps"][key]
        assert c["p"] == "sensor" and c["value_template"] == f"{{{{ value_json.{field} }}}}", c
        assert c["state_topic"] == CTX.topic(hastate.GATEWAY_STATE)
    cases = [(spec(), "causal-lm", "chat"), (spec(data_format="prompt-completion"), "causal-lm", "prompt-completion"),
             (spec(task="classify", data_format="text"), "classify", "text")]
    for sp, task, fmt in cases:
        value_json = json.loads(ha.gateway_state(job(), nodes_online=1, now=0.0, spec=sp).model_dump_json())
        assert (value_json["task"], value_json["data_format"]) == (task, fmt)
        assert render(gw["cmps"]["task"]["value_template"], value_json) == task
        assert render(gw["cmps"]["data_format"]["value_template"], value_json) == fmt
    for unknown in (ha.gateway_state(None, nodes_online=0, now=0.0), ha.gateway_state(job(), nodes_online=1, now=0.0)):
        value_json = json.loads(unknown.model_dump_json())
        assert value_json["task"] is None and value_json["data_format"] is None  # present, null
        assert render(gw["cmps"]["data_format"]["value_template"], value_json) == "None"
    # LoRA rank and its targets (an attribute); unknown for full fine-tuning and without a spec.
    c = gw["cmps"]["lora_rank"]
    assert c["name"] == "LoRA rank" and c["value_template"] == "{{ value_json.lora_r }}"
    assert c["json_attributes_topic"] == CTX.topic(hastate.GATEWAY_STATE)
    lora_cases = [(spec(lora_r=8, lora_targets=["q_proj", "v_proj"]), 8, "q_proj,v_proj"),
                  (spec(lora_r=4), 4, "default"), (spec(), None, None), (None, None, None)]
    for sp, r, targets in lora_cases:
        value_json = json.loads(ha.gateway_state(job(), nodes_online=1, now=0.0, spec=sp).model_dump_json())
        assert (value_json["lora_r"], value_json["lora_targets"]) == (r, targets)
        assert render(c["value_template"], value_json) == str(r)
        assert json.loads(render(c["json_attributes_template"], value_json)) == {"targets": targets}
    with pytest.raises(ValueError, match="lora_r"):
        hastate.GatewayHAState(lora_r=0, updated_at=0.0)
    # A new format in a spec would be a state Home Assistant cannot be sent: refused here first.
    with pytest.raises(ValueError, match="data_format"):
        hastate.GatewayHAState(data_format="alpaca", updated_at=0.0)


def test_gateway_state_shows_live_re_plans():
    """Re-plans and Last re-plan come from the JobState; unknown (null) without a job."""
    (_, gw), *_ = all_configs()
    assert gw["cmps"]["replans"]["name"] == "Re-plans" and gw["cmps"]["replans"]["state_class"] == "total_increasing"
    assert gw["cmps"]["last_replan"]["name"] == "Last re-plan"
    reason = "predicted 0.5 -> 0.3 s per iteration (40.0% faster), move 0.1 s repaid in 0.5 iterations " + "x" * 300
    value_json = json.loads(ha.gateway_state(job(replans=2, last_replan_reason=reason[:256]), nodes_online=1,
                                             now=0.0).model_dump_json())
    assert value_json["replans"] == 2 and value_json["last_replan"] == reason[:254] + "…"  # HA: 255 characters
    assert render(gw["cmps"]["replans"]["value_template"], value_json) == "2"
    assert render(gw["cmps"]["last_replan"]["value_template"], value_json).startswith("predicted 0.5")
    idle = json.loads(ha.gateway_state(None, nodes_online=0, now=0.0).model_dump_json())
    assert idle["replans"] is None and idle["last_replan"] is None
    assert json.loads(ha.gateway_state(job(), nodes_online=1, now=0.0).model_dump_json())["replans"] == 0


def test_gateway_state_names_the_parallelism_chosen():
    """The Parallelism sensor: the running plan's strategy (data parallelism with its groups), the
    job's asked-for strategy as the attribute; unknown without a plan."""
    from xronos.protocol.messages import Overlap, Plan, PlanEntry
    (_, gw), *_ = all_configs()
    c = gw["cmps"]["strategy"]
    assert c["name"] == "Parallelism" and c["entity_category"] == "diagnostic"
    sizes = {"attn": 4, "mlp": 64, "vocab": 100}

    def plan(shares, counts, overlap=None):
        entries = [PlanEntry(node_id=f"n{r}", rank=r, attn=a, mlp=m, vocab=v, predicted_compute_s=0.1,
                             predicted_memory=1.0, memory_cap=2.0) for r, (a, m, v) in enumerate(counts)]
        return Plan(job_id="j1", version=1, strategy="dp" if shares else "segment", sizes=sizes, entries=entries,
                    predicted_iteration_s=1.0, ideal_iteration_s=1.0, comm_s=0.0, shares=shares, overlap=overlap)

    whole, half = (4, 64, 100), (2, 32, 50)
    for p, text in ((plan(None, [half, half]), "segment"), (plan([3, 1], [whole, whole]), "dp (2 replicas)"),
                    (plan([2, 2], [half, half, half, half]), "dp (2 groups of TP 2)"),
                    (plan(None, [half, half], Overlap(backward=True, chunks=2)), "segment, overlap 2 chunks"),
                    (plan(None, [half, half], Overlap(backward=True)), "segment, overlap backward")):
        value_json = json.loads(ha.gateway_state(job(plan=p), nodes_online=2, now=0.0, spec=spec()).model_dump_json())
        assert render(c["value_template"], value_json) == text
        assert json.loads(render(c["json_attributes_template"], value_json)) == {"asked": "auto"}
    assert json.loads(ha.gateway_state(job(), nodes_online=1, now=0.0).model_dump_json())["strategy"] is None
    # after an overlap trial: the mode it kept, which the ranks run, not the plan's first
    tried = plan(None, [half, half], Overlap(backward=True, chunks=2))
    for kept, text in (("bwd", "segment, overlap backward (measured fastest)"),
                       ("off", "segment, no overlap (measured fastest)"),
                       ("c4", "segment, overlap 4 chunks (measured fastest)")):
        state = job(plan=tried).model_copy(update={"overlap_kept": kept})
        value_json = json.loads(ha.gateway_state(state, nodes_online=2, now=0.0, spec=spec()).model_dump_json())
        assert render(c["value_template"], value_json) == text


def test_commands_parse_and_refuse():
    assert hastate.parse_command(hastate.GatewayCommand, b'{"action":"cancel"}', "x").action == "cancel"
    for bad in (b'{"action":"explode"}', b'{"action":"pause","job":"j"}', b"pause", b"{}"):
        with pytest.raises(ValueError, match="xronos/gateway/set: bad GatewayCommand payload"):
            hastate.parse_command(hastate.GatewayCommand, bad, "xronos/gateway/set")
    with pytest.raises(ValueError, match="participate"):
        hastate.parse_command(hastate.NodeCommand, b'{"participate":"no"}', "xronos/node/a/set")
    assert hastate.iteration_shares(1.5, 0.5, 2.0) == (75.0, 25.0)
    assert hastate.iteration_shares(1.0, 0.0, 0.0) == (0.0, 0.0)


def test_ha_birth_and_removal():
    assert ha.is_ha_online(CTX, "homeassistant/status", b"online")
    assert not ha.is_ha_online(CTX, "homeassistant/status", b"offline")
    assert not ha.is_ha_online(CTX, "other/status", b"online")
    assert ha.node_removal(CTX, "pi5") == ("homeassistant/device/xronos_gw1_node_pi5/config", b"")


def test_home_assistant_presses_pause_on_a_real_broker(mqtt_broker):
    """Gateway side (MqttBus) publishes retained discovery; a client behaving like Home Assistant
    connects afterwards, finds the Pause button in the discovery it receives, presses it; the
    gateway side receives a command it can parse. HA's birth message asks for discovery again."""
    bus = MqttBus(BrokerSettings(host=mqtt_broker.host, port=mqtt_broker.port), "ha-test-gw")
    bus.start()
    assert bus.wait_connected(10)
    bus.subscribe(CTX.topic(hastate.GATEWAY_SET))
    bus.subscribe(CTX.status_topic)
    for topic, payload in ha.discovery_messages(CTX, [caps("pi5", 50.0)]):
        bus.publish(topic, payload, retain=True)
    bus._last_info.wait_for_publish(10)  # stored by the broker (PUBACK) before HA subscribes
    home = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="ha-test-home")
    inbox: queue.Queue[tuple[str, bytes, bool]] = queue.Queue()
    home.on_message = lambda c, u, m: inbox.put((m.topic, m.payload, m.retain))
    try:
        home.connect(mqtt_broker.host, mqtt_broker.port)
        home.loop_start()
        home.subscribe("homeassistant/device/+/config", qos=1)
        # The session's broker may hold other tests' retained discovery too: wait for ours.
        ours = {t for t, _ in ha.discovery_messages(CTX, [caps("pi5", 50.0)])}
        seen = {}
        while not ours <= set(seen):
            topic, payload, retained = inbox.get(timeout=10)
            assert retained  # HA gets discovery on subscribe because it is retained
            seen[topic] = json.loads(payload)
        pause = seen["homeassistant/device/xronos_gw1/config"]["cmps"]["pause"]
        home.publish(pause["command_topic"], pause["payload_press"], qos=1).wait_for_publish(10)
        home.publish("homeassistant/status", b"online", qos=1).wait_for_publish(10)
        got = [bus.get(timeout=10) for _ in range(2)]
        topic, payload = got[0]
        assert topic == "xronos/gateway/set"
        assert hastate.parse_command(hastate.GatewayCommand, payload, topic).action == "pause"
        assert ha.is_ha_online(CTX, *got[1])
    finally:
        home.loop_stop()
        home.disconnect()
        for topic, _ in ha.discovery_messages(CTX, [caps("pi5", 50.0)]):
            bus.publish(topic, b"", retain=True)  # leave the shared session broker clean
        bus.stop()
