"""Confining paths that arrive over the network to directories the device owner allowed.

A job spec names a model directory, a data file and an export directory on the owner node. They
come from MQTT, so they are untrusted: `confine_path` resolves symlinks and `..` first and then
checks the real location, so neither `/srv/xronos/../../etc` nor a symlink out of an allowed
directory gets through.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def confine_path(path: str | os.PathLike[str], allowed_dirs: Iterable[str | os.PathLike[str]],
                 what: str = "path") -> Path:
    """The resolved `path` if it lies under one of `allowed_dirs` (also resolved), else ValueError.

    `what` names the field in the error (e.g. "spec.data_path"). The path need not exist yet
    (an export directory), but it must be absolute.
    """
    raw = os.fspath(path)
    allowed = [Path(os.fspath(d)).resolve() for d in allowed_dirs]
    shown = ", ".join(str(d) for d in allowed) or "(none configured)"
    if not raw or "\0" in raw:
        raise ValueError(f"{what} {raw!r}: not a valid path")
    if not os.path.isabs(raw):
        raise ValueError(f"{what} {raw!r}: must be an absolute path under one of: {shown}")
    resolved = Path(raw).resolve()  # follows symlinks of every existing component, folds ".."
    for root in allowed:
        if resolved == root or resolved.is_relative_to(root):
            return resolved
    via = "" if str(resolved) == raw else f" (resolves to {resolved})"
    raise ValueError(f"{what} {raw!r}{via} is outside the allowed directories: {shown}")


def overlaps(a: Path, b: Path) -> bool:
    """Whether one of two resolved paths is, contains or lies inside the other (an export may not
    overlap what it reads: `xronos run` and a job's inspection alike)."""
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)
