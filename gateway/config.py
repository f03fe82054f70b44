"""The gateway service's configuration: /etc/xronos/gateway.toml (see systemd/gateway.toml.example)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, Field, model_validator

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

__all__ = ["ConfigError", "GatewayConfig", "HomeAssistantSettings", "load_config"]

PosFloat = Annotated[float, Field(gt=0)]


class HomeAssistantSettings(BaseModel):
    model_config = STRICT_CONFIG

    enabled: bool = True
    discovery_prefix: TopicPrefix = "homeassistant"  # HA's birth message is {prefix}/status
    # Job specs (*.toml, *.yaml) Home Assistant may start: its "Job spec" select lists them by file
    # name and its "Start job" button submits the selected one. A missing directory = none.
    job_dir: AbsPath | None = Path("/etc/xronos/jobs")


class GatewayConfig(BaseModel):
    model_config = STRICT_CONFIG

    gateway_id: Identifier = "gateway"
    broker: BrokerSettings = Field(default_factory=BrokerSettings)
    base_topic: TopicPrefix = "xronos"
    state_dir: AbsPath = Path("/var/lib/xronos-gateway")
    reserve_mb: Annotated[int, Field(ge=0)] = 512  # a submitted job's reserve_mb when it sets none (JobSpec)
    # The LAN the data plane runs on, for the planner's communication estimate.
    bandwidth_mbps: PosFloat = 1000.0
    latency_ms: Annotated[float, Field(ge=0)] = 0.5
    profile_timeout_s: PosFloat = 600.0  # a Raspberry Pi profiling a 1.5B block takes minutes
    ack_timeout_s: PosFloat = 30.0
    # A node's "offline" (its last will) reaches its jobs only if it still stands this long, and
    # after a reconnect of the gateway only once broker.reconnect_max_s + broker.keepalive have
    # passed: a broker that shuts down publishes every client's will (gateway/job/offline.py). 0: at once.
    offline_grace_s: Annotated[float, Field(ge=0, le=600)] = 2.0
    # TCP ports the owner node's Gloo rendezvous may use; each plan version takes the next one.
    rendezvous_port_min: Annotated[int, Field(gt=1023, lt=65536)] = 29600
    rendezvous_port_max: Annotated[int, Field(gt=1023, lt=65536)] = 29699
    # Job history: finished jobs are kept (jobs.json, `xronos job status`) up to this many, and
    # none older than this; refused submits are never kept. Unfinished jobs are never pruned.
    history_max_jobs: Annotated[int, Field(ge=0, le=100_000)] = 100
    history_max_age_days: PosFloat = 30.0
    # Jobs being checked or waiting for the nodes at one time; a submit beyond is refused.
    max_unfinished_jobs: Annotated[int, Field(ge=1, le=10_000)] = 16
    # A node that joins a running job is taken into its plan at the next checkpoint (a restart) when
    # the new plan is predicted faster by more than join_min_gain (None: the live re-balancing
    # policy's 5 %) and the time it saves over the steps left repays a restart: join_restart_s
    # seconds, or (None) what the job measured from its assignment to its first metrics.
    join_min_gain: Annotated[float, Field(ge=0, lt=1)] | None = None
    join_restart_s: Annotated[float, Field(ge=0)] | None = None
    homeassistant: HomeAssistantSettings = Field(default_factory=HomeAssistantSettings)
    log_level: LogLevel = "info"

    @model_validator(mode="after")
    def _port_range(self) -> "GatewayConfig":
        if self.rendezvous_port_min > self.rendezvous_port_max:
            raise ValueError(f"rendezvous_port_min {self.rendezvous_port_min} is above "
                             f"rendezvous_port_max {self.rendezvous_port_max}")
        return self


def load_config(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> GatewayConfig:
    """Load and validate a gateway config; ConfigError naming file, key and reason on any problem."""
    cfg = load_toml_model(GatewayConfig, path)
    broker = finish_broker(cfg.broker, path, env=env)
    return cfg if broker is cfg.broker else cfg.model_copy(update={"broker": broker})
