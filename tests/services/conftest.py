"""Fixtures of the services tests that run a whole stack (real broker, gateway and node processes)."""

from __future__ import annotations

import pytest

from stack import Stack


@pytest.fixture
def stack(tmp_path, mqtt_broker):
    """A gateway-and-nodes stack on the session's real broker, under its own topic base."""
    data_dir = tmp_path / "owner-data"
    data_dir.mkdir()
    s = Stack(tmp_path, mqtt_broker, data_dir, base=f"xr{tmp_path.name[-6:].replace('-', '')}")
    yield s
    s.close()
