"""The appliance as people install it: a fresh Debian 12 box with a real systemd (systemd-nspawn
on a debootstrap tree), set up by the README's commands, word for word where a person would type
them, runs a job under the shipped units' sandbox.

Every command the test types is checked to be in the README or a docs page verbatim (`readme(...)`);
where the test must differ from a person, the comment says how. Interactive editors (sudoedit,
`systemctl edit`) get a scripted /usr/bin/editor that makes the edit the README describes; the
checkout is copied in instead of `git clone`d; pip finds this machine's CPU torch wheel through
PIP_FIND_LINKS and XRONOS_TORCH_INDEX=none instead of download.pytorch.org (not reachable here).

The rootfs is built once (about 90 s) and cached in $XRONOS_TEST_CACHE (default
/var/cache/xronos-test) with pip's cache beside it. Set XRONOS_SKIP_BOX=1 to skip.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

import box as B
import doctext

REPO = Path(__file__).resolve().parents[2]
README = doctext.all_text()  # the README and docs/ (install.md has the rest of the steps)
HOST = "xbox"  # the box's host name, so install.sh pre-fills node_id = "xbox"
PASSWORDS = {"box": "box-pw-1", "homeassistant": "ha-pw-2", "xronos-cli": "cli-pw-3"}

reason = B.unavailable() or ("XRONOS_SKIP_BOX=1" if os.environ.get("XRONOS_SKIP_BOX") == "1" else None)
pytestmark = [pytest.mark.box, pytest.mark.skipif(reason is not None, reason=f"box test: {reason}")]

EDITOR = """#!/usr/bin/python3
# A person at the editor, scripted: runs /root/next-edit with `path` = the file being edited.
import sys
path = sys.argv[-1]
exec(open("/root/next-edit").read())
"""


def readme(cmd: str) -> str:
    """A documented command, checked to be in the README or a docs page as written: a line of a
    code block, or a command in backquotes in the text."""
    lines = any(line.strip().startswith(cmd) for line in README.splitlines())
    assert lines or f"`{cmd}`" in README, f"not in the README or docs/: {cmd!r}"
    return cmd


def edit(box: B.Box, code: str) -> None:
    box.write("/root/next-edit", textwrap.dedent(code))


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    deadline = time.monotonic() + 60  # a box of an earlier run may still be powering off
    while not port_free(1883):
        if time.monotonic() > deadline:
            pytest.fail("port 1883 is taken on this machine: the box's Mosquitto shares the host network")
        time.sleep(1)
    work = tmp_path_factory.mktemp("box")
    t0 = time.monotonic()
    base = B.rootfs(log=work / "debootstrap.log")
    built = time.monotonic() - t0
    B.PIP_CACHE.mkdir(parents=True, exist_ok=True)
    binds_ro = tuple(d for d in ("/opt/wheels",) if os.path.isdir(d))
    # This machine reaches PyPI through its own CA bundle (pip's cert=): the box uses the same.
    cert = os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt"
    if os.path.isfile(cert):
        binds_ro += (f"{cert}:/etc/xronos-test-ca.crt",)
    with B.Box(work, HOST, binds_ro=binds_ro, binds=((B.PIP_CACHE, "/root/.cache/pip"),)) as b:
        b.start(base)
        b.timings = {"rootfs_s": built, "boot_s": time.monotonic() - t0 - built}
        b.write("/usr/bin/editor", EDITOR, mode=0o755)
        # pip as this machine has it: its CPU torch wheel, its CA bundle, no CUDA index (the
        # README's `sudo install.sh` keeps XRONOS_TORCH_INDEX through sudo's env_keep).
        pip_conf = "[global]\nfind-links = /opt/wheels\n"
        if os.path.isfile(cert):
            pip_conf += "cert = /etc/xronos-test-ca.crt\n"
        b.write("/etc/pip.conf", pip_conf)
        b.write("/etc/sudoers.d/xronos-test", 'Defaults env_keep += "XRONOS_TORCH_INDEX"\n', mode=0o440)
        yield b
        print(f"\nbox timings: {json.dumps({k: round(v, 1) for k, v in b.timings.items()})}")


def timed(box: B.Box, name: str):
    class _T:
        def __enter__(self):
            self.t = time.monotonic()

        def __exit__(self, *exc):
            box.timings[name] = time.monotonic() - self.t
    return _T()


def test_install_as_the_readme_says(box):
    with timed(box, "install_s"):
        # Debian 12's packages are already in the tree: apt only confirms them.
        box.run(readme("sudo apt install git python3 python3-venv") + " -y")
        box.run(readme("sudo apt install mosquitto") + " -y")
        # Instead of `git clone <this repository> xronos && cd xronos`: the checkout under test.
        B.copy_checkout(REPO, box.path("/root/xronos"))
        pip_env = {"XRONOS_TORCH_INDEX": "none"}
        out = box.run(readme("sudo systemd/install.sh --role node"), cwd="/root/xronos", env=pip_env,
                      timeout=1500).stdout
        assert "wrote /etc/xronos/node.toml" in out and "enabled xronos-node.service" in out
        box.run("sudo systemd/install.sh --role gateway", cwd="/root/xronos", env=pip_env, timeout=600)
    assert 'node_id = "xbox"' in box.path("/etc/xronos/node.toml").read_text()
    assert box.run("/opt/xronos/venv/bin/xronos --version").stdout.startswith("xronos ")

    # Mosquitto, fresh broker (README "Mosquitto").
    box.run(readme("sudo cp systemd/mosquitto/mosquitto.conf /etc/mosquitto/conf.d/xronos.conf"), cwd="/root/xronos")
    pw = lambda p: f"{p}\n{p}\n"  # noqa: E731  (mosquitto_passwd asks twice)
    box.run(readme("sudo systemd/mosquitto/add-user.sh gateway gateway"), cwd="/root/xronos",
            input=pw(PASSWORDS["box"]))
    box.run(readme("sudo systemd/mosquitto/add-user.sh homeassistant homeassistant"), cwd="/root/xronos",
            input=pw(PASSWORDS["homeassistant"]))
    box.run(readme("sudo systemd/mosquitto/add-user.sh cli xronos-cli"), cwd="/root/xronos",
            input=pw(PASSWORDS["xronos-cli"]))
    readme("sudo systemd/mosquitto/add-user.sh node pi5-kitchen")  # with this box's node_id:
    box.run(f"sudo systemd/mosquitto/add-user.sh node {HOST}", cwd="/root/xronos", input=pw(PASSWORDS["box"]))
    box.run(readme("sudo systemctl restart mosquitto"))
    assert box.run("systemctl is-active mosquitto").stdout.strip() == "active"

    # The devices' configs, edited as the README says (the gateway and the node share this box,
    # so one /etc/xronos/mqtt_password serves both: the gateway and node users got one password).
    edit(box, """
        text = open(path).read()
        text = text.replace('# username = "xbox"', 'username = "xbox"')
        text = text.replace('# allowed_dirs = ["/var/lib/xronos-node"]', 'allowed_dirs = ["/srv/xronos"]')
        open(path, "w").write(text)
    """)
    box.run(readme("sudoedit /etc/xronos/node.toml"))
    edit(box, """
        text = open(path).read().replace('# username = "gateway"', 'username = "gateway"')
        text = text.replace('# job_dir = "/etc/xronos/jobs"', 'job_dir = "/etc/xronos/jobs"')
        open(path, "w").write(text)
    """)
    box.run("sudoedit /etc/xronos/gateway.toml")
    edit(box, f"""open(path, "w").write({PASSWORDS['box']!r} + "\\n")""")
    box.run(readme("sudoedit /etc/xronos/mqtt_password"))
    assert 'username = "xbox"' in box.path("/etc/xronos/node.toml").read_text()

    # Models and data under /srv/xronos (README "Models and data").
    box.run(readme("sudo install -d -o xronos -g xronos /srv/xronos"))
    edit(box, """
        lines = open(path).read().splitlines(keepends=True)
        at = next(i for i, ln in enumerate(lines) if ln.startswith("### Lines below this comment"))
        lines[at:at] = ["[Service]\\n", "ReadWritePaths=/srv/xronos\\n", "\\n"]
        open(path, "w").write("".join(lines))
    """)
    # `systemctl edit` insists on a terminal: give it one (script(1)), as a person's shell has.
    box.run(f"script -qec {shlex.quote(readme('sudo systemctl edit xronos-node'))} /dev/null")
    assert "ReadWritePaths=/srv/xronos" in box.run("systemctl cat xronos-node").stdout


def _make_job(box: B.Box) -> None:
    sys.path.insert(0, str(REPO / "tests" / "node"))
    import runkit

    srv = box.path("/srv/xronos")
    runkit.make_model(srv / "tiny-gpt2", "gpt2", "classify", num_labels=2)
    runkit.write_rows(srv / "reviews.csv", [{"text": t, "label": i % 2} for i, t in enumerate(runkit.texts(48))])
    box.run("chown -R xronos:xronos /srv/xronos")
    spec = textwrap.dedent(f"""\
        name = "box-tiny"
        owner = "{HOST}"
        model_dir = "/srv/xronos/tiny-gpt2"
        data_path = "/srv/xronos/reviews.csv"
        task = "classify"
        batch_size = 4
        seq_len = {runkit.SEQ_LEN}
        lr = 1e-4
        max_steps = 6
        checkpoint_interval = 3
        reserve_mb = 0
        export_dir = "/srv/xronos/exports/box-tiny"
        """)
    box.write("/srv/xronos/job.toml", spec)
    # The same job for Home Assistant's Start button (README "Starting a job from Home Assistant").
    box.write("/etc/xronos/jobs/box-tiny.toml", spec.replace('name = "box-tiny"', 'name = "box-ha"')
              .replace("exports/box-tiny", "exports/box-ha"))


def test_services_start_and_a_job_completes_under_the_sandbox(box):
    _make_job(box)
    with timed(box, "start_s"):
        box.run("sudo systemctl start xronos-gateway")
        box.run(readme("sudo systemctl start xronos-node"), timeout=200)
    for unit in ("xronos-gateway", "xronos-node"):
        status = box.run(f"systemctl status {unit} --no-pager", check=False).stdout
        assert "active (running)" in status, status
        props = box.show(unit, "User", "WatchdogUSec", "StatusText")
        assert props["User"] == "xronos" and props["WatchdogUSec"] == "1min", props

    box.write("/root/cli-password", PASSWORDS["xronos-cli"] + "\n", mode=0o600)
    cli = "/opt/xronos/venv/bin/xronos"
    creds = "--host 127.0.0.1 --username xronos-cli --password-file /root/cli-password"
    nodes = box.wait_for("the node online", lambda: (
        lambda r: r.returncode == 0 and re.search(rf"^{HOST}\s+yes", r.stdout, re.M) and r.stdout)(
        box.run(f"{cli} nodes {creds}", check=False)), timeout=120, every=2)
    assert "node" in nodes.splitlines()[0]  # a human-readable table, not JSON log lines
    with timed(box, "job_s"):
        res = box.run(f"{cli} job submit /srv/xronos/job.toml --follow {creds}", check=False, timeout=900)
    journal = box.run("journalctl -u xronos-node -u xronos-gateway --no-pager -n 80", check=False).stdout
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}\n--- journal\n{journal[-6000:]}"
    assert "completed" in res.stdout and '"event"' not in res.stdout
    export = box.path("/srv/xronos/exports/box-tiny")
    assert (export / "config.json").exists() and (export / "model.safetensors").exists()
    # Every library cached under the service's cache directory, nothing under the home ("/").
    assert not box.path("/.cache").exists() and not box.path("/root/.cache/huggingface").exists()
    assert any(box.path("/var/cache/xronos-node/huggingface/datasets").iterdir())
    assert "Read-only file system" not in journal


def test_home_assistant_starts_a_job_from_job_dir(box):
    """What Home Assistant's Start button sends (as the homeassistant MQTT user), and the state it reads."""
    ha = f"-h 127.0.0.1 -u homeassistant -P {PASSWORDS['homeassistant']}"
    state = lambda: json.loads(box.run(f"mosquitto_sub {ha} -t xronos/gateway/state -C 1 -W 10").stdout)  # noqa: E731
    discovery = json.loads(box.run(f"mosquitto_sub {ha} -t homeassistant/device/xronos_gateway/config -C 1 -W 10").stdout)
    assert discovery["cmps"]["job_spec"]["options"] == ["box-tiny"]
    box.run(f"mosquitto_pub {ha} -t xronos/gateway/set -m '{discovery['cmps']['start']['payload_press']}'")
    done = box.wait_for("the job started from Home Assistant to end", lambda: (
        lambda s: s["job_name"] == "box-ha" and s["phase"] in ("completed", "failed", "cancelled") and s)(state()),
        timeout=600, every=3)
    assert done["phase"] == "completed" and done["steps"] == "6 / 6", done
    # "submitted" until the gateway answers, then "accepted" (or "refused ...: reason")
    assert done["last_command"].startswith("start: accepted box-tiny as box-ha-"), done["last_command"]
    assert box.path("/srv/xronos/exports/box-ha/model.safetensors").exists()


