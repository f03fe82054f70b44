"""The Home Assistant docs (docs/home-assistant.md, and what the README and the other pages say of
it): the automations send commands the gateway accepts, every entity and command named is one the
gateway makes or accepts, and the job spec copied into job_dir is valid."""

from __future__ import annotations

import json
import re

import yaml

import doctext

from xronos.gateway.homeassistant import discovery as ha
from xronos.gateway.homeassistant.bridge import list_specs
from xronos.protocol import hastate
from xronos.protocol.codec import decode
from xronos.protocol.messages import Capabilities, NodeCatalog
from xronos.protocol.specfile import load_spec
from xronos.protocol.topics import TopicTable

REPO = doctext.REPO
CATALOGS = {"pi5": NodeCatalog(node_id="pi5", allowed_dirs=["/srv/xronos"], models=["/srv/xronos/models/m"],
                               data=["/srv/xronos/data/d.jsonl"], scanned_at=1.0)}
CATALOG_FORM = hastate.JobForm(owner="pi5")
SECTION = (doctext.DOCS / "home-assistant.md").read_text()
NODE = Capabilities(node_id="pi5", hostname="pi5", arch="aarch64", cpu_model="Cortex-A76", cores=4,
                    memory_total=8 << 30, memory_available=6 << 30, torch_version="2.13.0",
                    data_host="10.0.0.5", cpu_temp_c=50.0, sent_at=1.0)


def _entity_ids(ctx: ha.HAContext, specs=("reviews",)) -> set[str]:
    """The entity ids Home Assistant gives the gateway's entities (their default_entity_id)."""
    _, gw = ha.gateway_discovery(ctx, specs, CATALOG_FORM, CATALOGS)
    return {c["default_entity_id"] for c in gw["cmps"].values()}


def _walk(node):
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def test_the_automations_send_valid_commands_and_name_real_entities():
    blocks = re.findall(r"```yaml\n(.*?)```", SECTION, re.S)
    assert len(blocks) == 3  # two automations and the dashboard card
    docs = [yaml.safe_load(b) for b in blocks]
    publishes = [d["data"] for doc in docs for d in _walk(doc) if d.get("action") == "mqtt.publish"]
    assert {p["topic"] for p in publishes} == {"xronos/gateway/set"}
    table = TopicTable()
    actions = {decode(p["topic"], p["payload"].encode(), table=table).action for p in publishes}
    assert actions == {"pause", "resume"}
    known = _entity_ids(ha.HAContext())
    named = set(re.findall(r"(?:sensor|select|number|button)\.xronos_[a-z0-9_]+", "\n".join(blocks)))
    assert named and named <= known, named - known
    phase = next(t for d in docs for t in _walk(d) if t.get("trigger") == "state" and "to" in t)
    assert set(phase["to"]) <= set(ha.PHASE_OPTIONS)


def test_every_documented_command_is_accepted():
    for payload in re.findall(r"`(\{\"action\": [^`]+\})`", SECTION):
        cmd = hastate.parse_command(hastate.GatewayCommand, payload.encode(), "xronos/gateway/set")
        assert cmd.action in ("pause", "resume", "cancel", "start", "select", "remove_node", "set", "start_form",
                              "refresh")


def test_the_dashboard_card_shows_the_form_and_the_job():
    """The card is Lovelace YAML of real entities: every form entity, Start training, the job's
    metrics before and after and its export."""
    (card,) = [d for d in map(yaml.safe_load, re.findall(r"```yaml\n(.*?)```", SECTION, re.S)) if "type" in d]
    assert card["type"] == "vertical-stack" and all(c["type"] == "entities" for c in card["cards"])
    shown = {e for c in card["cards"] for e in c["entities"]}
    _, gw = ha.gateway_discovery(ha.HAContext(), (), CATALOG_FORM, CATALOGS)
    assert gw["dev"]["name"] == "Xronos gateway"  # as the docs name the device (not "Xronos gateway gateway")
    form = {c["default_entity_id"] for k, c in gw["cmps"].items() if k.startswith("form_")} - {
        "number.xronos_gateway_form_batch_size", "number.xronos_gateway_form_seq_len"}  # defaults do
    assert form <= shown and {"button.xronos_gateway_start_form", "sensor.xronos_gateway_metric_before",
                              "sensor.xronos_gateway_eval_metric", "sensor.xronos_gateway_export"} <= shown
    assert shown <= _entity_ids(ha.HAContext())


