"""Home Assistant makes a job, on a real Mosquitto with the real gateway and node services (their own
processes): a client that plays Home Assistant's part reads the retained discovery, picks the
owner's model directory and data file in the selects it finds there, sets the numbers through their
command templates, and presses Start training; the job is submitted, trains, and the gateway's
state shows its export and the metric before and after. A model directory the owner cannot load is
refused by its inspection, and Last command says so where it said "submitted". Forged values (a
path the owner did not report, numbers out of range) are refused with the reason, and nothing is
submitted."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import jinja2
import pytest
import paho.mqtt.client as mqtt

from jobkit import runkit

JINJA = jinja2.Environment(undefined=jinja2.StrictUndefined)
pytestmark = pytest.mark.slow  # a training process (profile and two steps)


class HomeAssistant:
    """What Home Assistant does with MQTT discovery, as far as this test needs: it keeps the
    retained discovery and state, renders the command templates and publishes them (never retained)."""

    def __init__(self, host: str, port: int, prefix: str, base: str) -> None:
        self.prefix, self.base = prefix, base
        self.retained: dict[str, bytes] = {}
        self.changed = threading.Condition()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"ha-{prefix}")
        self.client.on_message = self._on_message
        self.client.connect(host, port)
        self.client.loop_start()
        for topic in (f"{prefix}/device/+/config", f"{base}/gateway/state"):
            self.client.subscribe(topic, qos=1)

    def _on_message(self, _c: Any, _u: Any, msg: Any) -> None:
        with self.changed:
            self.retained[msg.topic] = msg.payload
            self.changed.notify_all()

    def wait(self, what: Callable[[], Any], timeout: float = 120.0, why: str = "") -> Any:
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                try:
                    got = what()
                except (KeyError, ValueError):
                    got = None
                if got:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{why}: state {self.state() if self.has_state() else None}")
                self.changed.wait(min(left, 1.0))

    def has_state(self) -> bool:
        return f"{self.base}/gateway/state" in self.retained

    def state(self) -> dict:
        return json.loads(self.retained[f"{self.base}/gateway/state"])

    def gateway(self) -> dict:
        return json.loads(self.retained[f"{self.prefix}/device/xronos_gateway/config"])["cmps"]

    def send(self, entity: dict, value: Any = None) -> None:
        """Press a button, or set a select/number to `value`, as Home Assistant does."""
        if entity["p"] == "button":
            payload = entity["payload_press"]
        else:
            payload = JINJA.from_string(entity["command_template"]).render(value=value)
        self.client.publish(entity["command_topic"], payload, qos=1).wait_for_publish(10)

    def command(self, payload: dict) -> None:
        """What an automation publishes (`mqtt.publish`), not an entity's template."""
        self.client.publish(f"{self.base}/gateway/set", json.dumps(payload), qos=1).wait_for_publish(10)

    def after(self, act: Callable[[], None], last_command: Callable[[str], bool], why: str) -> dict:
        """Do `act`, then wait for a gateway state whose last_command satisfies the test."""
        before = self.state().get("updated_at") if self.has_state() else None
        act()
        return self.wait(lambda: self.state() if last_command(self.state()["last_command"] or "") and
                         self.state()["updated_at"] != before else None, why=why)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def _jobs(stack) -> list[dict]:
    return stack.client.request("job/status", 30.0)["jobs"]