def test_a_wrong_cli_password_says_not_authorised(box):
    res = box.run("echo wrong > /root/bad-pw && /opt/xronos/venv/bin/xronos nodes --host 127.0.0.1 "
                  "--username xronos-cli --password-file /root/bad-pw", check=False)
    assert res.returncode != 0 and "not authorised" in res.stderr and "cannot reach" not in res.stderr, res.stderr


def test_watchdog_restarts_a_hung_gateway(box):
    # A hung control loop stops pinging; systemd kills and restarts the service. WatchdogSec is
    # lowered for the test (a drop-in) so that it takes seconds, not the shipped minute.
    box.write("/etc/systemd/system/xronos-gateway.service.d/watchdog-test.conf",
              "[Service]\nWatchdogSec=3s\n")
    box.run("systemctl daemon-reload && systemctl restart xronos-gateway")
    time.sleep(8)  # alive well past 3 s: the loop pings
    before = box.show("xronos-gateway", "NRestarts", "MainPID", "ActiveState")
    assert before["ActiveState"] == "active" and before["NRestarts"] == "0", before
    box.run(f"kill -STOP {before['MainPID']}")
    after = box.wait_for("a watchdog restart", lambda: (
        lambda p: p["NRestarts"] != "0" and p["ActiveState"] == "active" and p)(
        box.show("xronos-gateway", "NRestarts", "MainPID", "ActiveState")), timeout=60)
    assert after["MainPID"] != before["MainPID"]
    assert "Watchdog timeout" in box.run("journalctl -u xronos-gateway --no-pager", check=False).stdout
    box.run("rm /etc/systemd/system/xronos-gateway.service.d/watchdog-test.conf && systemctl daemon-reload")


