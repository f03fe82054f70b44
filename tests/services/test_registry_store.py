"""Node registry and the persisted job table, with plain data and a temp directory."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from test_jobs import SPEC, inspected

from xronos.gateway import registry as R
from xronos.gateway.job import machine as J
from xronos.gateway.job.store import JobStore, job_from_dict, job_to_dict
from xronos.protocol import messages as m
from xronos.protocol.specfile import upgrade_spec

CAPS = m.Capabilities(node_id="a", hostname="h", arch="x86_64", cpu_model="cpu", cores=2,
                      memory_total=8 << 30, memory_available=4 << 30, torch_version="2.13.0",
                      data_host="127.0.0.1", participate=True, cpu_temp_c=None, sent_at=1.0)


def test_registry_tracks_availability_capabilities_and_participation():
    reg, change = R.on_availability({}, "a", True, 1.0)
    assert change == "up" and R.usable(reg) == frozenset()  # online but has not announced itself
    reg = R.on_capabilities(reg, CAPS, 2.0)
    assert R.usable(reg) == {"a"}
    reg, change = R.on_availability(reg, "a", True, 3.0)
    assert change is None
    reg = R.on_capabilities(reg, CAPS.model_copy(update={"participate": False}), 4.0)
    assert R.usable(reg) == frozenset() and reg["a"].online
    reg, change = R.on_availability(reg, "a", False, 5.0)
    assert change == "down"
    assert R.on_availability({}, "z", False, 1.0)[1] == "down"  # first word about a node
    row = R.listing(reg)[0]
    assert row["node_id"] == "a" and row["online"] is False and row["cores"] == 2


def test_registry_is_bounded():
    reg: R.Registry = {}
    for i in range(R.MAX_KNOWN + 10):
        reg, _ = R.on_availability(reg, f"n{i}", i % 2 == 0, float(i))
    assert len(reg) == R.MAX_KNOWN and "n1" not in reg  # the longest-offline made room
    full = {f"n{i}": R.NodeInfo(f"n{i}", online=True) for i in range(R.MAX_KNOWN)}
    assert R.on_availability(full, "new", True, 1.0) == (full, None)
    assert "new" not in R.on_capabilities(full, CAPS.model_copy(update={"node_id": "new"}), 1.0)


def test_a_full_registry_of_long_names_still_lists_within_the_answers_cap():
    """Every node's texts are its own to choose (255 characters each): `nodes/list` trims them, so
    the answer for a full registry still fits the response's size cap."""
    from xronos.protocol.codec import MAX_PAYLOAD, encode

    long = "x" * 255
    reg: R.Registry = {}
    for i in range(R.MAX_KNOWN):
        caps = CAPS.model_copy(update={"node_id": f"n{i:03d}", "hostname": long, "arch": long, "cpu_model": long,
                                       "torch_version": long, "data_host": long})
        reg, _ = R.on_availability(reg, caps.node_id, True, 1.0)
        reg = R.on_capabilities(reg, caps, 2.0)
    rows = R.listing(reg)
    assert len(rows) == R.MAX_KNOWN and rows[0]["hostname"] == "x" * R.LISTED_CHARS
    answer = m.GatewayResponse(transaction="t", status="ok", data={"nodes": rows})
    assert len(encode(answer)) <= MAX_PAYLOAD


def _a_job():
    ctx = J.Ctx(now=1.0, online=frozenset({"a"}))
    job, _ = J.new_job("j1", SPEC, "t", ctx)
    job, _ = J.handle(job, inspected(job), ctx)
    return job


def test_store_round_trip_and_atomic_replace(tmp_path):
    store = JobStore(tmp_path / "state")
    assert store.load() == {}
    job = replace(_a_job(), loss=math.nan, agg={"a": J.Agg(2, 0.5, 0.1, 0.7)})
    store.save({"j1": job})
    back = store.load()["j1"]
    assert back.events == job.events and back.waiting == job.waiting and math.isnan(back.loss)
    assert back.spec == SPEC and back.arch == job.arch and back.agg == job.agg
    assert replace(back, loss=None) == replace(job, loss=None)
    assert job_from_dict(job_to_dict(back)).spec == SPEC
    text = store.path.read_text()
    assert "\n" not in text and '": ' not in text and '", "' not in text  # compact
    store.save({})
    assert store.load() == {}
    names = sorted(p.name for p in (tmp_path / "state").iterdir())
    assert names == ["jobs.json", "jobs.json.prev"]  # no temp left; the previous table kept
    assert "j1" in store.prev.read_text()


