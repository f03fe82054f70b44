"""Ranks prove the world's key right after joining (node/tp/groupkey.py), over real Gloo groups in
real processes: a world that shares the key goes on; a process that joined without it is named
by every rank, and every rank stops before anything of the job moves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.node.tp.tp_world import free_port
from xronos.node.tp.groupkey import KEY_RE, answer, new_key, prove

WORKER = textwrap.dedent("""
    import json, sys
    from xronos.node.tp.group import TPGroup
    from xronos.node.tp.groupkey import GroupAuthError, prove
    rank, world, port, key = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    group = TPGroup.join(rank, world, "127.0.0.1", port, timeout_s=60)
    try:
        prove(group, key)
        print(json.dumps({"ok": True}))
    except GroupAuthError as exc:
        print(json.dumps({"ok": False, "error": str(exc)}))
    finally:  # all three are this test's processes: tear down together, or a peer may abort (leave)
        group.leave()
    # and end as every rank entry does (runtime.exit_process): Gloo's threads outlive the group by a
    # little, and the interpreter's finalisation then aborted a rank now and then (SIGABRT in a full run)
    from xronos.node.rank.spawn import exit_process
    exit_process(0)
""")


def _world(keys: list[str]) -> list[dict]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(len(keys)), str(port), k],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r, k in enumerate(keys)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    return [json.loads(o[0].strip().splitlines()[-1]) for o in outs]


def test_a_world_that_shares_the_key_goes_on_and_a_stranger_is_named_by_every_rank():
    key = new_key()
    assert _world([key, key, key]) == [{"ok": True}] * 3
    stranger = _world([key, new_key(), key])
    assert [r["ok"] for r in stranger] == [False, False, False]
    for r in (0, 2):  # the job's ranks name the one that did not prove the key
        assert stranger[r]["error"].startswith("rank 1 of this world did not prove the job's key"), stranger[r]
    assert stranger[1]["error"].startswith("ranks 0, 2 of this world did not prove"), stranger[1]


def test_keys_and_answers():
    key = new_key()
    assert KEY_RE.match(key) and new_key() != key
    nonces = bytes(64)
    # bound to the key, the round's nonces and the rank: nothing of one answer serves another
    assert answer(b"k", nonces, 0) != answer(b"k", nonces, 1)
    assert answer(b"k", nonces, 0) != answer(b"j", nonces, 0)
    assert answer(b"k", nonces, 0) != answer(b"k", bytes(63) + b"\x01", 0)
    with pytest.raises(ValueError, match="64 lower-case hex digits"):
        prove(None, "AB" * 32)
