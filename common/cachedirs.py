"""Where a service's libraries keep caches and temporary files: under the service's own
directories, never under `$HOME`.

The `xronos` system user's home is `/` (systemd-sysusers) and the units make the whole file system
read-only (`ProtectSystem=strict`) except the state and cache directories, so a library that
caches under `~/.cache` (Hugging Face `datasets` does, for every CSV it reads) fails with
"Read-only file system". `apply(state_dir)` points every such library at the service's cache
directory — systemd's `$CACHE_DIRECTORY` (`CacheDirectory=`) when set, else `<state_dir>/cache`
— before anything imports them; children (profiles, training ranks) inherit the environment.
A variable that is already set (by the unit, a drop-in or the admin) is left alone.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import MutableMapping
from pathlib import Path

# variable -> path below the cache root
_LAYOUT = {
    "XDG_CACHE_HOME": "",
    "HF_HOME": "huggingface",
    "HF_DATASETS_CACHE": "huggingface/datasets",
    "TORCHINDUCTOR_CACHE_DIR": "torch/inductor",
    "TRITON_CACHE_DIR": "triton",
    "TORCH_HOME": "torch",
    "MPLCONFIGDIR": "matplotlib",
    "NUMBA_CACHE_DIR": "numba",
}


def cache_root(state_dir: str | os.PathLike[str], env: MutableMapping[str, str] | None = None) -> Path:
    """systemd's CacheDirectory= (first entry of $CACHE_DIRECTORY), else <state_dir>/cache."""
    env = os.environ if env is None else env
    given = env.get("CACHE_DIRECTORY", "").split(":")[0]
    return Path(given) if given else Path(state_dir) / "cache"


def apply(state_dir: str | os.PathLike[str], env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set every cache variable not already set; return what was set. Creates the directories.

    TMPDIR: kept if it names a writable directory (PrivateTmp= gives the service its own /tmp),
    else <cache>/tmp. HOME, if it is not a writable directory, becomes the state directory so a
    library that ignores all of the above still does not write into a read-only `/`.
    """
    env = os.environ if env is None else env
    root = cache_root(state_dir, env)
    done: dict[str, str] = {}
    for var, rel in _LAYOUT.items():
        if env.get(var):
            continue
        path = root / rel if rel else root
        path.mkdir(parents=True, exist_ok=True)
        env[var] = done[var] = str(path)
    tmp = env.get("TMPDIR") or tempfile.gettempdir()
    if not _writable_dir(tmp):
        path = root / "tmp"
        path.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = done["TMPDIR"] = str(path)
        tempfile.tempdir = None  # recomputed from TMPDIR on next use
    home = env.get("HOME", "")
    if not _writable_dir(home):
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        env["HOME"] = done["HOME"] = str(Path(state_dir))
    return done


def _writable_dir(path: str) -> bool:
    return bool(path) and os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)
