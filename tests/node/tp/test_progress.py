"""Gloo's threads ahead of the computing thread (`node/tp/progress.py`): which threads are noted,
that they are raised to SCHED_FIFO 1 once, and that a refusal is logged once and not retried."""

from __future__ import annotations

import os
import threading

import pytest

from xronos.node.tp import progress


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(progress, "_made", set())
    monkeypatch.setattr(progress, "_done", set())
    monkeypatch.setattr(progress, "_refused", False)
    monkeypatch.delenv(progress.ENV, raising=False)


def _waiter() -> tuple[threading.Thread, threading.Event]:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, daemon=True)
    return t, stop


def test_the_mode_is_off_by_default_and_anything_else_is_refused_by_name(monkeypatch):
    """Off unless asked: a real-time Gloo loop that spins starves ranks sharing its core (module
    docstring: three ranks on two cores stood still)."""
    assert progress.mode() == "off"
    monkeypatch.setenv(progress.ENV, " FIFO ")
    assert progress.mode() == "fifo"
    monkeypatch.setenv(progress.ENV, "rt")
    with pytest.raises(ValueError, match="XRONOS_COMM_THREADS must be one of off, fifo, got 'rt'"):
        progress.mode()
    with pytest.raises(ValueError, match="got 'sometimes'"):
        progress.parse("sometimes")


def test_threads_that_appear_while_a_group_is_made_are_noted_and_no_others():
    before, stop_b = _waiter()
    before.start()
    during, stop_d = _waiter()
    try:
        assert progress.made(lambda: during.start() or "pg") == "pg"
        assert progress._made == {during.native_id}
    finally:
        stop_b.set()
        stop_d.set()


@pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="no sched_setscheduler here")
def test_the_noted_threads_are_raised_once(monkeypatch):
    monkeypatch.setenv(progress.ENV, "fifo")
    t, stop = _waiter()
    try:
        progress.made(t.start)
        if os.geteuid() != 0:
            pytest.skip("raising a thread to SCHED_FIFO needs root or CAP_SYS_NICE")
        assert progress.promote() == 1
        assert os.sched_getscheduler(t.native_id) == os.SCHED_FIFO
        assert os.sched_getparam(t.native_id).sched_priority == progress.PRIORITY
        assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER  # the computing thread
        assert progress.promote() == 0  # once
    finally:
        stop.set()


@pytest.mark.parametrize("value", [None, "off"])
def test_off_raises_nothing(monkeypatch, value):
    calls = []
    monkeypatch.setattr(os, "sched_setscheduler", lambda *a: calls.append(a))
    progress._made.add(12345)
    if value is not None:
        monkeypatch.setenv(progress.ENV, value)
    assert progress.promote() == 0 and calls == []


def test_a_refusal_is_logged_once_and_not_retried(monkeypatch, capsys):
    calls = []

    def refuse(*a):
        calls.append(a)
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    monkeypatch.setenv(progress.ENV, "fifo")
    progress._made.update({101, 102})
    assert progress.promote() == 0 and len(calls) == 1
    progress._made.add(103)
    assert progress.promote() == 0 and len(calls) == 1
    out = capsys.readouterr()
    text = out.out + out.err
    assert text.count("tp.comm_threads_not_raised") == 1 and "LimitRTPRIO=1" in text


def test_a_thread_gone_is_skipped(monkeypatch):
    def gone(tid, *a):
        if tid == 101:
            raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr(os, "sched_setscheduler", gone)
    monkeypatch.setenv(progress.ENV, "fifo")
    progress._made.update({101, 102})
    assert progress.promote() == 1 and progress._done == {101, 102}
