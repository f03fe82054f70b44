"""The bad-input log throttle: per key, at most `limit` lines a window; drops are reported."""

import pytest
from structlog.testing import capture_logs

from xronos.protocol.dispatch import Dispatcher
from fakebus import FakeBroker
from xronos.common.throttle import LogThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_limit_per_key_and_window_then_the_drops_are_counted():
    clock = Clock()
    t = LogThrottle(limit=3, window_s=10.0, clock=clock)
    assert [t.admit("a") for _ in range(5)] == [0, 0, 0, None, None]
    assert t.admit("b") == 0  # another key has its own share
    clock.now += 9.9
    assert t.admit("a") is None
    clock.now += 0.1  # a new window: admitted, naming the 3 left out
    assert t.admit("a") == 3
    assert t.admit("a") == 0


def test_keys_from_the_network_stay_bounded():
    clock = Clock()
    t = LogThrottle(limit=1, window_s=10.0, clock=clock, max_keys=4)
    assert [t.admit(f"node{i}") for i in range(6)] == [0, 0, 0, 0, 0, None]  # 5 and 6 share one key
    assert len(t._state) == 5 and LogThrottle.OTHER in t._state
    clock.now += 10.0  # expired windows without drops make room again
    assert t.admit("node9") == 0 and "node9" in t._state


@pytest.mark.parametrize("limit, window, keys", [(0, 1.0, 1), (1, 0.0, 1), (1, float("nan"), 1), (1, 1.0, 0)])
def test_bad_settings_are_refused(limit, window, keys):
    with pytest.raises(ValueError, match="limit >= 1, window_s > 0 and max_keys >= 1"):
        LogThrottle(limit, window, max_keys=keys)


def test_a_flood_is_counted_and_answered_but_logged_in_bounds():
    broker = FakeBroker()
    service, sender = broker.bus("node"), broker.bus("sender")
    service.start()
    sender.start()
    sender.subscribe("xronos/node/n1/error")
    clock = Clock()
    disp = Dispatcher(service, node_id="n1")
    disp.throttle = LogThrottle(limit=20, window_s=60.0, clock=clock)
    disp.on("node.control", lambda msg, params: None, node_id="n1")
    with capture_logs() as logs:
        for _ in range(100):
            sender.publish("xronos/node/n1/control", b"garbage")
        while disp.run_once(0):
            pass
        clock.now += 60.0
        sender.publish("xronos/node/n1/control", b"garbage")
        disp.run_once(0)
    lines = [e for e in logs if e["event"] == "dispatch.bad_input"]
    assert disp.errors["bad_encoding"] == 101
    assert len(sender.drain()) == 101  # every one answered on the node's error topic
    assert len(lines) == 21 and "suppressed_before" not in lines[19]
    assert lines[20]["suppressed_before"] == 80 and lines[20]["reason"] == "bad_encoding"


def test_the_services_own_echoes_share_the_throttle():
    """The gateway logs every error a node answers a bad payload with, through the same throttle."""
    broker = FakeBroker()
    disp = Dispatcher(broker.bus("gateway"))
    clock = Clock()
    disp.throttle = LogThrottle(limit=2, window_s=60.0, clock=clock)
    with capture_logs() as logs:
        for node in ("n1", "n1", "n1", "n2"):
            disp.warn_throttled("node reported an error", ("node.error", node, "bad_encoding"), node=node)
        clock.now += 60.0
        disp.warn_throttled("node reported an error", ("node.error", "n1", "bad_encoding"), node="n1")
    assert [(e["node"], e.get("suppressed_before")) for e in logs] == [
        ("n1", None), ("n1", None), ("n2", None), ("n1", 1)]
