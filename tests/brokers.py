"""Real MQTT brokers for integration tests: Mosquitto on a free loopback port with its own config in
a temp dir; the embedded amqtt broker only where Mosquitto cannot be had (and then said loudly).

Set XRONOS_TEST_BROKER=amqtt to force the fallback.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from xronos.common.broker import EmbeddedBroker
from xronos.common.ports import free_port

FALLBACK_NOTES: list[str] = []  # printed in pytest's terminal summary by conftest


def mosquitto_path() -> str | None:
    if os.environ.get("XRONOS_TEST_BROKER") == "amqtt":
        return None
    if os.access("/usr/sbin/mosquitto", os.X_OK):
        return "/usr/sbin/mosquitto"
    return shutil.which("mosquitto")


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


@dataclass
class RunningBroker:
    """A started broker: `.host`, `.port`, `.kind`; `stop()` and `start()` again on the same port."""

    host: str
    port: int
    kind: str  # "mosquitto" | "amqtt"
    dir: Path
    conf: Path | None = None
    _proc: subprocess.Popen | None = field(default=None, repr=False)
    _embedded: EmbeddedBroker | None = field(default=None, repr=False)

    @property
    def log_text(self) -> str:
        log = self.dir / "broker.log"
        return log.read_text(errors="replace") if log.exists() else ""

    def start(self, timeout: float = 10.0) -> RunningBroker:
        if self.kind == "amqtt":
            self._embedded = EmbeddedBroker(self.host, self.port).start(timeout)
            return self
        with open(self.dir / "broker.log", "ab") as log:
            self._proc = subprocess.Popen([mosquitto_path() or "mosquitto", "-c", str(self.conf)],
                                          stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not _port_open(self.host, self.port):
            if self._proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited ({self._proc.returncode}) on port {self.port}:\n"
                                   f"{self.log_text[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mosquitto did not listen on {self.port} within {timeout}s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def __enter__(self) -> RunningBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_mosquitto(conf_text_extra: str = "", *, anonymous: bool = True, files: dict[str, str] | None = None,
                    tmp_dir: Path | None = None, port: int | None = None) -> RunningBroker:
    """Start Mosquitto with a config of ours plus `conf_text_extra` (e.g. password_file/acl_file lines).
    `files` are written into the broker's dir first; "{dir}" in `conf_text_extra` names that dir."""
    exe = mosquitto_path()
    if exe is None:
        raise RuntimeError("mosquitto is not installed (or XRONOS_TEST_BROKER=amqtt)")
    bdir = Path(tmp_dir or tempfile.mkdtemp(prefix="xronos-mosquitto-"))
    bdir.mkdir(parents=True, exist_ok=True)
    for name, text in (files or {}).items():
        (bdir / name).write_text(text)
    last: Exception | None = None
    for _ in range(3):  # a free port can be taken by someone else before mosquitto binds it
        p = port or free_port()
        conf = bdir / "mosquitto.conf"
        conf.write_text("\n".join([
            f"listener {p} 127.0.0.1",
            f"allow_anonymous {'true' if anonymous else 'false'}",
            "persistence false",
            "log_type error", "log_type warning", "log_type notice",
            # As root Mosquitto drops to user "mosquitto", which cannot read a 0700 pytest tmp dir.
            "user root" if os.geteuid() == 0 else "",
            conf_text_extra.replace("{dir}", str(bdir)),
            "",
        ]))
        broker = RunningBroker("127.0.0.1", p, "mosquitto", bdir, conf)
        try:
            return broker.start()
        except RuntimeError as exc:
            last = exc
            if port is not None:
                break
    raise RuntimeError(f"could not start mosquitto: {last}")


def start_amqtt(port: int | None = None) -> RunningBroker:
    bdir = Path(tempfile.mkdtemp(prefix="xronos-amqtt-"))
    return RunningBroker("127.0.0.1", port or free_port(), "amqtt", bdir).start()


def start_broker(tmp_dir: Path | None = None) -> RunningBroker:
    """Mosquitto when available, else the embedded amqtt broker with a note for the test summary."""
    if mosquitto_path() is not None:
        return start_mosquitto(tmp_dir=tmp_dir)
    note = ("Mosquitto not found (or XRONOS_TEST_BROKER=amqtt): MQTT integration tests ran against the "
            "embedded amqtt broker, not Mosquitto")
    if note not in FALLBACK_NOTES:
        FALLBACK_NOTES.append(note)
    return start_amqtt()
