"""OwnAvailability's one `offline` that is nobody's mistake: the will a broker publishes of every
client as it shuts down, ours included, handled once our connection is gone (FakeBus; the real
broker's restart: tests/services/test_e2e_broker_restart.py)."""

from __future__ import annotations

import pytest
import structlog
from structlog.testing import capture_logs

from xronos.protocol.dispatch import Dispatcher
from fakebus import FakeBroker
from xronos.protocol.ownavail import OwnAvailability


@pytest.fixture(autouse=True)
def every_level():
    """An earlier test may have configured a level filter (logsetup): the info line must pass here."""
    saved = structlog.get_config()
    structlog.reset_defaults()
    yield
    structlog.configure(**saved)


def _running() -> tuple[FakeBroker, object, OwnAvailability, Dispatcher]:
    broker = FakeBroker()
    bus = broker.bus("svc")
    own = OwnAvailability(bus, "gateway.availability", event="gateway.availability_offline_while_running",
                          hint="another gateway")
    d = Dispatcher(bus)
    own.register(d)
    bus.on_connect(own.announce)
    bus.start()
    while d.run_once(0):
        pass
    assert own.confirmed
    return broker, bus, own, d


def test_our_will_published_as_the_broker_goes_away_is_no_error():
    broker, bus, own, d = _running()
    other = broker.bus("other")
    other.start()
    other.publish(own.topic, b"offline", retain=True)  # queued for us; then our connection closes
    bus.connected = False
    with capture_logs() as logs:
        while d.run_once(0):
            pass
    assert [e["event"] for e in logs] == ["availability.own_will_on_broker_shutdown"]
    assert own.reasserted == 0
    bus.reconnect()  # the broker is back: the announce says online
    assert broker.retained[own.topic] == b"online"


def test_an_offline_while_we_are_connected_is_still_answered_as_an_error():
    broker, bus, own, d = _running()
    other = broker.bus("other")
    other.start()
    other.publish(own.topic, b"offline", retain=True)
    with capture_logs() as logs:
        while d.run_once(0):
            pass
    assert [e["log_level"] for e in logs if e["event"] == "gateway.availability_offline_while_running"] == ["error"]
    assert own.reasserted == 1 and broker.retained[own.topic] == b"online"
