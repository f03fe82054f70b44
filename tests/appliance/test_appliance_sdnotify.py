"""The systemd notify protocol against real AF_UNIX datagram sockets (path and abstract)."""

from __future__ import annotations

import os
import socket

import pytest

from xronos.common import sdnotify


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request, tmp_path, monkeypatch):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        name = str(tmp_path / "notify")
        sock.bind(name)
    else:
        name = f"@xronos-test-{os.getpid()}-{id(sock)}"
        sock.bind(b"\0" + name[1:].encode())
    sock.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", name)
    yield sock
    sock.close()


def test_ready_status_stopping(notify_socket):
    assert sdnotify.ready("connected to broker")
    assert notify_socket.recv(4096) == b"READY=1\nSTATUS=connected to broker"
    assert sdnotify.status("training\njob j1")  # one line: a newline would smuggle an assignment
    assert notify_socket.recv(4096) == b"STATUS=training job j1"
    assert sdnotify.stopping()
    assert notify_socket.recv(4096) == b"STOPPING=1"


def test_no_socket_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.ready() is False
    with pytest.raises(ValueError, match="NOTIFY_SOCKET='relative'"):
        sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": "relative"})


def test_dead_socket_does_not_raise(tmp_path):
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": str(tmp_path / "gone")}) is False


def test_watchdog_pings_at_half_the_interval(notify_socket, monkeypatch):
    now = [100.0]
    monkeypatch.setenv("WATCHDOG_USEC", "60000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    wd = sdnotify.Watchdog.from_env(clock=lambda: now[0])
    assert wd.enabled and wd.interval_s == 60.0 and wd.ping_every_s == 30.0
    sent = []
    for t in (100.0, 110.0, 129.9, 130.0, 131.0, 160.5):
        now[0] = t
        sent.append(wd.maybe_ping())
    assert sent == [True, False, False, True, False, True]
    assert [notify_socket.recv(64) for _ in range(3)] == [b"WATCHDOG=1"] * 3


def test_watchdog_disabled_cases():
    assert not sdnotify.Watchdog.from_env(env={}).enabled
    assert sdnotify.Watchdog.from_env(env={}).maybe_ping() is False
    # WATCHDOG_PID names another process (e.g. we are a child): not ours to ping.
    assert not sdnotify.Watchdog.from_env(env={"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}).enabled
    with pytest.raises(ValueError, match="WATCHDOG_USEC='soon'"):
        sdnotify.Watchdog.from_env(env={"WATCHDOG_USEC": "soon"})
