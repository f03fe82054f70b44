"""The data plane of a job, without MQTT: rank processes as the node service starts them.

Ranks other than the owner are given paths that do not exist: everything they hold came over Gloo.
A job cut at its checkpoint and resumed under a different plan (other ranks, other split) ends
where the uninterrupted one does; equality with `xronos run` is checked end to end (test_e2e).
"""

from __future__ import annotations

import pytest

from jobkit import job_spec, make_case, runkit, start_ranks, wait_ranks

pytestmark = pytest.mark.slow


def _load(path):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(str(path))


def _kinds(events):
    return [e["type"] for e in events]


def test_resume_under_another_plan_ends_where_the_uninterrupted_job_does(tmp_path):
    model, data = make_case(tmp_path)
    spec = job_spec(model, data, tmp_path / "export")
    events = wait_ranks(start_ranks(tmp_path, spec, [2, 6, 4]))
    owner = events[0]
    assert _kinds(owner)[0] == "eval" and owner[0]["when"] == "before"
    assert [e["step"] for e in owner if e["type"] == "metrics"] == [1, 2, 3, 4, 5, 6]
    assert [e["step"] for e in owner if e["type"] == "checkpoint"] == [3]
    assert owner[-1] == {"type": "completed", "step": 6, "epoch": 0, "export_dir": str(tmp_path / "export")}
    assert all(ev[-1]["type"] == "completed" for ev in events)

    # Resume at the step-3 checkpoint on two ranks with another split: same end point.
    spec2 = job_spec(model, data, tmp_path / "export2")
    events = wait_ranks(start_ranks(tmp_path, spec2, [9, 3], resume_step=3, version=2))
    assert [e["step"] for e in events[0] if e["type"] == "metrics"] == [4, 5, 6]
    assert "eval" in _kinds(events[0])  # after only: no "before" on a resume
    max_abs, rel = runkit.compare(_load(tmp_path / "export2"), _load(tmp_path / "export"))
    assert max_abs <= 5e-4 and rel <= 1e-5


def test_resume_without_checkpoint_fails_cleanly(tmp_path):
    model, data = make_case(tmp_path)
    spec = job_spec(model, data, tmp_path / "export")
    events = wait_ranks(start_ranks(tmp_path, spec, [6, 6], resume_step=3), timeout=120)
    assert events[0][-1]["type"] == "failed" and "no checkpoint at step 3" in events[0][-1]["detail"]
    assert events[1][-1]["type"] == "failed"  # the peer learns from Gloo, not by hanging