def test_a_bad_config_is_refused_once_without_a_restart_loop(box):
    box.run("cp /etc/xronos/gateway.toml /root/gateway.toml.good")
    box.run("sed -i 's/^host = \"127.0.0.1\"/host = \"127.0.0.1\"\\nport = 70000/' /etc/xronos/gateway.toml")
    box.run("systemctl reset-failed xronos-gateway; journalctl --rotate >/dev/null 2>&1; true", check=False)
    since = box.run("date +%s").stdout.strip()
    res = box.run("systemctl restart xronos-gateway", check=False)
    assert res.returncode != 0
    time.sleep(12)  # more than twice RestartSec=5s: a restart loop would have shown by now
    props = box.show("xronos-gateway", "ActiveState", "Result", "ExecMainStatus", "NRestarts")
    assert props["ActiveState"] == "failed" and props["ExecMainStatus"] == "78", props
    assert props["NRestarts"] == "0", props
    lines = box.run(f"journalctl -u xronos-gateway --since @{since} --no-pager -o cat", check=False).stdout
    refusals = [ln for ln in lines.splitlines() if "broker.port: Input should be less than 65536" in ln]
    assert len(refusals) == 1 and "/etc/xronos/gateway.toml" in refusals[0], lines
    box.run("cp /root/gateway.toml.good /etc/xronos/gateway.toml && systemctl start xronos-gateway")


def test_uninstall(box):
    box.run(readme("sudo systemd/install.sh --role node --uninstall"), cwd="/root/xronos", timeout=900)
    # The last role removes the venv (torch included: tens of thousands of files).
    box.run("sudo systemd/install.sh --role gateway --uninstall", cwd="/root/xronos", timeout=900)
    res = box.run("systemctl status xronos-node xronos-gateway --no-pager", check=False)
    assert res.returncode == 4 and "could not be found" in res.stderr, res.stderr
    assert not box.path("/etc/xronos/node.toml").exists() and not box.path("/opt/xronos").exists()
    assert box.path("/var/lib/xronos-node").exists()  # the state directory is kept
    assert "xronos" in box.path("/etc/passwd").read_text()  # and the user
