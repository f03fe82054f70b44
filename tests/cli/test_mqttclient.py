"""The client commands' broker options (`xronos nodes`, `xronos job ...` with --config): a bad
[broker] or base_topic in the config is refused like the services refuse it, in one line naming the
file, the key and the reason, before anything connects."""

from __future__ import annotations

import pytest

from xronos.cli.main import main


@pytest.fixture
def nothing_connects(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("connected to a broker with a config that should have been refused")

    monkeypatch.setattr("xronos.cli.mqttclient.GatewayClient.__init__", refuse)


@pytest.mark.parametrize("body, message", [
    ('[broker]\nport = "abc"\n', "broker.port: Input should be a valid integer, unable to parse string as an integer "
                                 "(got 'abc')"),
    ('[broker]\nhost = "10.0.0.2"\nbogus = 1\n', "broker.bogus: unknown key"),
    ("[broker]\nport = 70000\n", "broker.port: Input should be less than 65536 (got 70000)"),
    ('[broker]\npassword = "s3cret"\n', "broker.password: secrets are not accepted in a config file"),
    ("broker = 5\n", "broker: Input should be a valid dictionary"),
    ("base_topic = 5\n", "base_topic: Input should be a valid string (got 5)"),
    ('base_topic = "a/+/b"\n', "base_topic: 'a/+/b' is not a usable topic prefix"),
    ('[broker]\ntls_ca = "/nonexistent/ca.pem"\n',
     "broker.tls_ca: cannot read '/nonexistent/ca.pem': No such file or directory"),
])
@pytest.mark.parametrize("command", [["nodes"], ["job", "status"], ["job", "cancel", "j1"]])
def test_bad_broker_config_is_refused_naming_file_key_and_reason(tmp_path, capsys, nothing_connects, body, message,
                                                                 command):
    conf = tmp_path / "gateway.toml"
    conf.write_text(body)
    assert main([*command, "--config", str(conf), "--timeout", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"xronos {command[0]}: error: {conf}: {message}"), err
    assert "s3cret" not in err[0]


def test_config_keys_of_the_service_are_not_the_clients_business(tmp_path, monkeypatch):
    # A whole gateway or node config is a good --config: only [broker] and base_topic are read.
    seen = {}

    def fake(self, settings, base="xronos"):
        seen.update(settings=settings, base=base)
        raise TimeoutError("stop here")

    monkeypatch.setattr("xronos.cli.mqttclient.GatewayClient.__init__", fake)
    conf = tmp_path / "node.toml"
    conf.write_text('node_id = "n1"\nthreads = 4\nbase_topic = "lab"\n[broker]\nhost = "10.0.0.2"\nport = 1884\n'
                    "[homeassistant]\nenabled = false\n")
    with pytest.raises(TimeoutError):
        main(["nodes", "--config", str(conf), "--port", "1885"])
    assert (seen["settings"].host, seen["settings"].port, seen["base"]) == ("10.0.0.2", 1885, "lab")


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # bound, never listening, then closed: a port nothing answers on
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("where, words", [
    (["--port", "CLOSED"], "connection refused: nothing listens on port"),
    (["--host", "no-such-broker.invalid"], "unknown host 'no-such-broker.invalid'"),
])
def test_a_broker_address_nothing_answers_on_is_said_at_once(capsys, where, words):
    # Said with its reason, not as "no answer within 10 s" after the wait (the other message).
    where = [str(_closed_port()) if w == "CLOSED" else w for w in where]
    assert main(["nodes", *where, "--timeout", "30"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "xronos nodes: error: cannot reach the MQTT broker at" in err[0] and words in err[0], err


def test_an_unreachable_broker_is_a_timeout_to_callers_that_retry():
    from xronos.cli.mqttclient import BrokerUnreachable, unreachable

    assert issubclass(BrokerUnreachable, TimeoutError)  # LocalStack.wait_nodes retries on TimeoutError
    assert "connection refused" in unreachable("127.0.0.1", _closed_port())


def test_a_data_parallel_plan_and_the_candidates_are_displayed():
    """`xronos job submit` prints the plan (a data-parallel one with its groups and rows) and the
    planner's candidates, the chosen one marked, with the chosen line."""
    from xronos.cli.mqttclient import format_candidates, format_plan

    entry = {"attn": 4, "mlp": 64, "vocab": 100, "predicted_compute_s": 0.1, "predicted_memory": 1 << 30,
             "memory_cap": 4 << 30}
    plan = {"version": 1, "strategy": "dp", "sizes": {"attn": 4, "mlp": 64, "vocab": 100},
            "predicted_iteration_s": 0.2, "ideal_iteration_s": 0.19, "comm_s": 0.01, "shares": [5, 3],
            "entries": [{"node_id": n, "rank": r, **entry} for r, n in enumerate(("a", "b"))]}
    text = format_plan(plan)
    assert "plan v1 (dp; " in text and "2 data-parallel groups of TP 1, rows per group [5, 3]" in text
    assert text.splitlines()[-1].endswith("group 1") and text.splitlines()[-2].endswith("group 0")
    rows = [{"strategy": "segment", "label": "segment (TP over 2)", "chosen": False, "feasible": True,
             "iteration_s": 0.9, "why_not": None},
            {"strategy": "dp", "label": "dp (2 replicas)", "chosen": True, "feasible": True, "iteration_s": 0.2},
            {"strategy": "mesh", "label": "mesh", "chosen": False, "feasible": False, "iteration_s": None,
             "why_not": "over the memory cap: a needs 9 MiB, cap 4 MiB\nmore"}]
    text = format_candidates(rows, "dp (2 replicas) 0.2000 s (auto; runner-up segment (TP over 2) 0.9000 s)")
    assert text.splitlines() == ["  candidates:", "    segment (TP over 2): 0.9000 s, fits",
                                 "  * dp (2 replicas): 0.2000 s, fits",
                                 "    mesh: -, does not fit: over the memory cap: a needs 9 MiB, cap 4 MiB",
                                 "  chosen: dp (2 replicas) 0.2000 s (auto; runner-up segment (TP over 2) 0.9000 s)"]
    assert format_candidates([]) == ""
