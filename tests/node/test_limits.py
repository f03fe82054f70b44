"""A child cannot outgrow its box (node/box/limits.py, node/box/boxed.py): real child processes, started the
way the node starts them, that go past their memory or task limit fail alone and say why."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from xronos.node.box import limits
from xronos.node.box.limits import Child, ChildLimits, boxed_argv

MiB = 1 << 20
CGROUPS = set(limits.group_bases()) == {"memory", "pids"}
MODES = [pytest.param(True, id="cgroup", marks=pytest.mark.skipif(not CGROUPS, reason="no writable cgroups")),
         pytest.param(False, id="setrlimit")]

GROW = """import sys
held = b'x' * (int(sys.argv[1]) << 20)  # written: resident, not merely reserved
print('survived', flush=True)
"""
THREADS = """import threading, time
started = 0
try:
    for _ in range(600):
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        started += 1
except RuntimeError as exc:
    print('refused after', started, exc, flush=True)
else:
    print('started', started, flush=True)
"""


def run(tmp: Path, code: str, lim: ChildLimits | None, cgroups: bool, *args: str) -> tuple[Child, int, str]:
    (tmp / "bounds_probe.py").write_text(code)
    child = Child(boxed_argv("bounds_probe", *args), dict(os.environ, PYTHONPATH=str(tmp)), lim, "test",
                  cgroups=cgroups, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = child.proc.communicate(timeout=60)
    code_ = child.proc.returncode
    why = child.why(code_)
    child.reaped()
    return child, code_, f"{why}\n{out}{err}"


@pytest.mark.parametrize("cgroups", MODES)
def test_a_child_past_its_memory_limit_fails_alone_with_the_reason(tmp_path, cgroups):
    lim = ChildLimits(memory_bytes=200 * MiB, tasks=64)
    _, code, text = run(tmp_path, GROW, lim, cgroups, "50")
    assert code == 0 and "survived" in text  # within the limit: untouched
    child, code, text = run(tmp_path, GROW, lim, cgroups, "400")
    assert code != 0 and "survived" not in text
    if cgroups:
        assert "it exceeded its memory limit of 200 MiB (killed by the kernel)" in text
        assert not any(d.exists() for _, d in child.groups.dirs.values())  # its groups removed
    else:
        assert "MemoryError" in text


@pytest.mark.parametrize("cgroups", MODES)
def test_a_child_past_its_task_limit_cannot_start_more_threads(tmp_path, cgroups):
    if not cgroups and os.getuid() == 0:
        pytest.skip("root is exempt from RLIMIT_NPROC")
    _, code, text = run(tmp_path, THREADS, ChildLimits(memory_bytes=1 << 30, tasks=32), cgroups)
    assert code == 0 and "refused after" in text, text
    started = int(text.split("refused after ")[1].split()[0])
    assert started < 32


def test_unboxed_the_same_child_runs(tmp_path):
    _, code, text = run(tmp_path, GROW, None, True, "400")
    assert code == 0 and "survived" in text
    _, code, text = run(tmp_path, THREADS, None, True)
    assert "started 600" in text


def test_a_boxed_child_whose_parent_is_already_gone_does_not_run(tmp_path):
    """The parent can die between the fork and PR_SET_PDEATHSIG: the child checks and ends."""
    (tmp_path / "bounds_probe.py").write_text("print('ran')\n")
    env = limits.box_env(dict(os.environ, PYTHONPATH=str(tmp_path)), None)
    env[limits.ENV] = env[limits.ENV].replace(str(os.getpid()), "1")  # as if started by a parent now dead
    proc = subprocess.run(boxed_argv("bounds_probe"), env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 137 and "ran" not in proc.stdout
