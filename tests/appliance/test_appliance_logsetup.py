"""structlog JSON lines, journald priority prefixes, secrets masked."""

from __future__ import annotations

import io
import json
import logging
import os

import pytest
import structlog

from xronos.common.logsetup import configure_logging, is_secret_key, stream_is_journal


@pytest.fixture
def out():
    buf = io.StringIO()
    yield buf
    logging.getLogger().handlers = [h for h in logging.getLogger().handlers
                                    if h.get_name() != "xronos-json"]
    structlog.reset_defaults()


def lines(buf):
    return buf.getvalue().splitlines()


def test_json_lines_with_journald_prefix(out):
    configure_logging("debug", stream=out, journald=True)
    log = structlog.get_logger("xronos.test")
    log.debug("d")
    log.info("connected", broker="10.0.0.2")
    log.warning("slow", node="pi5")
    log.error("bad")
    logging.getLogger("paho").critical("from the stdlib")
    got = lines(out)
    assert [ln[:3] for ln in got] == ["<7>", "<6>", "<4>", "<3>", "<2>"]
    first = json.loads(got[1][3:])
    assert first["event"] == "connected" and first["broker"] == "10.0.0.2"
    assert first["level"] == "info" and first["logger"] == "xronos.test" and "timestamp" in first
    assert json.loads(got[4][3:])["event"] == "from the stdlib"


def test_no_prefix_and_level_filter(out):
    configure_logging("warning", stream=out, journald=False)
    log = structlog.get_logger("x")
    log.info("hidden")
    log.warning("shown")
    got = lines(out)
    assert len(got) == 1 and json.loads(got[0])["event"] == "shown"
    with pytest.raises(ValueError, match="log level 'loud'"):
        configure_logging("loud", stream=out)


def test_secrets_are_masked_at_any_depth(out):
    configure_logging("info", stream=out, journald=False)
    structlog.get_logger("x").info(
        "connect", password="hunter2", password_file="/run/credentials/x/mqtt_password",
        broker={"username": "n1", "api_key": "k", "nested": [{"access_token": "t"}]},
        num_tokens=512, tokenizer="/models/gpt2")
    logging.getLogger("lib").info("stdlib %s", "x", extra={"client_secret": "zzz"})
    text = out.getvalue()
    assert "hunter2" not in text and '"k"' not in text and '"t"' not in text
    rec = json.loads(lines(out)[0])
    assert rec["password"] == "***" and rec["broker"]["api_key"] == "***"
    assert rec["broker"]["nested"][0]["access_token"] == "***"
    assert rec["password_file"].endswith("mqtt_password")  # where, not what: kept
    assert rec["num_tokens"] == 512 and rec["tokenizer"] == "/models/gpt2"
    rec2 = json.loads(lines(out)[1])
    assert rec2["event"] == "stdlib x" and rec2["client_secret"] == "***" and "zzz" not in text


def test_secret_key_words():
    assert all(map(is_secret_key, ["password", "mqttPassword", "api_key", "Authorization", "token"]))
    assert not any(map(is_secret_key, ["tokens", "tokenizer", "password_file", "node_id"]))


def test_journal_stream_detection(tmp_path):
    f = (tmp_path / "s").open("w")
    st = os.fstat(f.fileno())
    assert stream_is_journal(f, env={"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
    assert not stream_is_journal(f, env={"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"})
    assert not stream_is_journal(f, env={})
    assert not stream_is_journal(io.StringIO(), env={"JOURNAL_STREAM": "1:2"})
    f.close()
