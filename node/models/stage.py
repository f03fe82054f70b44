"""Writing an export's files into a directory others may write to, without a race.

An export directory is one the job names, and whoever else can write to it can leave a link there
(to another job's checkpoint, to the node's state) or swap one in while we write. Checking for a
link and then opening the name (the check-then-use race) does not close that. So every file is
written in a fresh private directory (0700, made inside the export directory so the final move is
a rename on one file system) that is reached only through a descriptor, never through its name,
and then renamed into place: a rename replaces whatever entry is there, link or file, and never
follows it. A reader also never sees a half-written file, and after a power cut either the old file
or the new one is there (each file and the directory are synced); a process killed while writing
leaves its private directory (`.xronos-stage-*`), never half a file in place; the next export into
that directory removes it (a model's worth of disk on an SD card is not left to a person to find).
A writer holds a lock on its private directory while it writes, which the kernel drops when the
process dies, so only a directory nobody holds — and not one made in the last minute, between its
writer's mkdir and lock — is swept, and only one of ours (our uid, a real directory, not a link).
Linux: the private directory is handed to the libraries that write (safetensors, peft) as its
/proc/self/fd path.

Every file moved into place gets the mode an ordinary new file gets, 0666 less the umask
(`ordinary_mode`): safetensors' `save_file` creates its file 0600 (through a private temporary file),
and an export or a checkpoint is for the user, who reads it as a member of the service's group
(the unit's UMask=0027 makes that 0640). Whatever else writes a file for the user (a checkpoint's
own files, a GGUF written elsewhere) calls `ordinary_mode` on it.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STAGE_PREFIX = ".xronos-stage-"
SWEEP_MIN_AGE_S = 60.0  # a directory younger than this may be one whose writer is about to lock it


def umask() -> int:
    """This process's umask, read without changing it (os.umask can only set it, and setting and
    restoring it races with any other thread creating a file meanwhile)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)  # no /proc (not Linux, or a kernel before 4.7): the racy way
    os.umask(old)
    return old


def ordinary_mode(target: int | str | Path, mode: int | None = None) -> None:
    """Give a file we wrote (an open descriptor or a path) the mode `open(path, "w")` would have
    created it with: 0666 less the umask (`mode`, when the caller has already computed it)."""
    mode = 0o666 & ~umask() if mode is None else mode
    if isinstance(target, int):
        os.fchmod(target, mode)
        return
    fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # a link is refused, not followed
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


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
        sweep(dfd)
        name = STAGE_PREFIX + secrets.token_hex(8)
        os.mkdir(name, 0o700, dir_fd=dfd)  # fails rather than reuse anything already there
        tfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            fcntl.flock(tfd, fcntl.LOCK_EX)  # ours while we write: not swept by another export
            yield Path(f"/proc/self/fd/{tfd}")  # our directory's inode, whatever its name becomes
            files = sorted(f for f in os.listdir(tfd)
                           if stat.S_ISREG(os.stat(f, dir_fd=tfd, follow_symlinks=False).st_mode))
            mode = 0o666 & ~umask()
            for f in files:
                fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=tfd)
                try:
                    ordinary_mode(fd, mode)  # not safetensors' 0600: the group reads the export
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


def sweep(dfd: int) -> list[str]:
    """Remove the private directories that killed exports left in the directory open as `dfd`
    (module docstring); return their names. Anything else with the prefix is left alone."""
    removed = []
    for name in os.listdir(dfd):
        if not name.startswith(STAGE_PREFIX):
            continue
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except OSError:  # a link, a file, gone meanwhile: not one of ours
            continue
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or time.time() - st.st_ctime < SWEEP_MIN_AGE_S:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its writer is alive
                continue
            for f in os.listdir(fd):
                try:
                    os.unlink(f, dir_fd=fd)  # unlink never follows a link
                except OSError:
                    pass
            try:
                os.rmdir(name, dir_fd=dfd)
                removed.append(name)
            except OSError:
                pass
        finally:
            os.close(fd)
    return removed


def remove_entries(out_dir: str | Path, names: list[str]) -> list[str]:
    """Remove the entries `names` of `out_dir` (files, links, or directories of ours), through the
    directory's descriptor: a link is removed itself, never followed, and a directory is removed
    by `shutil.rmtree` on that descriptor (which does not follow links inside either). Return the
    names removed; a name that is not there is skipped."""
    import shutil

    out = Path(out_dir)
    try:
        dfd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    removed = []
    try:
        for name in names:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                if st.st_uid != os.geteuid():  # not one an export of ours made
                    continue
                shutil.rmtree(name, dir_fd=dfd)
            else:
                os.unlink(name, dir_fd=dfd)
            removed.append(name)
        if removed:
            os.fsync(dfd)
    finally:
        os.close(dfd)
    return removed


def writable_problem(out_dir: str | Path) -> str | None:
    """Why an export into `out_dir` could not be written (None: it can): tried for real, a file
    created and removed in the directory or, when it does not exist yet, in its nearest existing
    parent (where it will be made). `os.access` is not enough: root passes it on a read-only mount,
    and a systemd unit's `ReadWritePaths=` is a mount the service sees read-only. Said before
    training, not after it, when the trained weights would be lost."""
    import tempfile

    out = Path(out_dir)
    where = next((d for d in (out, *out.parents) if d.exists()), None)
    if where is None or not where.is_dir():
        return f"{where} is not a directory" if where is not None else "no existing parent"
    try:
        with tempfile.TemporaryFile(dir=where, prefix=STAGE_PREFIX):
            pass
    except OSError as exc:
        return f"cannot write in {where}: {exc.strerror or exc}"
    return None
