"""Gloo's threads' CPU while asynchronous all-reduces fly is split among the calls in flight
(`flight._Ledger`): with two in flight neither is charged the other's work, and the charges add up
to what the threads took."""

from __future__ import annotations

import pytest

from xronos.node.tp import flight


class _Call:
    def __init__(self) -> None:
        self.others, self.done = 0.0, False

    def completed(self) -> bool:
        return self.done


@pytest.fixture
def ledger(monkeypatch):
    cpu = [0.0]
    monkeypatch.setattr(flight._Ledger, "_others", staticmethod(lambda: cpu[0]))
    return flight._Ledger(), cpu


def test_two_calls_in_flight_share_the_threads_cpu_and_one_alone_takes_all(ledger):
    led, cpu = ledger
    a, b = _Call(), _Call()
    led.live.append(a)
    cpu[0] += 0.004  # a alone
    led.advance()
    led.live.append(b)
    cpu[0] += 0.006  # both flying
    led.advance()
    led.live.remove(a)
    cpu[0] += 0.002  # b alone
    led.advance()
    assert a.others == pytest.approx(0.004 + 0.003) and b.others == pytest.approx(0.003 + 0.002)
    assert a.others + b.others == pytest.approx(0.012)


def test_a_call_gloo_has_completed_pays_nothing_while_another_still_runs(ledger):
    led, cpu = ledger
    a, b = _Call(), _Call()
    led.live += [a, b]
    a.done = True
    cpu[0] += 0.005
    led.advance()
    assert (a.others, b.others) == (0.0, pytest.approx(0.005))
    b.done = True  # both completed, still waited for: they share what is left
    cpu[0] += 0.002
    led.advance()
    assert (a.others, b.others) == (pytest.approx(0.001), pytest.approx(0.006))


def test_cpu_while_nothing_flies_is_nobodys(ledger):
    led, cpu = ledger
    cpu[0] += 0.01  # a blocking collective's threads: charged by that call itself
    led.advance()
    a = _Call()
    led.live.append(a)
    cpu[0] += 0.001
    led.advance()
    assert a.others == pytest.approx(0.001)
