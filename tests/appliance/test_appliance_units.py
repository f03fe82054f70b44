"""The systemd units (checked by systemd-analyze itself) and install.sh into a temporary root."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"
SOURCE = SYSTEMD.parent
UNITS = ["xronos-node.service", "xronos-gateway.service"]
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


def directives(unit: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def runnable_copy(unit: str, dest: Path, exe: str) -> Path:
    """The unit with ExecStart pointing at an executable that exists on this machine (verify
    checks that it does); everything else unchanged."""
    text = (SYSTEMD / unit).read_text()
    assert "ExecStart=/opt/xronos/venv/bin/xronos " in text
    out = dest / unit
    out.write_text(text.replace("ExecStart=/opt/xronos/venv/bin/xronos ", f"ExecStart={exe} "))
    return out


def verify(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ANALYZE, "verify", str(path)], capture_output=True, text=True,
                          timeout=60, cwd=path.parent)


@needs_analyze
@pytest.mark.parametrize("unit", UNITS)
def test_systemd_analyze_verify_passes_without_warnings(tmp_path, unit):
    path = runnable_copy(unit, tmp_path, shutil.which("true"))
    res = verify(path)
    assert res.returncode == 0, res.stderr
    ours = [ln for ln in res.stderr.splitlines() if unit in ln]
    assert ours == [], ours  # an unknown or out-of-range directive is only a warning: none allowed
    # The check can fail: a misspelt directive is reported for this very file.
    path.write_text(path.read_text().replace("Restart=on-failure", "Restrat=on-failure"))
    assert any("Restrat" in ln for ln in verify(path).stderr.splitlines())


@needs_analyze
def test_verify_refuses_a_missing_execstart(tmp_path):
    shutil.copy(SYSTEMD / UNITS[0], tmp_path / UNITS[0])
    res = verify(tmp_path / UNITS[0])
    if Path("/opt/xronos/venv/bin/xronos").exists():
        pytest.skip("a real install exists on this machine")
    assert res.returncode != 0 and "/opt/xronos/venv/bin/xronos" in res.stderr


@needs_analyze
@pytest.mark.parametrize("unit", UNITS)
def test_security_exposure_is_low(tmp_path, unit):
    path = runnable_copy(unit, tmp_path, shutil.which("true"))
    # Exposure 0-10 (x10 for --threshold); systemd calls < 2.0 "OK".
    res = subprocess.run([ANALYZE, "security", "--offline=yes", "--threshold=20", str(path)],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:]


@pytest.mark.parametrize("unit", UNITS)
def test_unit_contract(unit):
    d = directives(SYSTEMD / unit)
    role = unit.split("-")[1].split(".")[0]
    assert d["Type"] == ["notify"] and d["NotifyAccess"] == ["main"]
    assert d["WatchdogSec"] == ["60s"] and d["Restart"] == ["on-failure"]
    assert d["ExecStart"] == [f"/opt/xronos/venv/bin/xronos {role} --config /etc/xronos/{role}.toml"]
    assert d["User"] == ["xronos"] and d["StateDirectory"] == [f"xronos-{role}"]
    assert d["ConfigurationDirectory"] == ["xronos"]
    # A config error (and the gateway's damaged job table, EX_DATAERR): refused once, no restart loop.
    assert d["RestartPreventExitStatus"] == (["78 65"] if role == "gateway" else ["78"])
    assert d["CacheDirectory"] == [f"xronos-{role}"]  # library caches, never $HOME
    assert d["LoadCredential"] == ["mqtt_password:/etc/xronos/mqtt_password"]
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelTunables"):
        assert d[key] == ["yes"], key
    assert d["ProtectSystem"] == ["strict"] and "@system-service" in d["SystemCallFilter"]
    families = set(d["RestrictAddressFamilies"][0].split())
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= families
    if role == "node":
        assert d["Nice"] == ["10"] and d["CPUWeight"] == ["20"] and d["IOSchedulingClass"] == ["idle"]
        text = (SYSTEMD / unit).read_text()
        assert "#CPUQuota=" in text and "#MemoryMax=" in text


def install(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["bash", str(SYSTEMD / "install.sh"), "--root", str(root), "--skip-pip",
                          "--source", str(SOURCE), *args],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


def tree(root: Path) -> set[str]:
    rels = (str(p.relative_to(root)) for p in root.rglob("*"))
    return {rel for rel in rels if "/venv/" not in rel}  # the venv's insides are python's business


@pytest.mark.skipif(shutil.which("systemctl") is None or shutil.which("systemd-sysusers") is None,
                    reason="needs systemctl and systemd-sysusers (offline --root mode)")
def test_install_twice_then_uninstall(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "etc").mkdir()
    (root / "etc" / "hostname").write_text("Pi5.Kitchen\n")
    first = install(root, "--role", "node", "--prefix", "/opt/xr")
    assert "wrote /etc/xronos/node.toml" in first.stdout
    etc = root / "etc"
    unit = etc / "systemd/system/xronos-node.service"
    wants = etc / "systemd/system/multi-user.target.wants/xronos-node.service"
    config = etc / "xronos/node.toml"
    password = etc / "xronos/mqtt_password"
    assert os.readlink(wants) == "/etc/systemd/system/xronos-node.service"  # as systemctl enable
    assert directives(unit)["ExecStart"] == ["/opt/xr/venv/bin/xronos node --config /etc/xronos/node.toml"]
    assert 'node_id = "pi5-kitchen"' in config.read_text()  # host name made a valid node_id
    assert stat.S_IMODE(password.stat().st_mode) == 0o600 and password.read_bytes() == b""
    assert (root / "opt/xr/venv/bin/python").exists()
    assert "xronos:" in (etc / "passwd").read_text()  # the service user, via systemd-sysusers

    # Idempotent, and never overwrites the admin's config.
    config.write_text(config.read_text() + "\n# edited by the admin\n")
    password.write_text("s3cret")
    before = tree(root)
    second = install(root, "--role", "node", "--prefix", "/opt/xr")
    assert "kept existing /etc/xronos/node.toml" in second.stdout
    assert tree(root) == before
    assert config.read_text().endswith("# edited by the admin\n") and password.read_text() == "s3cret"

    # A second role shares the venv, the user and the password.
    install(root, "--role", "gateway", "--prefix", "/opt/xr", "--no-enable")
    assert (etc / "systemd/system/xronos-gateway.service").exists()
    assert not (etc / "systemd/system/multi-user.target.wants/xronos-gateway.service").exists()

    state = root / "var/lib/xronos-node"  # systemd creates it at first start; simulate that
    state.mkdir(parents=True)
    (state / "profile.json").write_text("{}")
    gone = install(root, "--role", "node", "--prefix", "/opt/xr", "--uninstall")
    assert "still installed" in gone.stdout
    assert not unit.exists() and not wants.exists() and not config.exists()
    assert (root / "opt/xr/venv").exists() and password.exists()  # the gateway still needs them

    install(root, "--role", "gateway", "--prefix", "/opt/xr", "--uninstall")
    left = {p for p in tree(root) if not p.startswith("etc") or "xronos" in p}
    assert left == {"opt", "var", "var/lib", "var/lib/xronos-node", "var/lib/xronos-node/profile.json"}
    assert not (etc / "xronos").exists() and not (etc / "sysusers.d/xronos.conf").exists()


def test_install_refuses_bad_arguments(tmp_path):
    for args, msg in [(["--role", "broker"], "--role must be 'node' or 'gateway'"),
                      (["--role", "node", "--prefix", "relative"], "--prefix must be an absolute"),
                      (["--role", "node", "--bogus"], "unknown argument '--bogus'")]:
        res = subprocess.run(["bash", str(SYSTEMD / "install.sh"), "--root", str(tmp_path), *args],
                             capture_output=True, text=True, timeout=30)
        assert res.returncode == 2 and msg in res.stderr, res.stderr


def test_the_node_units_stop_timeout_matches_the_nodes_own_stop():
    """The node stops within seconds at any point (a rank's grace STOP_GRACE_S, then its process
    group killed; a profile at once: tests/services/test_node_processes.py), so systemd need not
    wait a minute before it kills what is left; the whole service's tasks are capped besides the
    node's own per-child limits."""
    from xronos.node.agent.service import STOP_GRACE_S

    d = directives(SYSTEMD / "xronos-node.service")
    (timeout,) = d["TimeoutStopSec"]
    assert timeout.endswith("s") and STOP_GRACE_S + 5 <= float(timeout[:-1]) <= 20
    (tasks,) = d["TasksMax"]
    assert int(tasks) >= 512