def test_store_refuses_a_damaged_table_naming_file_and_field(tmp_path):
    """Regression (issue 15): wrong field types exited without naming the file."""
    store = JobStore(tmp_path)
    store.path.write_text("{not json")
    with pytest.raises(ValueError, match="jobs.json: not a readable job table: not valid JSON"):
        store.load()
    store.path.write_text(json.dumps({"format": 1, "jobs": [{"job_id": "x", "bogus": 1}]}))
    with pytest.raises(ValueError, match=r"jobs.json: .*jobs\[0\]"):
        store.load()
    good = job_to_dict(_a_job())
    for field, bad in (("created_at", "yesterday"), ("waiting", "a"), ("spec", {"name": 3}),
                       ("phase", "exploded"), ("plan_version", 1.5)):
        store.path.write_text(json.dumps({"format": 1, "jobs": [{**good, field: bad}]}))
        with pytest.raises(ValueError, match=rf"{store.path}: not a readable job table: field jobs\[0\]\.{field}"):
            store.load()


def test_a_table_from_before_the_lora_checks_still_loads(tmp_path):
    """A version-2 spec (before the recipe) with lora_alpha but no lora_r ran as a full fine-tune
    under an earlier gateway; a sender is refused it now (its LoRA options have no rank), but the
    gateway's own table keeps loading (it must start), the job a full fine-tune."""
    store = JobStore(tmp_path)
    old = job_to_dict(_a_job())
    spec = old["spec"]
    recipe = spec.pop("recipe")
    old["spec"] = {**spec, **{k: v for k, v in recipe.items() if k != "lora"}, "schema_version": 2, "lora_r": None,
                   "lora_alpha": 32.0, "lora_dropout": 0.1, "lora_targets": None}
    store.path.write_text(json.dumps({"format": 1, "jobs": [old]}))
    assert store.load()["j1"].spec == SPEC
    with pytest.raises(ValueError, match=r"recipe\.lora\.r"):
        m.JobSpec.model_validate(upgrade_spec(old["spec"]))
    old["spec"]["export_merged"] = True  # refused before too: still unreadable
    store.path.write_text(json.dumps({"format": 1, "jobs": [old]}))
    with pytest.raises(ValueError, match="export_merged: set without lora"):
        store.load()


def test_previous_good_table_is_recoverable(tmp_path):
    store = JobStore(tmp_path)
    store.save({"j1": _a_job()})
    store.save({"j1": _a_job(), "j2": replace(_a_job(), job_id="j2")})
    store.path.write_text('{"format": 1, "jobs": [{"job_id": ')  # damaged on disk
    with pytest.raises(ValueError, match="--restore-previous"):
        store.load()
    n, kept = store.restore_previous()
    assert n == 1 and kept is not None and kept.read_text().startswith('{"format": 1')
    assert list(store.load()) == ["j1"]
    with pytest.raises(ValueError, match="no previous job table"):
        store.restore_previous()
    # Killed between the two renames of a save: the previous table is there, the current is not.
    store.save({"j1": _a_job()})
    store.path.rename(store.prev)
    assert list(JobStore(tmp_path).load()) == ["j1"]


def test_restore_previous_is_one_command(tmp_path, capsys):
    from xronos.cli.main import main as xronos

    state = tmp_path / "state"
    store = JobStore(state)
    store.save({"j1": _a_job()})
    store.save({"j1": _a_job(), "j2": replace(_a_job(), job_id="j2")})
    store.path.write_text("{damaged")
    cfg = tmp_path / "gateway.toml"
    cfg.write_text(f'state_dir = "{state}"\n')
    assert xronos(["gateway", "--config", str(cfg), "--restore-previous"]) == 0
    assert "restored" in capsys.readouterr().out and list(JobStore(state).load()) == ["j1"]
    assert xronos(["gateway", "--config", str(cfg), "--restore-previous"]) == 2  # nothing left to restore
    assert "no previous job table" in capsys.readouterr().err


def test_a_damaged_table_stops_the_gateway_with_its_own_exit_status(tmp_path, capsys):
    """README: a jobs.json that does not read back stops the gateway. Under systemd that needs an
    exit status the unit does not restart on (RestartPreventExitStatus=78 65), else
    Restart=on-failure starts it again every 5 s, failing the same way, for ever."""
    from xronos.cli.gateway import EXIT_DATAERR
    from xronos.cli.main import main as xronos

    state = tmp_path / "state"
    store = JobStore(state)
    store.save({"j1": _a_job()})
    store.save({"j1": _a_job(), "j2": replace(_a_job(), job_id="j2")})
    store.path.write_text("{damaged")
    cfg = tmp_path / "gateway.toml"
    cfg.write_text(f'state_dir = "{state}"\n[homeassistant]\nenabled = false\n')
    assert xronos(["gateway", "--config", str(cfg)]) == EXIT_DATAERR == 65
    err = capsys.readouterr().err
    assert f"{store.path}: not a readable job table" in err and "--restore-previous" in err
    unit = (Path(__file__).parents[2] / "systemd" / "xronos-gateway.service").read_text()
    assert "RestartPreventExitStatus=78 65" in unit.splitlines()
