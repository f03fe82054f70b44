"""A fresh Debian box with a real systemd, for running the shipped units as people install them.

`rootfs()` builds (once, then cached outside the repository under $XRONOS_TEST_CACHE, default
/var/cache/xronos-test) a Debian bookworm root file system with debootstrap from Debian's
packages. `Box` boots it with `systemd-nspawn --boot` on a throwaway overlay (the cached tree is
never written), in a private mount namespace (nspawn needs a tmpfs on /run/systemd/nspawn, which
then exists only there), and runs commands inside it with nsenter. The box shares the host's
network (pip needs PyPI), so its Mosquitto listens on the host's port 1883 while it runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

SUITE = "bookworm"
MIRROR = os.environ.get("XRONOS_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# What a Debian 12 box has after the README's `apt install` lines, plus sudo for its `sudo ...`.
PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3", "python3-venv", "mosquitto",
            "mosquitto-clients", "git", "sudo", "ca-certificates")
CACHE = Path(os.environ.get("XRONOS_TEST_CACHE", "/var/cache/xronos-test"))
PIP_CACHE = CACHE / "pip"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def unavailable() -> str | None:
    """Why a box cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (systemd-nspawn, mounts)"
    for tool in ("systemd-nspawn", "debootstrap", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} not found (apt install systemd-container debootstrap; `make system-deps`)"
    return None


def _key() -> str:
    return hashlib.sha256(f"{SUITE} minbase {MIRROR} {' '.join(PACKAGES)}".encode()).hexdigest()[:12]


