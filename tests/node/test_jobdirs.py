"""What a node keeps of the jobs it ran (`node/agent/jobdirs.py`) and of its profiles
(`profiler.prune_cache`): bounded, whatever the broker sends, without touching checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

from xronos.node.agent.jobdirs import prune
from xronos.node.measure.profiler import prune_cache


def _job(root: Path, job: str, versions=(1,), ckpt: bool = False, age: float = 0.0) -> Path:
    d = root / job
    for v in versions:
        (d / f"v{v}").mkdir(parents=True)
        (d / f"v{v}" / "rank.json").write_text("{}")
    if ckpt:
        (d / "checkpoint").mkdir()
        (d / "checkpoint" / "step-5").write_text("x")
    t = 1_700_000_000 - age
    os.utime(d, (t, t))
    return d


def test_a_job_keeps_the_version_it_runs_and_old_jobs_go_but_checkpoints_stay(tmp_path: Path) -> None:
    root = tmp_path / "jobs"
    _job(root, "j", versions=(1, 2, 3, 4, 5, 6))
    for i in range(5):
        _job(root, f"old{i}", age=100 + i)  # old0 newest
    kept_ckpt = _job(root, "failed", ckpt=True, age=10_000)
    (tmp_path / "elsewhere").mkdir()
    (root / "link").symlink_to(tmp_path / "elsewhere")
    gone = prune(root, "j", 6, keep_jobs=2, keep_versions=3)
    assert sorted(p.name for p in (root / "j").iterdir()) == ["v4", "v5", "v6"]  # their logs: how a move failed
    assert sorted(p.name for p in root.iterdir()) == ["failed", "j", "link", "old0", "old1"]
    assert (kept_ckpt / "checkpoint" / "step-5").exists() and (tmp_path / "elsewhere").is_dir()
    assert {p.name for p in gone} == {"v1", "v2", "v3", "old2", "old3", "old4"}
    assert prune(tmp_path / "none", "j", 1) == []  # nothing there yet


def test_the_profile_cache_keeps_the_newest(tmp_path: Path) -> None:
    for i in range(6):
        p = tmp_path / f"profile-{i}.json"
        p.write_text("{}")
        os.utime(p, (1_700_000_000 + i, 1_700_000_000 + i))
    (tmp_path / "other.json").write_text("{}")
    gone = prune_cache(tmp_path, keep=4)
    assert sorted(p.name for p in gone) == ["profile-0.json", "profile-1.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.json", *(f"profile-{i}.json" for i in range(2, 6))]
