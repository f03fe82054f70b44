"""Caches and temporary files under the service's own directories, never under $HOME: a node
whose home is not writable (the `xronos` user's home is "/", read-only under ProtectSystem=strict)
still reads a CSV dataset with Hugging Face `datasets` (which caches every file it reads)."""

from __future__ import annotations

import os
import subprocess
import sys

from xronos.common import cachedirs

READ = """
import sys
from xronos.node.data.batches import load_columns
if sys.argv[2] == "apply":
    from xronos.common import cachedirs
    cachedirs.apply(sys.argv[1])
print(load_columns(sys.argv[3], ["text", "label"])["label"])
"""


def _run(tmp_path, mode: str, extra_env: dict[str, str]):
    data = tmp_path / "d.csv"
    data.write_text("text,label\nhello,0\nworld,1\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HOME", "HF_DATASETS_CACHE", "XDG_CACHE_HOME", "CACHE_DIRECTORY")}
    # /dev/null is no directory: nothing can be created under it, not even by root (these tests
    # run as root, for whom a read-only permission bit means nothing).
    env.update(HOME="/dev/null", **extra_env)
    return subprocess.run([sys.executable, "-c", READ, str(tmp_path / "state"), mode, str(data)],
                          capture_output=True, text=True, timeout=900, env=env)


def test_datasets_without_a_writable_home_fail_unless_the_cache_is_set(tmp_path):
    res = _run(tmp_path, "plain", {})
    assert res.returncode != 0  # the bug the service had: datasets caches under ~/.cache


def test_node_caches_under_its_state_dir_or_systemds_cache_directory(tmp_path):
    res = _run(tmp_path, "apply", {})
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "[0, 1]"
    assert any((tmp_path / "state" / "cache" / "huggingface" / "datasets").iterdir())
    systemd = tmp_path / "var-cache-xronos-node"
    res = _run(tmp_path, "apply", {"CACHE_DIRECTORY": str(systemd)})  # CacheDirectory= sets it
    assert res.returncode == 0, res.stderr[-3000:]
    assert any((systemd / "huggingface" / "datasets").iterdir())


def test_apply_keeps_what_is_set_and_fixes_home(tmp_path):
    env = {"HOME": "/dev/null", "HF_HOME": str(tmp_path / "mine"), "TMPDIR": "/nonexistent"}
    done = cachedirs.apply(tmp_path / "state", env)
    assert env["HF_HOME"] == str(tmp_path / "mine") and "HF_HOME" not in done
    assert env["HF_DATASETS_CACHE"] == str(tmp_path / "state/cache/huggingface/datasets")
    assert env["XDG_CACHE_HOME"] == str(tmp_path / "state/cache")
    assert env["TMPDIR"] == str(tmp_path / "state/cache/tmp") and os.path.isdir(env["TMPDIR"])
    assert env["HOME"] == str(tmp_path / "state")
    ok = {"HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    cachedirs.apply(tmp_path / "state", ok)
    assert ok["HOME"] == str(tmp_path) and ok["TMPDIR"] == str(tmp_path)
