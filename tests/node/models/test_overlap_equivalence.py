"""Overlap on (`TPGroup.overlap`: the input-gradient all-reduces launched asynchronously beside the
weight-gradient GEMMs, `node/tp/overlap.py`) meets the same bar as overlap off: full fine-tuning
against transformers (one step: loss, logits, every gradient, AdamW; test_equivalence's checks and
tolerances) and LoRA against peft (20 fp32 steps; test_lora's), on lopsided layouts with N = 2..3
(ranks with 0 units of a kind included), for GPT-2, BERT, LLaMA (GQA), Qwen3 (q/k norms riding in
the region's all-reduce). Each case also shows that the overlapped path ran: every backward region
all-reduce was launched asynchronously, and no collective was added."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpts import hf_reference, make_batch, make_checkpoint, task_of
from lora_ref import STEPS, TARGETS, family_of, peft_model, peft_reference, start_checkpoint
from safetensors.torch import save_file
from test_equivalence import MIXED, assert_matches_transformers, case_id
from test_lora import assert_matches_peft, layout_of
from tp_world import run_world

HERE = Path(__file__).parent
PHASES = [[((0, 1), 2)], [((0, 1, 2), 3)]]
# full fine-tuning: (kind, units per rank) head-tied, or a MIXED layout (per kind) by N
FULL = {2: [("gpt2-lm", (1, 3)), ("bert-cls", (3, 1)), ("llama-gqa-lm", None)],
        3: [("gpt2-lm", None), ("qwen3-lm", None), ("llama-cls", (1, 0, 1))]}
LORA = {2: ["llama-gqa-lm", "qwen3-cls"], 3: ["gpt2-lm", "bert-cls"]}
LAYERS = 2  # transformer blocks of every test checkpoint (ckpts.py)


def _phases(cases: list[dict], n_of) -> list:
    return [[{"ranks": list(ranks), "cases": [c for c in cases if n_of(c) == n]} for ranks, n in phase]
            for phase in PHASES]


@pytest.fixture(scope="module")
def full_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap-full")
    refs, cases = {}, {}
    for n, entries in FULL.items():
        for kind, units in entries:
            if kind not in refs:
                ckpt = make_checkpoint(kind, root / kind)
                batch = make_batch(kind)
                save_file(batch, str(root / f"{kind}-batch.safetensors"))
                refs[kind] = (ckpt, hf_reference(ckpt, task_of(kind), batch))
            lay = dict(MIXED[n])[kind] if units is None else None
            cid = case_id(kind, lay if units is None else units) + "-overlap"
            cases[cid] = {"id": cid, "kind": kind, "ckpt": str(refs[kind][0]), "task": task_of(kind),
                          "units": list(lay[0] if units is None else units),
                          "batch": str(root / f"{kind}-batch.safetensors"), "overlap": True}
            if units is None:
                cases[cid]["layout"] = dict(zip(("attn", "mlp", "vocab"), map(list, lay)))
    out = root / "out"
    run_world(HERE / "equiv_worker.py", 3, {"phases": _phases(list(cases.values()), lambda c: len(c["units"]))},
              out, timeout=600)
    return out, {k: ref for k, (_, ref) in refs.items()}, cases


@pytest.fixture(scope="module")
def lora_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap-lora")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    refs, cases = {}, {}
    for n, kinds in LORA.items():
        for kind in kinds:
            targets = TARGETS[family_of(kind)]
            ckpt = make_checkpoint(kind, root / kind / "base")
            model = peft_model(ckpt, kind, targets)
            start = start_checkpoint(model, ckpt, root / kind / "all")
            refs[(kind, targets)] = peft_reference(model, kind)
            cid = f"{kind}-N{n}-overlap"
            cases[cid] = {"id": cid, "kind": kind, "n": n, "task": task_of(kind), "ckpt": str(ckpt),
                          "start": str(start), "targets": list(targets), "layout": layout_of(kind, n),
                          "key": [kind, list(targets)], "overlap": True}
    torch.set_num_threads(threads)
    out = root / "out"
    run_world(HERE / "lora_worker.py", 3, {"phases": _phases(list(cases.values()), lambda c: c["n"])}, out,
              timeout=600)
    return out, refs, cases


def _infos(out: Path, cid: str, n: int) -> list[dict]:
    return [json.loads((out / f"{cid}.rank{r}.json").read_text()) for r in range(n)]


FULL_IDS = [case_id(k, dict(MIXED[n])[k] if u is None else u) + "-overlap" for n, es in FULL.items() for k, u in es]


@pytest.mark.parametrize("cid", FULL_IDS)
def test_full_fine_tuning_with_overlap_matches_transformers(full_world, cid):
    out, refs, cases = full_world
    assert_matches_transformers(out, refs, cases, cid)  # also: no collective added (its tag count)
    case = cases[cid]
    lm = case["task"] == "causal-lm"
    for info in _infos(out, cid, len(case["units"])):
        # every region's input-gradient all-reduce (attention, MLP per block; the LM head) overlapped
        assert info["launched"] == 2 * LAYERS + (1 if lm else 0), info


@pytest.mark.parametrize("cid", [f"{k}-N{n}-overlap" for n, ks in LORA.items() for k in ks])
def test_lora_with_overlap_matches_peft_over_20_steps(lora_world, cid):
    out, refs, cases = lora_world
    refs = {(k, tuple(t)): v for (k, t), v in refs.items()}
    assert_matches_peft(out, refs, cases, cid)
    case = cases[cid]
    lm = case["task"] == "causal-lm"
    for info in _infos(out, cid, case["n"]):
        assert info["launched"] == STEPS * (2 * LAYERS + (1 if lm else 0)), info
        assert info["tags"] == {"attn": 4, "mlp": 4, "vocab": 1 + (4 if lm else 0)}, info["tags"]
        assert info["frozen_grads"] == 0 and info["rep_diff"] == 0.0, info
