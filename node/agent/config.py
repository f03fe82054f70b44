"""The node service's configuration: /etc/xronos/node.toml (see systemd/node.toml.example)."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, Field, model_validator

from xronos.common.configfile import (
    STRICT_CONFIG,
    AbsPath,
    ConfigError,
    Identifier,
    LogLevel,
    TopicPrefix,
    finish_broker,
    load_toml_model,
)
from xronos.protocol.transport import BrokerSettings

__all__ = ["ConfigError", "NodeConfig", "detect_data_host", "load_config"]

DEFAULT_STATE_DIR = "/var/lib/xronos-node"


def _check_host(value: str) -> str:
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    labels = value.rstrip(".").split(".")
    if len(value) > 253 or not all(
        0 < len(lb) <= 63 and lb.replace("-", "").isalnum() and lb.isascii() for lb in labels
    ):
        raise ValueError(f"{value!r} is neither an IP address nor a host name")
    return value


Host = Annotated[str, AfterValidator(_check_host)]
# Linux interface names: at most 15 characters (IFNAMSIZ - 1), no "/" or whitespace.
InterfaceName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:@-]{1,15}$")]


class NodeConfig(BaseModel):
    model_config = STRICT_CONFIG

    node_id: Identifier  # also the MQTT username under the example ACL
    broker: BrokerSettings = Field(default_factory=BrokerSettings)
    base_topic: TopicPrefix = "xronos"
    state_dir: AbsPath = Path(DEFAULT_STATE_DIR)
    # Address other ranks reach this node's Gloo endpoint at; None = the address of the local
    # interface that routes to the broker (see detect_data_host).
    data_host: Host | None = None
    # NIC Gloo binds to (exported as GLOO_SOCKET_IFNAME to the ranks); None = Gloo's choice.
    data_interface: InterfaceName | None = None
    # A job's model_dir, data_path and export_dir must resolve under one of these (see
    # xronos.common.paths.confine_path). Default: [state_dir].
    allowed_dirs: list[AbsPath] = Field(min_length=1)
    threads: Annotated[int, Field(gt=0)] | None = None
    reserve_mb: Annotated[int, Field(ge=0)] = 512  # memory left to the device's day job
    participate: bool = True
    gloo_timeout_s: Annotated[float, Field(gt=0)] = 300.0
    log_level: LogLevel = "info"

    @model_validator(mode="before")
    @classmethod
    def _default_allowed_dirs(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "allowed_dirs" not in data:
            return {**data, "allowed_dirs": [data.get("state_dir", DEFAULT_STATE_DIR)]}
        return data


def load_config(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> NodeConfig:
    """Load and validate a node config; ConfigError naming file, key and reason on any problem."""
    cfg = load_toml_model(NodeConfig, path)
    broker = finish_broker(cfg.broker, path, env=env)
    return cfg if broker is cfg.broker else cfg.model_copy(update={"broker": broker})


def _interface_ipv4(name: str) -> str:
    siocgifaddr = 0x8915  # <linux/sockios.h>
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            raw = fcntl.ioctl(sock.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            raise ValueError(f"data_interface {name!r}: no IPv4 address ({exc.strerror})") from None
    return socket.inet_ntoa(raw[20:24])


def detect_data_host(cfg: NodeConfig) -> str:
    """The address to advertise for the data plane: data_host, else data_interface's IPv4, else
    the source address the kernel picks to reach the broker (a UDP connect sends no packet)."""
    if cfg.data_host:
        return cfg.data_host
    if cfg.data_interface:
        return _interface_ipv4(cfg.data_interface)
    family = socket.AF_INET6 if ":" in cfg.broker.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((cfg.broker.host, cfg.broker.port))
        except OSError as exc:
            raise ValueError(f"broker.host {cfg.broker.host!r}: cannot find a route to it to pick "
                             f"data_host ({exc}); set data_host explicitly") from None
        return sock.getsockname()[0]


def job_dir(state_dir: Path, job_id: str) -> Path:
    """`state_dir/jobs/<job_id>`, refusing an id that is not one plain path component (the protocol's
    Id pattern already is; this holds even for a caller that skipped it)."""
    if not job_id or job_id in (".", "..") or "/" in job_id or "\\" in job_id or "\0" in job_id \
            or Path(job_id).name != job_id:
        raise ValueError(f"job_id {job_id[:40]!r}: not usable as a directory name")
    root = (state_dir / "jobs").resolve()
    path = (root / job_id).resolve()
    if path.parent != root:
        raise ValueError(f"job_id {job_id[:40]!r}: resolves outside {root}")
    return path
