"""The bad-input log throttle: per key, at most `limit` lines a window; drops are reported."""

import pytest
from structlog.testing import capture_logs

from xronos.protocol.dispatch import Dispatcher
from xronos.protocol.fakebus import FakeBroker
from xronos.protocol.throttle import LogThrottle


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


@pytest.mark.parametrize("limit, window", [(0, 1.0), (1, 0.0), (1, float("nan"))])
def test_bad_settings_are_refused(limit, window):
    with pytest.raises(ValueError, match="limit >= 1 and window_s > 0"):
        LogThrottle(limit, window)


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
