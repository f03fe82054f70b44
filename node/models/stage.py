"""Writing an export's files into a directory others may write to, without a race.

An export directory is one the job names, and whoever else can write to it can leave a link there
(to another job's checkpoint, to the node's state) or swap one in while we write. Checking for a
link and then opening the name (the check-then-use race) does not close that. So every file is
written in a fresh private directory (0700, made inside the export directory so the final move is
a rename on one file system) that is reached only through a descriptor, never through its name,
and then renamed into place: a rename replaces whatever entry is there, link or file, and never
follows it. A reader also never sees a half-written file, and after a power cut either the old file
or the new one is there (each file and the directory are synced); a process killed while writing
leaves its private directory (`.xronos-stage-*`, safe to delete), never half a file in place.
Linux: the private directory is handed to the libraries that write (safetensors, peft) as its
/proc/self/fd path.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STAGE_PREFIX = ".xronos-stage-"


@contextmanager
def staged(out_dir: str | Path) -> Iterator[Path]:
    """Yield a private directory to write files in; on a normal exit each file there replaces the
    entry of the same name in `out_dir` (created if missing). On an error nothing is moved and the
    private directory is removed. Sub-directories are not staged (an export is flat). `out_dir`
    itself must not be a symbolic link (its parents may be)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:  # the directory itself as it was checked (callers pass it resolved): not a link swapped in since
        dfd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if out.is_symlink():
            raise OSError(f"export directory {out} is a symbolic link: refused (write to its target)") from exc
        raise
    try:
        name = STAGE_PREFIX + secrets.token_hex(8)
        os.mkdir(name, 0o700, dir_fd=dfd)  # fails rather than reuse anything already there
        tfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            yield Path(f"/proc/self/fd/{tfd}")  # our directory's inode, whatever its name becomes
            files = sorted(f for f in os.listdir(tfd)
                           if stat.S_ISREG(os.stat(f, dir_fd=tfd, follow_symlinks=False).st_mode))
            for f in files:
                fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=tfd)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            for f in files:
                os.replace(f, f, src_dir_fd=tfd, dst_dir_fd=dfd)
            os.fsync(dfd)
        finally:
            for f in os.listdir(tfd):  # what an error left behind
                try:
                    os.unlink(f, dir_fd=tfd)
                except OSError:
                    pass
            os.close(tfd)
            try:
                os.rmdir(name, dir_fd=dfd)
            except OSError:
                pass
    finally:
        os.close(dfd)
