"""transformers' own TP (the hf-tp baseline) runs on Gloo and trains the same function."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchkit import TINY, _data, _reference
from xronos.bench.hftp_worker import HFTPRankConfig, supported
from xronos.node.rank.local import spawn_ranks
from xronos.bench.workloads import SHAPES, write_checkpoint


@pytest.mark.slow
def test_hf_tp_loss_equals_single_device(tmp_path: Path) -> None:
    model_dir = write_checkpoint(tmp_path / "model", dict(TINY["llama"], num_key_value_heads=4))
    data = _data(tmp_path / "data.jsonl")
    cfg = HFTPRankConfig(recipe=dict(task="classify", model_dir=str(model_dir), data_path=str(data), batch_size=8,
                                     seq_len=16, lr=1e-3, max_steps=1, eval_fraction=0.0, max_grad_norm=None),
                         world_size=2, metrics_path=str(tmp_path / "m.json"))
    spawn_ranks("xronos.bench.hftp_worker", [cfg] * 2, timeout_s=240)
    ranks = json.loads((tmp_path / "m.json").read_text())["ranks"]
    ref_loss, _ = _reference(model_dir, data)
    assert [r["iterations"][0]["loss"] for r in ranks] == pytest.approx([ref_loss] * 2, rel=1e-5)


def test_supported_only_where_sizes_divide() -> None:
    llama = SHAPES["mobilellama-1.4b"]
    assert supported(llama, 2) is None and supported(llama, 4) is None
    assert "not divisible by 3" in supported(llama, 3)
    assert "LLaMA architecture only" in supported(SHAPES["gpt2-medium"], 2)
