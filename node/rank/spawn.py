"""The one way the node starts a child process — a job's rank, a profile, a heap probe, the ranks of
`xronos run` and the bench — and how such a child talks back and ends.

    parent: ChildProcess(module, *args, env=rank_env(threads), name=..., limits=..., events=True)
    child:  python -m xronos.node.box.boxed MODULE ARGS...   (node/box/limits.py)

Every child is a `limits.Child`: boxed under the box's memory and task limits when `limits` is
given, leading a process group of its own, dying with its parent (PR_SET_PDEATHSIG), so that
`kill()` ends it and everything it started with one `killpg`. What a child may have besides:

- **an events pipe** (`events=True`): the child writes one JSON line per message to the file
  descriptor named by `EVENTS_FD` in its environment (`EventPipe`); a reader thread in the parent
  queues the lines, which its owner validates as its own typed messages (`node/rank/messages.py`
  for a rank, a `ProfileReport` for a profile);
- **orders on stdin** (`orders=True`): JSON lines the parent writes (`send_line`); EOF means the
  parent is gone;
- **its output** appended to a log file (`log`), or its stderr drained by a thread that keeps the
  tail (`tail()`) and, with `echo`, copies it to ours (rank 0's progress bar); stdout then goes
  nowhere (`quiet`) or to ours.

A child ends through `main_process` (a traceback and exit status 1 on a failure, then `os._exit`).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, NoReturn

from pydantic import BaseModel

from xronos.node.box.limits import Child, ChildLimits, boxed_argv
import xronos.node.measure.allocator as allocator  # (the module alone: not the measuring room)

EVENTS_FD = "XRONOS_EVENTS_FD"  # the child's end of its events pipe
_TAIL_BYTES = 8192


def rank_env(threads: int) -> dict[str, str]:
    """Our environment as every child runs with it: `threads` for torch's pools, Gloo on loopback
    (a job's rank sets its own interface), nothing fetched from a hub, the ranks' allocator setting."""
    env = dict(os.environ)
    env.pop(EVENTS_FD, None)  # a child's pipe is its own, never inherited by what it starts
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env.update(
        GLOO_SOCKET_IFNAME="lo",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    # Big freed blocks stay in the heap instead of being page-faulted in afresh every iteration
    # (node/measure/allocator.py has the measurements); XRONOS_MALLOC=glibc keeps glibc's behaviour.
    if allocator.wanted():
        for var, value in allocator.ENV.items():
            env.setdefault(var, value)
    return env


class _StderrPump(threading.Thread):
    """Drains a child's stderr (so it never blocks on a full pipe), keeps its tail, optionally echoes."""

    def __init__(self, stream: IO[bytes], echo: bool) -> None:
        super().__init__(daemon=True)
        self.stream, self.echo, self.buf = stream, echo, bytearray()

    def run(self) -> None:
        fd = self.stream.fileno()
        while chunk := os.read(fd, 4096):
            self.buf += chunk
            del self.buf[:-_TAIL_BYTES]
            if self.echo:
                sys.stderr.write(chunk.decode(errors="replace"))
                sys.stderr.flush()


def _last_lines(data: bytes, lines: int) -> str:
    text = data.decode(errors="replace").replace("\r", "\n")
    return "\n".join([ln for ln in text.splitlines() if ln.strip()][-lines:])


class ChildProcess:
    """One boxed child (see the module docstring); `wait`, then `close` (or `kill`) when done with it."""

    def __init__(self, module: str, *args: str, env: dict[str, str], name: str, limits: ChildLimits | None = None,
                 events: bool = False, orders: bool = False, log: Path | None = None, echo: bool = False,
                 quiet: bool = True, prefix: Sequence[str] = ()) -> None:
        """`prefix` must exec the rest (e.g. `ip netns exec NAME`), so that the pid is the child's own."""
        self.log_path = log
        self.lines: queue.Queue[str] = queue.Queue()
        read_fd, write_fd = os.pipe() if events else (None, None)
        popen: dict[str, object] = {"stdin": subprocess.PIPE if orders else subprocess.DEVNULL}
        if write_fd is not None:
            env = {**env, EVENTS_FD: str(write_fd)}
            popen["pass_fds"] = (write_fd,)
        logf = open(log, "ab") if log is not None else None
        if logf is not None:
            popen.update(stdout=logf, stderr=subprocess.STDOUT)
        else:
            popen.update(stdout=subprocess.DEVNULL if quiet else None, stderr=subprocess.PIPE)
        try:
            self.box = Child([*prefix, *boxed_argv(module, *args)], env, limits, name, **popen)
        except BaseException:
            for fd in (read_fd, write_fd):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            if logf is not None:
                logf.close()
        self.proc = self.box.proc
        self._why: str | None = None  # how it ended, kept when its cgroups go (`close`)
        self._pump = None if logf is not None else _StderrPump(self.proc.stderr, echo)  # type: ignore[arg-type]
        if self._pump is not None:
            self._pump.start()
        self._reader: threading.Thread | None = None
        if write_fd is not None:
            os.close(write_fd)  # the child's copy is the only writer: EOF once it has ended
            self._reader = threading.Thread(target=self._read, args=(read_fd,), daemon=True)
            self._reader.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "r", errors="replace") as stream:
            for line in stream:
                self.lines.put(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def drain_lines(self) -> list[str]:
        """The event lines read so far, without waiting."""
        out = []
        while True:
            try:
                out.append(self.lines.get_nowait())
            except queue.Empty:
                return out

    def send_line(self, line: str) -> bool:
        """One line on its stdin; False when it is gone (its end is reported by its exit)."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write((line.rstrip("\n") + "\n").encode())
            self.proc.stdin.flush()
            return True
        except (OSError, ValueError):  # a broken pipe, or our end closed by `close`
            return False

    def poll(self) -> int | None:
        return self.proc.poll()

    def finished(self) -> bool:
        """Exited and every event line it wrote has been read."""
        return self.proc.poll() is not None and (self._reader is None or not self._reader.is_alive())

    def wait(self, timeout_s: float | None = None) -> int:
        """Its exit status, once it and its output are done; TimeoutError after `timeout_s`."""
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the child process did not finish within {timeout_s:.0f} s") from None
        for t in (self._pump, self._reader):
            if t is not None:
                t.join(timeout=5.0)
        return code

    def tail(self, lines: int = 20) -> str:
        """The last lines it wrote to stderr (or to its log file)."""
        if self._pump is not None:
            return _last_lines(bytes(self._pump.buf), lines)
        try:
            assert self.log_path is not None
            return _last_lines(self.log_path.read_bytes()[-_TAIL_BYTES:], lines)
        except OSError:
            return ""

    def why(self) -> str:
        """How it ended: its exit code or signal, and whether its memory limit ended it."""
        if self._why is not None:
            return self._why
        code = self.proc.poll()
        return "still running" if code is None else self.box.why(code)

    def kill(self) -> None:
        """SIGKILL its process group (it and whatever it started), without waiting."""
        self.box.kill()

    def close(self) -> None:
        """End it if it still runs, reap it, remove its cgroups, close our ends."""
        if self.proc.poll() is None:
            self.box.kill()
        self._why = self.box.why(self.proc.wait())  # before its cgroups go: they tell an OOM kill
        self.box.reaped()
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        for t in (self._pump, self._reader):
            if t is not None:
                t.join(timeout=2.0)


class EventPipe:
    """The child's end of its events pipe: one JSON line per message, whole lines from any thread."""

    def __init__(self, fd: int | None = None) -> None:
        if fd is None:
            if EVENTS_FD not in os.environ:
                raise RuntimeError(f"{EVENTS_FD} is not set: this module runs as a child of the node "
                                   "(node/rank/spawn.py's ChildProcess with events=True)")
            fd = int(os.environ[EVENTS_FD])
        self._out = os.fdopen(fd, "w", buffering=1)
        self._lock = threading.Lock()

    def send(self, message: BaseModel) -> None:
        self.send_json(message.model_dump_json())

    def send_json(self, text: str) -> None:
        with self._lock:
            self._out.write(text + "\n")


def send_result(value: BaseModel | dict) -> None:
    """A one-shot child's result (a profile's report, a heap probe's numbers) on its events pipe."""
    pipe = EventPipe()
    pipe.send(value) if isinstance(value, BaseModel) else pipe.send_json(json.dumps(value))


def main_process(main: Callable[[list[str]], int]) -> NoReturn:
    """Run a child's `main(sys.argv)` and end with `exit_process`, on every path: a failure
    prints its traceback and exits 1 (a wrong command line keeps its `SystemExit` status). A rank
    that failed still has Gloo's threads alive (its group never left); finalised by the
    interpreter, it would abort now and then instead of exiting 1, and the launcher would report
    SIGABRT without the error."""
    try:
        code = main(sys.argv)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then a clean exit
        traceback.print_exc()
        code = 1
    exit_process(code)


def exit_process(code: int) -> NoReturn:
    """End a child without the interpreter's finalisation: stdio flushed, then `os._exit`.
    Gloo's C++ threads and the store outlive `destroy_process_group` by a little; torn down with
    the interpreter's static destructors they abort the process now and then ("terminate called
    without an active exception", SIGABRT) after it has done everything right, and the launcher
    would report a finished run as failed. Every file a child writes is closed before this."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)

