"""Config files: good ones load, bad ones are refused naming file, key and reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from xronos.common.configfile import ConfigError
from xronos.gateway.config import GatewayConfig
from xronos.gateway.config import load_config as load_gateway
from xronos.node.agent.config import NodeConfig, detect_data_host
from xronos.node.agent.config import load_config as load_node

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"


def write(tmp_path: Path, text: str, name: str = "node.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_examples_load(tmp_path):
    # install.sh substitutes the host name for @NODE_ID@; the template as is must be refused.
    template = (SYSTEMD / "node.toml.example").read_text()
    with pytest.raises(ConfigError, match="node_id: String should match pattern"):
        load_node(SYSTEMD / "node.toml.example", env={})
    node = load_node(write(tmp_path, template.replace("@NODE_ID@", "n1")), env={})
    assert isinstance(node, NodeConfig) and node.participate
    assert node.allowed_dirs == [node.state_dir]
    gw = load_gateway(SYSTEMD / "gateway.toml.example", env={})
    assert isinstance(gw, GatewayConfig) and gw.homeassistant.enabled


def test_node_defaults_and_fields(tmp_path):
    p = write(tmp_path, 'node_id = "pi5-kitchen"\nstate_dir = "/srv/x"\n'
                        'data_interface = "eth0"\nthreads = 4\n[broker]\nhost = "10.0.0.2"\n')
    cfg = load_node(p, env={})
    assert cfg.allowed_dirs == [Path("/srv/x")]  # follows state_dir when not given
    assert cfg.broker.host == "10.0.0.2" and cfg.threads == 4 and cfg.data_interface == "eth0"
    assert cfg.broker.max_payload == 256 * 1024  # the one payload limit lives in BrokerSettings


@pytest.mark.parametrize("body,key,reason", [
    ('node_id = "Pi 5"\n', "node_id", "should match pattern"),
    ('node_id = "n1"\nthreads = "4"\n', "threads", "valid integer"),
    ('node_id = "n1"\nthreads = 0\n', "threads", "greater than 0"),
    ('node_id = "n1"\nparticipate = "yes"\n', "participate", "valid boolean"),
    ('node_id = "n1"\nallowed_dirs = ["data"]\n', "allowed_dirs[0]", "absolute path"),
    ('node_id = "n1"\nallowed_dirs = []\n', "allowed_dirs", "at least 1"),
    ('node_id = "n1"\nbase_topic = "xronos/#"\n', "base_topic", "topic prefix"),
    ('node_id = "n1"\ndata_host = "not a host"\n', "data_host", "IP address nor a host name"),
    ('node_id = "n1"\ngpus = 1\n', "gpus", "unknown key"),
    ('node_id = "n1"\n[broker]\nport = 70000\n', "broker.port", "less than 65536"),
    ('node_id = "n1"\n[broker]\nhots = "x"\n', "broker.hots", "unknown key"),
    ('threads = 2\n', "node_id", "required key is missing"),
])
def test_bad_node_config_names_file_key_reason(tmp_path, body, key, reason):
    p = write(tmp_path, body)
    with pytest.raises(ConfigError) as err:
        load_node(p, env={})
    msg = str(err.value)
    assert msg.startswith(f"{p}: {key}: "), msg
    assert reason in msg, msg


def test_password_in_config_is_refused_without_echoing_it(tmp_path):
    p = write(tmp_path, 'node_id = "n1"\n[broker]\nusername = "n1"\npassword = "hunter2"\n')
    with pytest.raises(ConfigError) as err:
        load_node(p, env={})
    assert "broker.password" in str(err.value) and "password_file" in str(err.value)
    assert "hunter2" not in str(err.value)


def test_syntax_error_and_missing_file(tmp_path):
    p = write(tmp_path, 'node_id = "n1\n')
    with pytest.raises(ConfigError, match=rf"^{p}: not valid TOML"):
        load_node(p, env={})
    with pytest.raises(ConfigError, match="config file not found"):
        load_node(tmp_path / "absent.toml", env={})
    assert issubclass(ConfigError, ValueError)


def test_password_file_default_from_systemd_credential(tmp_path):
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "mqtt_password").write_text("s3cret\n")
    p = write(tmp_path, 'node_id = "n1"\n[broker]\nusername = "n1"\n')
    cfg = load_node(p, env={"CREDENTIALS_DIRECTORY": str(creds)})
    assert cfg.broker.password_file == creds / "mqtt_password"
    assert cfg.broker.read_password() == "s3cret"
    # Without a username there is nothing to authenticate: no password file is picked.
    p2 = write(tmp_path, 'node_id = "n1"\n', "anon.toml")
    assert load_node(p2, env={"CREDENTIALS_DIRECTORY": str(creds)}).broker.password_file is None


def test_unreadable_broker_file_is_refused_before_connecting(tmp_path):
    p = write(tmp_path, f'node_id = "n1"\n[broker]\nusername = "n1"\n'
                        f'password_file = "{tmp_path}/nope"\n')
    with pytest.raises(ConfigError, match=r"broker\.password_file: cannot read .*nope"):
        load_node(p, env={})


def test_gateway_config(tmp_path):
    p = write(tmp_path, 'gateway_id = "gw"\nbandwidth_mbps = 940.0\nprofile_timeout_s = 60\n'
                        '[homeassistant]\ndiscovery_prefix = "ha"\n', "gateway.toml")
    cfg = load_gateway(p, env={})
    assert cfg.homeassistant.discovery_prefix == "ha" and cfg.profile_timeout_s == 60.0
    bad = write(tmp_path, '[homeassistant]\nenabled = 1\n', "bad.toml")
    with pytest.raises(ConfigError, match=rf"^{bad}: homeassistant\.enabled: .*boolean"):
        load_gateway(bad, env={})
    bad2 = write(tmp_path, 'latency_ms = -1.0\n', "bad2.toml")
    with pytest.raises(ConfigError, match=r"latency_ms: .*greater than or equal to 0"):
        load_gateway(bad2, env={})
    # min = max + 1 divided by zero at the first assignment; otherwise ports left the range
    bad3 = write(tmp_path, 'rendezvous_port_min = 29700\nrendezvous_port_max = 29699\n', "bad3.toml")
    with pytest.raises(ConfigError, match=r"rendezvous_port_min 29700 is above rendezvous_port_max 29699"):
        load_gateway(bad3, env={})


def test_detect_data_host(tmp_path):
    assert detect_data_host(NodeConfig(node_id="n1", data_host="10.1.2.3")) == "10.1.2.3"
    assert detect_data_host(NodeConfig(node_id="n1", data_interface="lo")) == "127.0.0.1"
    # No data_host, no interface: the source address towards the broker (loopback here).
    assert detect_data_host(NodeConfig(node_id="n1")) == "127.0.0.1"
    with pytest.raises(ValueError, match="data_interface 'nosuch0'"):
        detect_data_host(NodeConfig(node_id="n1", data_interface="nosuch0"))
