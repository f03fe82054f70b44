"""A rank's rows and its part of the loss (`node.dp.rows`), and the refusals of `DataParallel` and
`GradSync`, in one process: the parts of any split sum to the whole batch's loss and gradient."""

from __future__ import annotations

import json

import pytest
import torch
from ckpts import make_batch, make_checkpoint

from xronos.node.data.batches import Batch
from xronos.node.dp.gradsync import GradSync
from xronos.node.dp.replica import DataParallel
from xronos.node.dp.rows import row_range, rows_of, share_loss, target_count
from xronos.node.models.loading import SafetensorsSource, materialize
from xronos.node.models.registry import family_for
from xronos.node.tp.group import TPGroup
from xronos.node.tp.layout import ShardLayout


def _batch(kind: str, rows: int = 5) -> Batch:
    b = make_batch(kind, B=rows, S=10, seed=3)
    b["attention_mask"][2, 6:] = 0  # rows with different target counts
    b["input_ids"] = b["input_ids"].masked_fill(b["attention_mask"] == 0, 0)
    if kind.endswith("-lm"):
        b["labels"] = b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)
    return Batch(b["input_ids"], b["attention_mask"], b["labels"], b.get("token_type_ids"))


def _model(kind: str, tmp_path, group: TPGroup | None = None):
    ckpt = make_checkpoint(kind, tmp_path / kind)
    config = json.loads((ckpt / "config.json").read_text())
    family = family_for(config)
    task = "causal-lm" if kind.endswith("-lm") else "classify"
    model = family.build(config, task, ShardLayout.single(family.sizes(config)), group or TPGroup.single(),
                         dropout=0.0)
    return materialize(model, SafetensorsSource(ckpt))


def test_row_ranges_follow_the_shares_in_rank_order() -> None:
    shares = [2, 0, 3]
    assert [row_range(shares, r) for r in range(3)] == [(0, 2), (2, 2), (2, 5)]
    with pytest.raises(ValueError, match="rank 3 outside a data-parallel group of 3 shares"):
        row_range(shares, 3)
    with pytest.raises(ValueError, match=r"non-negative integers, got \[2, -1, 4\]"):
        row_range([2, -1, 4], 0)


def test_rows_of_cuts_every_tensor_and_gives_none_for_share_zero() -> None:
    b = _batch("bert-cls")
    mine = rows_of(b, [2, 0, 3], 2)
    assert torch.equal(mine.input_ids, b.input_ids[2:5]) and torch.equal(mine.labels, b.labels[2:5])
    assert torch.equal(mine.token_type_ids, b.token_type_ids[2:5])
    assert rows_of(b, [2, 0, 3], 1) is None
    with pytest.raises(ValueError, match=r"shares \[2, 2\] sum to 4 rows, but the batch has 5"):
        rows_of(b, [2, 2], 0)


def test_target_count_is_rows_or_shifted_target_tokens() -> None:
    cls = _batch("bert-cls")
    assert target_count(cls, "classify") == 5
    lm = _batch("gpt2-lm")
    expected = int((lm.labels[:, 1:] != -100).sum())
    assert target_count(lm, "causal-lm") == expected < 5 * 9  # padding removed some targets
    assert target_count(None, "causal-lm") == 0


@pytest.mark.parametrize("kind", ["gpt2-lm", "llama-cls"])
def test_the_parts_of_any_split_sum_to_the_whole_batch(kind, tmp_path) -> None:
    """What makes data parallelism exact: the ranks' losses and gradients add up to the whole
    batch's mean, whatever the shares (a per-rank mean weighted by rows would not, for an LM)."""
    model = _model(kind, tmp_path)
    b = _batch(kind)
    task = model.task
    whole = model(b.input_ids, b.attention_mask, b.labels, b.token_type_ids)
    whole.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    shares, total, parts = [1, 0, 3, 1], target_count(b, task), []
    for r in range(len(shares)):
        rows = rows_of(b, shares, r)
        if rows is not None:
            part = share_loss(model, rows, total)
            part.backward()
            parts.append(part.detach())
    assert torch.stack(parts).sum().item() == pytest.approx(whole.item(), rel=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="target count must be an integer >= 1, got 0"):
        share_loss(model, b, 0)


def test_a_lone_data_parallel_rank_trains_its_rows_without_ddp(tmp_path) -> None:
    model = _model("gpt2-lm", tmp_path)
    dp = DataParallel(model, TPGroup.single())
    b = _batch("gpt2-lm")
    part = dp.forward_backward(b, target_count(b, "causal-lm"))
    assert dp.global_loss(part) == pytest.approx(float(part))
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad(set_to_none=True)
    dp.forward_backward(None, 1)  # share 0: exact zero gradients on every trainable tensor
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_data_parallel_refuses_what_it_cannot_train(tmp_path) -> None:
    model = _model("gpt2-lm", tmp_path)
    with pytest.raises(ValueError, match="a rank run alone has no gradient to share"):
        DataParallel(model, TPGroup.alone(3, 1))
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        DataParallel(model, TPGroup.single())
    config = json.loads((tmp_path / "gpt2-lm" / "config.json").read_text())
    family = family_for(config)
    meta = family.build(config, "causal-lm", ShardLayout.single(family.sizes(config)), TPGroup.single())
    with pytest.raises(ValueError, match="materialize the model before wrapping it"):
        DataParallel(meta, TPGroup.single())
    with pytest.raises(ValueError, match="gradient sync mode must be one of"):
        GradSync(TPGroup.single(), "eager")
    assert GradSync(TPGroup.single()).mode == "overlap"  # a wall clock overlaps the all-reduce
