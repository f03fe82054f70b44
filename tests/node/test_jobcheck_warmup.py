"""The owner's inspection refuses a warm-up that would outlast the run (the learning rate would never
reach the rate asked), counting the run's steps as the job will: max_steps, or epochs of full
batches of the data's training rows."""

from __future__ import annotations

import pytest

import runkit
from xronos.node.agent.jobcheck import inspect_job
from xronos.protocol.messages import JobSpec


def _spec(tmp_path, **recipe) -> tuple[JobSpec, list]:
    model = runkit.make_model(tmp_path / "model", "gpt2", "causal-lm")
    data = runkit.write_rows(tmp_path / "data.csv", [{"text": t} for t in runkit.texts(8)])
    base = dict(model_dir=str(model), data_path=str(data), task="causal-lm", batch_size=2, seq_len=16, lr=1e-3,
                export_dir=str(tmp_path / "out"), eval_fraction=0.0)
    return JobSpec(name="t", owner="n0", recipe={**base, **recipe}), [tmp_path]


def test_a_warmup_longer_than_the_run_is_refused_naming_both(tmp_path) -> None:
    spec, allowed = _spec(tmp_path, epochs=1, warmup_steps=5)  # 8 rows, batch 2: 4 steps
    with pytest.raises(ValueError, match=r"spec.recipe.warmup_steps 5 is longer than the run: 4 steps "
                                         r"\(8 training rows, batch 2\)"):
        inspect_job(spec, allowed)
    spec, allowed = _spec(tmp_path, max_steps=3, warmup_steps=4)
    with pytest.raises(ValueError, match=r"warmup_steps 4 is longer than the run: 3 steps"):
        inspect_job(spec, allowed)
    spec, allowed = _spec(tmp_path, epochs=1, warmup_steps=4)  # as long as the run: the last step at lr
    assert inspect_job(spec, allowed)["total_steps"] == 4