def test_home_assistant_picks_files_sets_numbers_and_starts_a_job(stack, tmp_path, mqtt_broker):
    owner = stack.allowed  # the node's allowed directory
    model = runkit.make_model(owner / "models" / "tiny-gpt2", "gpt2", "causal-lm")
    broken = owner / "models" / "broken"  # a config.json and weights the owner cannot load
    broken.mkdir(parents=True)
    (broken / "config.json").write_text('{"model_type": "gpt2"}')
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    (owner / "data").mkdir()
    data = runkit.write_rows(owner / "data" / "notes.jsonl", [{"text": t} for t in runkit.texts(40)])
    outside = tmp_path / "elsewhere.jsonl"  # exists, readable, not in the owner's allowed directories
    runkit.write_rows(outside, [{"text": t} for t in runkit.texts(40)])
    prefix = f"ha{stack.base}"
    stack.gateway(homeassistant=f'{{ discovery_prefix = "{prefix}", job_dir = "{tmp_path / "no-specs"}" }}')
    stack.node("n0")
    stack.wait_nodes(1)
    ha = HomeAssistant(mqtt_broker.host, mqtt_broker.port, prefix, stack.base)
    try:
        # The owner's catalog reached the gateway: its files are the selects' options.
        cmps = ha.wait(lambda: ha.gateway() if "form_data" in ha.gateway() else None, why="no Data file select")
        assert cmps["form_model"]["options"] == [str(broken), str(model)]
        assert cmps["form_data"]["options"] == [str(data)]
        assert cmps["form_owner"]["options"] == ["n0"]
        ha.wait(lambda: ha.state()["form"]["owner"] == "n0", why="the form's owner")
        assert str(outside) not in json.dumps(cmps)

        # Forged select values and numbers out of range: refused with the reason, nothing kept.
        state = ha.after(lambda: ha.send(cmps["form_data"], str(outside)), lambda t: t.startswith("set: error"),
                         "forged data path")
        assert f"data: '{outside}' is not a data file that owner 'n0' reported" in state["last_command"]
        assert state["form"]["data"] is None
        state = ha.after(lambda: ha.send(cmps["form_steps"], 5_000_000), lambda t: t.startswith("set: error"),
                         "steps out of range")
        assert "steps: Input should be less than or equal to 1000000" in state["last_command"]
        assert state["form"]["steps"] == 100
        # An automation's one-message start with a forged path or a bad number: refused, not submitted.
        for form, why in (({"model": str(model), "data": str(outside)}, f"data: '{outside}' is not a data file"),
                          ({"model": "/etc", "data": str(data)}, "model: '/etc' is not a model directory"),
                          ({"model": str(model), "data": str(data), "lora_r": -1},
                           "lora_r: Input should be greater than or equal to 0")):
            state = ha.after(lambda: ha.command({"action": "start_form", "form": form}),
                             lambda t, w=why: t.startswith("start_form: refused") and w in t, why)
            assert why in state["last_command"], state
        assert _jobs(stack) == []

        # A model the owner cannot load: submitted, then refused by its inspection, in Last command.
        for entity, value in ((cmps["form_model"], str(broken)), (cmps["form_data"], str(data)),
                              (cmps["form_steps"], 2), (cmps["form_lora_r"], 0), (cmps["form_seq_len"], 16)):
            field = entity["unique_id"].rsplit("_form_", 1)[1]
            state = ha.after(lambda: ha.send(entity, value), lambda t, f=field: t.startswith(f"set: {f} = "), field)
            assert state["form"][field] == value
        state = ha.after(lambda: ha.send(cmps["start_form"]), lambda t: t.startswith("start_form: refused broken-"),
                         "broken model")
        assert state["last_command"].startswith("start_form: refused broken-notes (broken-notes-"), state
        assert "owner 'n0' cannot run it" in state["last_command"]

        # The real one: submitted, accepted, trained; the state carries the export and both metrics.
        ha.after(lambda: ha.send(cmps["form_model"], str(model)), lambda t: t.startswith("set: model = "), "model")
        state = ha.after(lambda: ha.send(cmps["start_form"]), lambda t: "tiny-gpt2-notes" in t, "start")
        assert state["last_command"].startswith("start_form: submitted tiny-gpt2-notes as tiny-gpt2-notes-"), state
        job_id = state["last_command"].rsplit(" ", 1)[1]
        done = ha.wait(lambda: ha.state() if ha.state()["phase"] in ("completed", "failed") else None,
                       timeout=300, why="the job did not end")
        assert done["phase"] == "completed", (done, stack.logs())
        assert done["job_id"] == job_id and done["lora_r"] is None and done["task"] == "causal-lm"
        assert done["export_dir"].startswith(f"{owner}/exports/tiny-gpt2-notes-")
        assert done["eval_metric"] is not None and done["eval_initial"] is not None
        assert (owner / done["export_dir"].removeprefix(f"{owner}/") / "config.json").is_file()
        (listed,) = _jobs(stack)
        assert listed["job_id"] == job_id and listed["phase"] == "completed"
    finally:
        for topic in (f"{prefix}/device/xronos_gateway/config", f"{prefix}/device/xronos_gateway_node_n0/config"):
            ha.client.publish(topic, b"", qos=1, retain=True).wait_for_publish(10)  # the session's broker
        ha.close()