def rootfs(log: Path | None = None) -> Path:
    """The cached Debian tree, built with debootstrap the first time (about 90 s)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"rootfs-{SUITE}-{_key()}"
    with open(CACHE / "rootfs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test runs build it once
        if (path / ".xronos-complete").exists():
            return path
        tmp = path.with_name(path.name + ".building")
        if tmp.exists():
            shutil.rmtree(tmp)
        cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(tmp), MIRROR]
        with open(log or os.devnull, "ab") as out:
            res = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=1800)
        if res.returncode != 0:
            raise RuntimeError(f"debootstrap failed ({res.returncode}); see {log}")
        # No apt lists are kept: `apt install` of a package the tree has needs none.
        (tmp / "etc/hostname").write_text("debian\n")
        (tmp / ".xronos-complete").write_text(" ".join(cmd) + "\n")
        tmp.rename(path)
        return path


class CommandFailed(AssertionError):
    pass


class Box:
    """A booted box: `run(cmd)` runs a shell command inside as root, like a person at its prompt."""

    def __init__(self, workdir: Path, hostname: str, binds_ro: tuple[str, ...] = (),
                 binds: tuple[tuple[Path, str], ...] = ()) -> None:
        self.workdir, self.hostname = workdir, hostname
        self.binds_ro, self.binds = binds_ro, binds
        self.proc: subprocess.Popen | None = None
        self.init_pid: int | None = None
        self.root = workdir / "merged"
        self.log = workdir / "nspawn.log"

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self, base: Path, timeout: float = 120.0) -> Box:
        for d in ("upper", "work", "merged"):
            (self.workdir / d).mkdir(parents=True, exist_ok=True)
        opts = [f"--bind-ro={b}" for b in self.binds_ro] + [f"--bind={h}:{c}" for h, c in self.binds]
        script = "\n".join([
            "set -e",
            "mkdir -p /run/systemd/nspawn && mount -t tmpfs tmpfs /run/systemd/nspawn",
            f"mount -t overlay overlay -o lowerdir={base},upperdir={self.workdir}/upper,"
            f"workdir={self.workdir}/work {self.root}",
            f"echo {self.hostname} > {self.root}/etc/hostname",
            f"printf '127.0.1.1\\t{self.hostname}\\n' >> {self.root}/etc/hosts",  # as Debian's installer does
            f"exec systemd-nspawn -D {self.root} --register=no --keep-unit --boot --console=passive "
            f"--machine={self.hostname} {' '.join(opts)}",
        ])
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "bash", "-c", script],
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while self.init_pid is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"systemd-nspawn exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no systemd in the box after {timeout} s:\n{self.log.read_text()[-3000:]}")
            self.init_pid = self._find_init()
            time.sleep(0.2)
        while True:  # wait for the boot to settle (running or degraded)
            res = self.run("systemctl is-system-running --wait", check=False, timeout=timeout)
            if res.stdout.strip() in ("running", "degraded"):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"boot did not finish: {res.stdout}{res.stderr}")
            time.sleep(0.5)
        return self

    def _find_init(self) -> int | None:
        """The box's PID 1: the process named systemd whose parent is our systemd-nspawn."""
        for pid in _descendants(self.proc.pid):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                pcomm = Path(f"/proc/{parent}/comm").read_text().strip()
            except (OSError, ValueError, IndexError):
                continue
            if comm == "systemd" and pcomm == "systemd-nspawn":
                return pid
        return None

    def stop(self, timeout: float = 90.0) -> None:
        """Power the box off (SIGKILL if it does not go), then drop its overlay's upper layer
        (the installed venv: over a GB). Never raises: it runs in teardown."""
        if self.proc is not None and self.proc.poll() is None:
            if self.init_pid is not None:  # an orderly poweroff, as systemd-nspawn does on SIGTERM
                try:
                    self.run("systemctl poweroff --no-block", check=False, timeout=60)
                except subprocess.TimeoutExpired:
                    pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(60)
                except (OSError, subprocess.TimeoutExpired):
                    pass
        if self.proc is not None and self.proc.poll() is not None:
            shutil.rmtree(self.workdir / "upper", ignore_errors=True)
            shutil.rmtree(self.workdir / "work", ignore_errors=True)

    def __enter__(self) -> Box:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- commands ----------------------------------------------------------------------------
    def run(self, cmd: str, *, check: bool = True, input: str | None = None, timeout: float = 300.0,
            env: dict[str, str] | None = None, cwd: str = "/root") -> subprocess.CompletedProcess[str]:
        assert self.init_pid is not None
        envs = [f"{k}={v}" for k, v in {"PATH": PATH, "HOME": "/root", "LANG": "C.UTF-8", "TERM": "dumb",
                                        "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0", **(env or {})}.items()]
        argv = ["nsenter", "-t", str(self.init_pid), "-a", "--", "env", "-i", *envs,
                "bash", "-c", f"cd {cwd} && {cmd}"]
        res = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise CommandFailed(f"in the box: {cmd}\nexit {res.returncode}\n--- stdout\n{res.stdout[-4000:]}"
                                f"\n--- stderr\n{res.stderr[-4000:]}")
        return res

    def path(self, inside: str) -> Path:
        """A path inside the box as seen from the host: through its PID 1's root (the overlay is
        mounted only in the box's private mount namespace)."""
        assert self.init_pid is not None
        return Path(f"/proc/{self.init_pid}/root") / inside.lstrip("/")

    def write(self, inside: str, text: str, mode: int = 0o644) -> None:
        self.run(f"install -D -m {mode:o} /dev/stdin {inside}", input=text)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.run(f"systemctl show {unit} " + " ".join(f"-p {p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait_for(self, what: str, fn, timeout: float = 120.0, every: float = 1.0):
        deadline = time.monotonic() + timeout
        while True:
            value = fn()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout:.0f} s")
            time.sleep(every)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            kids = []
        for k in kids:
            out.append(int(k))
            todo.append(int(k))
    return out


def copy_checkout(source: Path, dest: Path) -> None:
    """The files a `git clone` of this checkout would have (tracked and new, not ignored ones)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=source,
                           capture_output=True, check=True).stdout.split(b"\0")
    for rel in filter(None, files):
        src = source / rel.decode()
        if not src.is_file():
            continue  # deleted in the work tree
        target = dest / rel.decode()
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
