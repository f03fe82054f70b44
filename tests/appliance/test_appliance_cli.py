"""The `xronos` command as a person uses it: --version, a secured broker (password file, an
honest "not authorised"), output for people from client commands (JSON lines only from the
services), a config error that exits 78 for systemd, YAML declared, make with any Python >= 3.11."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from brokers import mosquitto_path, start_mosquitto

REPO = Path(__file__).resolve().parents[2]
XRONOS = [sys.executable, "-m", "xronos.cli.main"]
needs_mosquitto = pytest.mark.skipif(mosquitto_path() is None or shutil.which("mosquitto_passwd") is None,
                                     reason="needs mosquitto and mosquitto_passwd")


def xronos(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*XRONOS, *args], capture_output=True, text=True, timeout=timeout, **kw)


def test_version():
    res = xronos("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"xronos {version('xronos')}"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    d = tmp_path_factory.mktemp("secured")
    subprocess.run(["mosquitto_passwd", "-b", "-c", str(d / "passwd"), "xronos-cli", "right"], check=True)
    subprocess.run(["mosquitto_passwd", "-b", str(d / "passwd"), "gateway", "gw"], check=True)
    with start_mosquitto(f"password_file {d / 'passwd'}", anonymous=False, tmp_dir=d / "run") as b:
        yield b, d


@needs_mosquitto
def test_not_authorised_is_not_unreachable(secured, tmp_path):
    b, _ = secured
    (tmp_path / "pw").write_text("wr0ng-pw\n")  # mode 0644: warned about, naming the file
    res = xronos("nodes", "--host", b.host, "--port", str(b.port), "--username", "xronos-cli",
                 "--password-file", str(tmp_path / "pw"), "--timeout", "5")
    assert res.returncode == 2 and res.stdout == ""
    assert "not authorised" in res.stderr and "cannot reach" not in res.stderr, res.stderr
    assert "password_file_world_readable" in res.stderr and f"chmod 600 {tmp_path / 'pw'}" in res.stderr
    assert "wr0ng" not in res.stderr  # never the password
    res = xronos("nodes", "--host", b.host, "--port", str(b.port), "--timeout", "5")  # no user at all
    assert res.returncode == 2 and "not authorised" in res.stderr and "without a user name" in res.stderr
    res = xronos("nodes", "--host", "127.0.0.1", "--port", "1", "--timeout", "2")
    assert res.returncode == 2 and "cannot reach the MQTT broker" in res.stderr and "not authorised" not in res.stderr


@needs_mosquitto
def test_config_reuses_the_services_password_file(secured, tmp_path):
    """`xronos nodes --config /etc/xronos/gateway.toml` outside systemd: the username from the
    config and /etc/xronos/mqtt_password beside it (the file the unit hands the service)."""
    b, _ = secured
    conf = tmp_path / "gateway.toml"
    conf.write_text(f'[broker]\nhost = "{b.host}"\nport = {b.port}\nusername = "gateway"\n')
    res = xronos("nodes", "--config", str(conf), "--timeout", "3")
    assert res.returncode == 2 and "no password file" in res.stderr and "--password-file" in res.stderr
    (tmp_path / "mqtt_password").write_text("gw\n")
    res = xronos("nodes", "--config", str(conf), "--timeout", "3")
    # Connected and authorised: only the gateway is missing.
    assert res.returncode == 2 and "no answer to nodes/list" in res.stderr, res.stderr


@needs_mosquitto
def test_client_commands_print_for_people_and_services_log_json(mqtt_broker, tmp_path):
    conf = tmp_path / "gateway.toml"
    conf.write_text(f'state_dir = "{tmp_path / "state"}"\nbase_topic = "xrcli"\n[broker]\nhost = "{mqtt_broker.host}"\n'
                    f"port = {mqtt_broker.port}\n[homeassistant]\nenabled = false\n")
    # A garbage answer left retained (a buggy client, a broker without the ACL) is not the answer
    # the CLI waits for: it skips it, every time, and takes the gateway's own.
    import paho.mqtt.client as mqtt

    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    pub.connect(mqtt_broker.host, mqtt_broker.port)
    pub.loop_start()
    pub.publish("xrcli/gateway/response/nodes/list", b"garbage", qos=1, retain=True).wait_for_publish(10)
    pub.disconnect()
    pub.loop_stop()
    gw = subprocess.Popen([*XRONOS, "gateway", "--config", str(conf)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(60):
            res = xronos("nodes", "--host", mqtt_broker.host, "--port", str(mqtt_broker.port),
                         "--base-topic", "xrcli", "--timeout", "5")
            if res.returncode == 0:
                break
            time.sleep(0.5)
        assert res.returncode == 0, res.stderr
        assert res.stdout.splitlines()[0].split()[:3] == ["node", "online", "plan"]
        assert "mqtt.connected" not in res.stdout + res.stderr and "{" not in res.stdout
        status = xronos("job", "status", "--host", mqtt_broker.host, "--port", str(mqtt_broker.port),
                        "--base-topic", "xrcli")
        assert status.returncode == 0 and status.stdout.startswith("job ") and status.stderr == ""
    finally:
        gw.send_signal(signal.SIGTERM)
        out, _ = gw.communicate(timeout=30)
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert lines and all(ln.lstrip("<0123456789>").startswith("{") for ln in lines), lines[:5]


@pytest.mark.parametrize("role", ["gateway", "node"])
def test_a_bad_service_config_exits_78_with_one_line(tmp_path, role):
    conf = tmp_path / f"{role}.toml"
    conf.write_text(('node_id = "n1"\n' if role == "node" else "") + "[broker]\nport = 70000\n")
    res = xronos(role, "--config", str(conf))
    assert res.returncode == 78, (res.returncode, res.stderr)  # RestartPreventExitStatus=78
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{conf}: broker.port: Input should be less than 65536" in lines[0]


def test_pyyaml_is_declared_and_yaml_specs_load(tmp_path):
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.lower().startswith("pyyaml") for d in deps)
    from xronos.protocol.specfile import load_spec

    (tmp_path / "s.yaml").write_text("name: t\nowner: n0\nmodel_dir: /m\ndata_path: /d.csv\ntask: classify\n"
                                     "batch_size: 2\nseq_len: 8\nlr: 1e-4\nmax_steps: 5\nexport_dir: /o\n")
    assert load_spec(tmp_path / "s.yaml").recipe.lr == 1e-4  # YAML 1.1 would have read the string "1e-4"


def test_make_takes_any_python_from_3_11_on(tmp_path):
    """Ubuntu 24.04 has python3.12 and no python3.11: make finds it (dry run)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    real = Path(sys.executable).resolve()
    (bindir / "python3.12").symlink_to(real)
    for tool in ("make", "sh", "bash", "env"):
        if shutil.which(tool):
            (bindir / tool).symlink_to(shutil.which(tool))
    env = {"PATH": str(bindir), "HOME": os.environ.get("HOME", "/root")}
    res = subprocess.run(["make", "-n", "-B", "-C", str(REPO), ".venv/.installed"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "python3.12 -m venv .venv" in res.stdout
    (bindir / "python3.12").unlink()
    res = subprocess.run(["make", "-B", "-C", str(REPO), ".venv/.installed"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert res.returncode != 0 and "need Python >= 3.11" in res.stdout + res.stderr
