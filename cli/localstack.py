"""A whole deployment on one machine: a gateway process and node processes (`xronos gateway|node
--config`), each with its own TOML config, state directory and log file, talking through a broker.
Used by `xronos demo` and by the end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from xronos.cli.mqttclient import GatewayClient
from xronos.common.ports import free_port
from xronos.protocol.transport import BrokerSettings


class LocalStack:
    PORTS = 21

    def __init__(self, workdir: Path, host: str, port: int, allowed: Path, base: str = "xronos",
                 keepalive: int = 2) -> None:
        self.dir, self.host, self.port, self.allowed, self.base = workdir, host, port, allowed, base
        self.keepalive = keepalive
        self.procs: dict[str, subprocess.Popen] = {}
        self.port0 = free_port(n=self.PORTS)  # the gateway's rendezvous range
        self.client = GatewayClient(BrokerSettings(host=host, port=port), base)

    def _broker_toml(self) -> str:
        return (f'base_topic = "{self.base}"\n[broker]\nhost = "{self.host}"\nport = {self.port}\n'
                f"keepalive = {self.keepalive}\nreconnect_max_s = 2\n")

    def _spawn(self, name: str, kind: str, toml: str) -> subprocess.Popen:
        self.dir.mkdir(parents=True, exist_ok=True)
        cfg = self.dir / f"{name}.toml"
        cfg.write_text(toml)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        with open(self.dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "xronos.cli.main", kind, "--config", str(cfg)],
                                    stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs[name] = proc
        return proc

    def gateway(self, profile_timeout_s: float = 300.0, **extra: object) -> subprocess.Popen:
        lines = "".join(f"{k} = {v}\n" for k, v in extra.items())
        return self._spawn("gateway", "gateway", f'state_dir = "{self.dir / "gateway-state"}"\n'
                           f"rendezvous_port_min = {self.port0}\nrendezvous_port_max = {self.port0 + self.PORTS - 1}\n"
                           f"ack_timeout_s = 20.0\nprofile_timeout_s = {float(profile_timeout_s)}\n{lines}"
                           + self._broker_toml())

    def node(self, node_id: str, threads: int = 1, wrap: Callable[[int], None] | None = None) -> subprocess.Popen:
        """Start a node; `wrap(pid)` may confine it (its training child inherits the confinement)."""
        proc = self._spawn(node_id, "node", f'node_id = "{node_id}"\nstate_dir = "{self.dir / node_id}"\n'
                           f'allowed_dirs = ["{self.allowed}", "{self.dir / node_id}"]\ndata_host = "127.0.0.1"\n'
                           f"threads = {threads}\nreserve_mb = 0\ngloo_timeout_s = 60.0\n" + self._broker_toml())
        if wrap is not None:
            wrap(proc.pid)
        return proc

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def wait_nodes(self, n: int, timeout: float = 90.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                nodes = self.client.request("nodes/list", 5.0)["nodes"]
            except TimeoutError:
                continue
            if sum(1 for x in nodes if x["online"] and x["cpu_model"]) >= n:
                return nodes
            time.sleep(0.5)
        raise TimeoutError(f"{n} nodes did not come online:\n{self.logs()}")

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}" for p in sorted(self.dir.glob("*.log")))

    def close(self) -> None:
        """SIGTERM everything at once (nodes end their training children), then reap."""
        for proc in self.procs.values():
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        self.client.close()
