"""Node registry and the persisted job table, with plain data and a temp directory."""

from __future__ import annotations

import json
import math

import pytest

from xronos.gateway import jobs as J
from xronos.gateway import registry as R
from xronos.gateway.store import JobStore, job_from_dict, job_to_dict

CAPS = {"node_id": "a", "hostname": "h", "arch": "x86_64", "cpu_model": "cpu", "cores": 2,
        "memory_total": 8 << 30, "memory_available": 4 << 30, "torch_version": "2.13.0",
        "data_host": "127.0.0.1", "participate": True, "cpu_temp_c": None, "sent_at": 1.0}


def test_registry_tracks_availability_capabilities_and_participation():
    reg, change = R.on_availability({}, "a", True, 1.0)
    assert change == "up" and R.usable(reg) == frozenset()  # online but has not announced itself
    reg = R.on_capabilities(reg, CAPS, 2.0)
    assert R.usable(reg) == {"a"}
    reg, change = R.on_availability(reg, "a", True, 3.0)
    assert change is None
    reg = R.on_capabilities(reg, {**CAPS, "participate": False}, 4.0)
    assert R.usable(reg) == frozenset() and reg["a"].online
    reg, change = R.on_availability(reg, "a", False, 5.0)
    assert change == "down"
    assert R.on_availability({}, "z", False, 1.0)[1] == "down"  # first word about a node
    assert R.memory_cap(R.on_capabilities(reg, CAPS, 6), "a", 1024) == (4 << 30) - (1024 << 20)
    assert R.memory_cap(R.on_capabilities(reg, CAPS, 6), "a", 10**6) == 0.0
    row = R.listing(reg)[0]
    assert row["node_id"] == "a" and row["online"] is False and row["cores"] == 2


def test_memory_cap_needs_capabilities():
    reg, _ = R.on_availability({}, "b", True, 1.0)
    with pytest.raises(ValueError, match="'b' has not announced"):
        R.memory_cap(reg, "b", 0)


def _a_job():
    ctx = J.Ctx(now=1.0, online=frozenset({"a"}))
    spec = {"name": "t", "owner": "a", "nodes": None}
    job, _ = J.new_job("j1", spec, "t", ctx)
    job, _ = J.handle(job, J.Inspected("a", True, {"family": "bert"}, 10), ctx)
    return job


def test_store_round_trip_and_atomic_replace(tmp_path):
    store = JobStore(tmp_path / "state")
    assert store.load() == {}
    job = _a_job()
    job = J.Job(**{**job_to_dict(job), "loss": math.nan})
    store.save({"j1": job})
    back = store.load()["j1"]
    assert back.events == job.events and back.waiting == job.waiting and math.isnan(back.loss)
    assert job_from_dict(job_to_dict(back)) == back or math.isnan(back.loss)
    store.save({})
    assert store.load() == {}
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["jobs.json"]  # no temp left


def test_store_refuses_a_damaged_table(tmp_path):
    store = JobStore(tmp_path)
    store.path.write_text("{not json")
    with pytest.raises(ValueError, match="jobs.json: not a readable job table"):
        store.load()
    store.path.write_text(json.dumps({"format": 1, "jobs": [{"job_id": "x", "bogus": 1}]}))
    with pytest.raises(ValueError, match="unknown fields"):
        store.load()
