"""The end-to-end tests' deployment: `xronos.cli.localstack.LocalStack` on the `mqtt_broker`
fixture's real broker, with the owner's data directory as the allowed directory."""

from __future__ import annotations

from pathlib import Path

from xronos.cli.localstack import LocalStack


class Stack(LocalStack):
    def __init__(self, tmp: Path, broker, allowed: Path, base: str = "xronos") -> None:
        super().__init__(tmp, broker.host, broker.port, allowed, base)
