"""The owner's inspection tries the export directory for real before any training: a place the
service cannot write (a read-only mount, a systemd unit's paths outside ReadWritePaths=, which root
passes `os.access` on) is refused then, not found after the last step with the weights lost."""

from __future__ import annotations

import pytest

import runkit
from xronos.node.agent.jobcheck import inspect_job
from xronos.protocol.messages import JobSpec


def test_an_export_directory_that_cannot_be_written_is_refused_at_inspection(tmp_path) -> None:
    model = runkit.make_model(tmp_path / "model", "gpt2", "causal-lm")
    data = runkit.write_rows(tmp_path / "data.csv", [{"text": t} for t in runkit.texts(8)])
    (tmp_path / "file").write_text("x")
    recipe = dict(model_dir=str(model), data_path=str(data), task="causal-lm", batch_size=2, seq_len=16, lr=1e-3,
                  max_steps=2, eval_fraction=0.0)
    bad = JobSpec(name="t", owner="n0", recipe={**recipe, "export_dir": str(tmp_path / "file" / "out")})
    with pytest.raises(ValueError, match=r"spec.recipe.export_dir .*: .*file is not a directory"):
        inspect_job(bad, [tmp_path])
    ro = JobSpec(name="t", owner="n0", recipe={**recipe, "export_dir": "/proc/xronos-out"})
    with pytest.raises(ValueError, match=r"spec.recipe.export_dir '/proc/xronos-out': cannot write in /proc"):
        inspect_job(ro, [tmp_path, "/proc"])
    good = JobSpec(name="t", owner="n0", recipe={**recipe, "export_dir": str(tmp_path / "a" / "b")})
    assert inspect_job(good, [tmp_path])["total_steps"] == 2
    assert not (tmp_path / "a").exists()  # tried in the nearest existing parent: nothing made, nothing left
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".xronos")] == []
