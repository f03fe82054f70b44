"""Free ports are taken outside the kernel's ephemeral range, where no outgoing connection can take
them between the probe and the bind (a CI failure: a rendezvous range starting at such a port)."""

from __future__ import annotations

import socket

from xronos.common import ports
from xronos.common.ports import ephemeral_range, free_port


def test_free_ports_are_outside_the_ephemeral_range_bindable_and_distinct():
    lo, hi = ephemeral_range()
    got = [free_port() for _ in range(50)]
    assert len(set(got)) == len(got)
    assert all(not lo <= p <= hi and 1024 < p < 65536 for p in got), (got, lo, hi)
    for p in got[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_block_is_consecutive_free_and_does_not_overlap_what_was_given():
    lo, hi = ephemeral_range()
    a, b = free_port(n=21), free_port(n=21)
    assert not set(range(a, a + 21)) & set(range(b, b + 21))
    assert all(not lo <= p <= hi for p in (*range(a, a + 21), *range(b, b + 21)))


def test_a_block_with_a_listener_in_it_is_skipped(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        # the first candidate is a block that holds the taken port
        real = ports._candidates
        monkeypatch.setattr(ports, "_candidates", lambda n: [taken - 1, *real(n)])
        got = free_port(n=2)
        assert got != taken - 1 and taken not in (got, got + 1)
