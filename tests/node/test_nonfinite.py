"""A run whose loss or gradient stops being finite ends at that step with an error naming it and a
non-zero exit, before the optimizer steps, keeping the last checkpoint and exporting nothing. It
used to go on at loss nan to the end, exit 0 and export. Here a run diverges within the recipe's
bounds: learning rate 100 and decoupled weight decay 100 multiply every decayed weight by
1 - 100 x 100 each step, past fp32's range in about ten."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "services"))
import runkit  # noqa: E402
from jobkit import job_spec, make_case, start_ranks, wait_ranks  # noqa: E402

from xronos.cli.main import main  # noqa: E402
from xronos.node.runconfig import RunConfig  # noqa: E402
from xronos.node.rank.lifecycle import JobFault, LocalFiles, run  # noqa: E402
from xronos.node.rank.tpengine import TPEngine  # noqa: E402
from xronos.node.rank.validate import model_sizes  # noqa: E402
from xronos.protocol.layout import Layout  # noqa: E402

pytestmark = pytest.mark.slow

STOPPED = re.compile(r"step (\d+): the (loss|gradient norm|gradient) is (nan|inf|-inf), not finite")


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("nonfinite")
    model = runkit.make_model(root / "gpt2", "gpt2", "causal-lm")
    return model, runkit.write_rows(root / "data.jsonl", [{"text": t} for t in runkit.texts(24)])


@pytest.mark.parametrize("clip", [(), ("--max-grad-norm", "1.0")], ids=["unclipped", "clipped"])
def test_a_diverging_two_rank_run_exits_non_zero_naming_the_step_and_exports_nothing(lm, tmp_path, capfd, clip):
    model, data = lm
    out = tmp_path / "out"
    assert main(runkit.run_argv(model, data, "causal-lm", (4, 8), out, steps=20, lr=100.0,
                                extra=("--weight-decay", "100", *clip))) == 1
    err = capfd.readouterr().err
    assert "JobFault" in err and STOPPED.search(err), err[-3000:]
    assert not out.exists()


class InfGradientFrom(TPEngine):
    """Our engine, with a real backward hook that makes one weight's gradient inf from step `at` on
    (a finite loss whose backward overflows)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.now = at, 0

    def build(self, rank, weights, start):
        super().build(rank, weights, start)
        weight = next(p for n, p in self.model.named_parameters() if p.requires_grad and p.dim() == 2)
        weight.register_hook(lambda g: g * math.inf if self.now >= self.at else g)

    def step(self, rank, batches, step):
        self.now = step
        return super().step(rank, batches, step)


@pytest.mark.parametrize("max_grad_norm", [None, 1.0], ids=["unclipped", "clipped"])
def test_a_non_finite_gradient_stops_the_run_at_its_step(lm, tmp_path, max_grad_norm):
    model, data = lm
    cfg = RunConfig(recipe=dict(model_dir=str(model), data_path=str(data), task="causal-lm", batch_size=4,
                                seq_len=runkit.SEQ_LEN, lr=1e-3, max_steps=6, max_grad_norm=max_grad_norm,
                                export_dir=str(tmp_path / "out"), eval_fraction=0.0),
                    layout=Layout.single(model_sizes(model)), threads=1)
    what = "gradient" if max_grad_norm is None else "gradient norm"
    with pytest.raises(JobFault, match=rf"^step 3: the {what} is (nan|inf), not finite"):
        run(cfg, InfGradientFrom(2), weights=LocalFiles(str(model)))
    assert not (tmp_path / "out").exists()


def test_a_diverging_job_fails_as_a_job_fault_keeping_its_last_checkpoint(tmp_path):
    model, data = make_case(tmp_path)
    # A job's learning rate is at most 100: with a decay of 1 every step multiplies the weights by -99.
    spec = job_spec(model, data, tmp_path / "export", lr=100.0, weight_decay=1.0, max_steps=12,
                    checkpoint_interval=1)
    procs = start_ranks(tmp_path, spec, [4, 8])
    events = wait_ranks(procs)
    assert [p.poll() for p in procs] == [1, 1]
    for rank_events in events:
        failed = [e for e in rank_events if e.kind == "failed"]
        assert len(failed) == 1 and failed[0].job_fault is True, rank_events
        assert not any(e.kind == "completed" for e in rank_events)
    stopped = int(STOPPED.search(failed[0].detail).group(1))  # rank 1's; rank 0 stops at the same step
    assert stopped == int(STOPPED.search([e for e in events[0] if e.kind == "failed"][0].detail).group(1))
    saved = [e.step for e in events[0] if e.kind == "checkpoint"]
    assert saved and saved[-1] == stopped - 1  # every step before the one that failed was checkpointed
    state = json.loads((tmp_path / "ckpt" / "state.json").read_text())
    assert state["step"] == stopped - 1
    assert not (tmp_path / "export").exists()
