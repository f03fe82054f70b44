"""Sharded == transformers: loss, logits, the gradient of every parameter, one AdamW step.

Each world size N runs several (family, task, layout) cases in ONE spawned Gloo world; layouts are
deliberately lopsided and include ranks with 0 units and ranks with all but one unit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpts import LR, hf_reference, make_batch, make_checkpoint, task_of
from safetensors.torch import load_file, save_file
from equiv_worker import run_case
from tp_world import run_world

from xronos.node.tp.group import TPGroup

WORKER = Path(__file__).with_name("equiv_worker.py")

# kind -> units per rank. H = 4 for all but the GQA LLaMAs (H = num_key_value_heads = 2).
WORLDS: dict[int, list[tuple[str, tuple[int, ...]]]] = {
    1: [("gpt2-lm", (4,)), ("gpt2-cls", (4,)), ("bert-cls", (4,)), ("roberta-cls", (4,)),
        ("llama-gqa-lm", (2,)), ("llama-mha-lm", (4,)), ("llama-cls", (2,))],
    2: [("gpt2-lm", (1, 3)), ("gpt2-cls", (0, 4)), ("bert-cls", (3, 1)), ("roberta-cls", (2, 2)),
        ("llama-gqa-lm", (1, 1)), ("llama-mha-lm", (3, 1)), ("llama-cls", (0, 2))],
    3: [("gpt2-lm", (0, 3, 1)), ("gpt2-cls", (1, 2, 1)), ("bert-cls", (0, 2, 2)), ("roberta-cls", (1, 3, 0)),
        ("llama-gqa-lm", (0, 1, 1)), ("llama-mha-lm", (1, 2, 1)), ("llama-cls", (1, 0, 1))],
    4: [("gpt2-lm", (1, 1, 1, 1)), ("gpt2-cls", (2, 0, 1, 1)), ("bert-cls", (1, 1, 1, 1)),
        ("roberta-cls", (0, 0, 3, 1)), ("llama-gqa-lm", (0, 1, 0, 1)), ("llama-mha-lm", (0, 1, 1, 2))],
    5: [("gpt2-lm", (1, 1, 0, 1, 1)), ("bert-cls", (0, 1, 1, 1, 1)), ("roberta-cls", (1, 0, 1, 1, 1)),
        ("llama-gqa-lm", (1, 0, 0, 1, 0)), ("llama-mha-lm", (0, 1, 1, 1, 1)), ("llama-cls", (0, 0, 1, 0, 1))],
}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """kind -> (checkpoint dir, batch file, transformers reference), built once per module."""
    root = tmp_path_factory.mktemp("equiv")
    cache: dict[str, tuple[Path, Path, dict[str, torch.Tensor]]] = {}

    def get(kind: str):
        if kind not in cache:
            ckpt = make_checkpoint(kind, root / kind)
            batch = make_batch(kind)
            batch_file = root / f"{kind}-batch.safetensors"
            save_file(batch, str(batch_file))
            cache[kind] = (ckpt, batch_file, hf_reference(ckpt, task_of(kind), batch))
        return cache[kind]

    return get


def max_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert got.shape == ref.shape, (got.shape, ref.shape)
    return (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)


def check_case(res: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], label: str) -> dict[str, float]:
    ours = {k for k in res if "/" in k}
    theirs = {k for k in ref if "/" in k}
    assert ours == theirs, f"{label}: parameter sets differ: {sorted(ours ^ theirs)[:8]}"
    errs = {"loss": max_rel_err(res["loss"], ref["loss"]), "logits": max_rel_err(res["logits"], ref["logits"])}
    for kind in ("grad", "exp_avg"):
        errs[kind] = max(max_rel_err(res[k], ref[k]) for k in ours if k.startswith(kind + "/"))
    # After one step the parameters moved by ~lr; compare the update itself against lr.
    errs["param"] = max((res[k] - ref[k]).abs().max().item() for k in ours if k.startswith("param/"))
    return errs


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_sharded_matches_transformers(world, prepared, tmp_path):
    cases = []
    refs = {}
    for i, (kind, units) in enumerate(WORLDS[world]):
        ckpt, batch_file, ref = prepared(kind)
        case_id = f"{kind}-{i}"
        cases.append({"id": case_id, "ckpt": str(ckpt), "task": task_of(kind), "units": list(units),
                      "batch": str(batch_file)})
        refs[case_id] = (ref, units)
    if world == 1:  # a world of one needs no processes: TPGroup.single(), in this process
        for case in cases:
            run_case(case, 0, TPGroup.single(), tmp_path)
    else:
        run_world(WORKER, world, {"cases": cases}, tmp_path)

    for case_id, (ref, units) in refs.items():
        label = f"{case_id} units={units}"
        res = load_file(str(tmp_path / f"{case_id}.safetensors"))
        errs = check_case(res, ref, label)
        print(label, {k: f"{v:.2e}" for k, v in errs.items()})
        assert errs["loss"] < 1e-5 and errs["logits"] < 1e-5, (label, errs)
        assert errs["grad"] < 1e-5 and errs["exp_avg"] < 1e-5, (label, errs)
        assert errs["param"] < 1e-2 * LR, (label, errs)  # Adam normalises tiny gradients
        for r in range(world):
            info = json.loads((tmp_path / f"{case_id}.rank{r}.json").read_text())
            assert info["loss"] == info["rank0_loss"], (label, r, info)
            assert info["replicated_grad_diff"] == 0.0, (label, r, info)
