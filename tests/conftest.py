"""Shared fixtures. `mqtt_broker` (session) and `fresh_mqtt_broker` (per test, for tests that stop
or restart it) are real brokers on free loopback ports: Mosquitto, or amqtt where it is missing."""

from __future__ import annotations

import warnings

import pytest

from brokers import FALLBACK_NOTES, RunningBroker, start_broker


def _start(tmp_dir) -> RunningBroker:
    broker = start_broker(tmp_dir)
    if broker.kind != "mosquitto":
        warnings.warn(FALLBACK_NOTES[-1], UserWarning, stacklevel=2)
    return broker


@pytest.fixture(scope="session")
def mqtt_broker(tmp_path_factory):
    with _start(tmp_path_factory.mktemp("mqtt-broker")) as broker:
        yield broker


@pytest.fixture
def fresh_mqtt_broker(tmp_path):
    with _start(tmp_path / "broker") as broker:
        yield broker


def pytest_terminal_summary(terminalreporter):
    for note in FALLBACK_NOTES:
        terminalreporter.write_sep("!", "MQTT BROKER FALLBACK", yellow=True, bold=True)
        terminalreporter.write_line(note, yellow=True, bold=True)