def test_the_example_job_spec_goes_into_job_dir(tmp_path):
    assert "sudo cp examples/job.toml /etc/xronos/jobs/reviews.toml" in SECTION
    (tmp_path / "reviews.toml").write_bytes((REPO / "examples/job.toml").read_bytes())
    assert list_specs(tmp_path) == ("reviews",) and load_spec(tmp_path / "reviews.toml").name
    assert json.loads(json.dumps(ha.gateway_discovery(ha.HAContext(), list_specs(tmp_path))[1]))


def test_every_entity_is_listed_and_the_state_example_has_real_fields():
    """Each entity the discovery creates is named in the section (under its device's paragraph),
    and the gateway/state example shows fields GatewayHAState has."""
    node = NODE
    gateway_part = SECTION.split("**Xronos gateway** device", 1)[1].split("**Xronos node", 1)[0]
    node_part = SECTION.split("**Xronos node", 1)[1].split("\n\n", 1)[0]
    gateway_part, node_part = (" ".join(p.split()) for p in (gateway_part, node_part))  # line breaks
    for part, (_, cfg) in ((gateway_part, ha.gateway_discovery(ha.HAContext(), ("reviews",), CATALOG_FORM, CATALOGS)),
                           (node_part, ha.node_discovery(ha.HAContext(), node))):
        names = [c["name"] for c in cfg["cmps"].values()]
        missing = [n for n in names if not re.search(rf"\b{re.escape(n)}\b", part)]
        assert not missing, missing
    example = re.search(r"\| `xronos/gateway/state` \| `(\{.*?\})` \|", SECTION).group(1)
    fields, known = set(re.findall(r'"([a-z_]+)":', example)), set(hastate.GatewayHAState.model_fields)
    assert fields and fields <= known, fields - known


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _alternatives(span: str) -> list[str]:
    """`{"action": "pause"|"resume"}` as the commands it stands for."""
    m = re.search(r'"[^"]*"(?:\|"[^"]*")+', span)
    if not m:
        return [span]
    return [span[:m.start()] + alt + span[m.end():] for alt in m.group().split("|")]


def test_every_command_the_docs_name_is_accepted():
    """A command for the gateway or a node shown anywhere in the docs (the README's first job too)."""
    seen = 0
    for path in doctext.FILES:
        for span in doctext.spans(doctext.text(path)):
            if path.name == "interfaces.md" and not all(_is_json(s) for s in _alternatives(span)):
                continue  # the contracts' notation (`"spec"?: name`), not a command to send
            if span.startswith('{"action": '):
                for one in _alternatives(span):
                    hastate.parse_command(hastate.GatewayCommand, one.encode(), "xronos/gateway/set")
                seen += 1
            elif span.startswith('{"participate": ') and span.endswith(", ...}"):  # a node's state, elided
                fields = set(re.findall(r'"([a-z_]+)":', span))
                assert fields <= set(hastate.NodeHAState.model_fields), fields - set(hastate.NodeHAState.model_fields)
                seen += 1
            elif span.startswith('{"participate": '):
                hastate.parse_command(hastate.NodeCommand, span.encode(), "xronos/node/pi5/set")
                seen += 1
    assert seen >= 10


def test_every_entity_id_the_docs_name_exists():
    _, gw = ha.gateway_discovery(ha.HAContext(), ("reviews",), CATALOG_FORM, CATALOGS)
    _, node = ha.node_discovery(ha.HAContext(), NODE)
    known = {c["default_entity_id"] for cfg in (gw, node) for c in cfg["cmps"].values()}
    named = {(doctext.name(p), e) for p in doctext.FILES
             for e in re.findall(r"\b(?:sensor|select|number|button|switch|binary_sensor)\.xronos_[a-z0-9_]+",
                                 doctext.text(p))}
    assert len(named) > 20 and {n for n in named if n[1] not in known} == set()


def test_the_readme_names_real_entities():
    """The README's first job from Home Assistant names the entities in bold, as the devices show them."""
    part = doctext.text(doctext.README).split("\n## A first job from Home Assistant\n", 1)[1].split("\n## ", 1)[0]
    _, gw = ha.gateway_discovery(ha.HAContext(), ("reviews",), CATALOG_FORM, CATALOGS)
    _, node = ha.node_discovery(ha.HAContext(), NODE)
    names = {c["name"] for cfg in (gw, node) for c in cfg["cmps"].values()}
    bold = set(re.findall(r"\*\*([^*]+)\*\*", " ".join(part.split()))) - {"Xronos gateway", "Xronos node"}
    assert len(bold) > 10 and bold - names == set()
