"""`runtime.main_process`: every rank entry ends through `os._exit`, on its failures too.

A rank that fails keeps Gloo's threads alive; finalised by the interpreter it aborted now and then
(SIGABRT) instead of exiting 1, and the launcher reported the signal without the error. The child
below registers an `atexit` hook: the interpreter's finalisation runs it, `os._exit` does not.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import atexit, sys
    from xronos.node.rank.spawn import main_process

    atexit.register(lambda: print("FINALISED", file=sys.stderr))

    def main(argv):
        print("working", flush=False)  # flushed by main_process before the exit
        how = argv[1]
        if how == "ok":
            return 0
        if how == "usage":
            raise SystemExit(2)
        if how == "message":
            raise SystemExit("bad settings file")
        raise FileNotFoundError("data file /nowhere/vanished.csv does not exist")

    main_process(main)
""")


@pytest.mark.parametrize(("how", "code", "stderr"), [
    ("ok", 0, ""),
    ("usage", 2, ""),
    ("message", 1, "bad settings file"),
    ("raise", 1, "FileNotFoundError: data file /nowhere/vanished.csv does not exist"),
])
def test_main_process_exits_with_the_status_and_without_finalisation(how: str, code: int, stderr: str) -> None:
    done = subprocess.run([sys.executable, "-c", CHILD, how], capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr
    assert done.stdout == "working\n"
    assert stderr in done.stderr
    if how == "raise":
        assert "Traceback (most recent call last)" in done.stderr
    assert "FINALISED" not in done.stderr
