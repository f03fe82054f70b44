"""Overlap on (`TPGroup.overlap`: the input-gradient all-reduces launched asynchronously beside the
weight-gradient GEMMs, `node/tp/overlap.py`) meets the same bar as overlap off: full fine-tuning
against transformers (one step: loss, logits, every gradient, AdamW; test_equivalence's checks and
tolerances) and LoRA against peft (20 fp32 steps; test_lora's), on lopsided layouts with N = 2..3
(ranks with 0 units of a kind included), for GPT-2, BERT, RoBERTa, LLaMA (GQA and MHA), Qwen2,
Qwen3 (q/k norms riding in the region's all-reduce); with chunking too (`TPGroup.chunks`:
2 or 3 chunks of the batch's 3 rows, each chunk's all-reduces launched while the next chunk
computes, in forward and backward: `overlap.run_chunked`, `overlap._Tape`). Each case also shows that the overlapped path ran: every backward region
all-reduce, and every chunk's forward reduce, was launched asynchronously; chunking adds only the
chunks' own forward reduces."""

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
# (kind, units per rank head-tied or None: MIXED[N]'s layout, chunks of the batch's 3 rows)
FULL = {2: [("gpt2-lm", (1, 3), 1), ("bert-cls", (3, 1), 1), ("llama-gqa-lm", None, 1),
            ("gpt2-cls", (0, 4), 3), ("llama-mha-lm", None, 2), ("roberta-cls", None, 2)],
        3: [("gpt2-lm", None, 1), ("qwen3-lm", None, 1), ("llama-cls", (1, 0, 1), 1),
            ("qwen2-lm", None, 3), ("bert-cls", (0, 2, 2), 2)]}
LORA = {2: [("llama-gqa-lm", 1), ("qwen3-cls", 2)], 3: [("gpt2-lm", 1), ("bert-cls", 3)]}
LAYERS = 2  # transformer blocks of every test checkpoint (ckpts.py)


def _phases(cases: list[dict], n_of) -> list:
    return [[{"ranks": list(ranks), "cases": [c for c in cases if n_of(c) == n]} for ranks, n in phase]
            for phase in PHASES]


@pytest.fixture(scope="module")
def full_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap-full")
    refs, cases = {}, {}
    for n, entries in FULL.items():
        for kind, units, chunks in entries:
            if kind not in refs:
                ckpt = make_checkpoint(kind, root / kind)
                batch = make_batch(kind)
                save_file(batch, str(root / f"{kind}-batch.safetensors"))
                refs[kind] = (ckpt, hf_reference(ckpt, task_of(kind), batch))
            lay = dict(MIXED[n])[kind] if units is None else None
            cid = full_id(kind, n, units, chunks)
            cases[cid] = {"id": cid, "kind": kind, "ckpt": str(refs[kind][0]), "task": task_of(kind),
                          "units": list(lay[0] if units is None else units),
                          "batch": str(root / f"{kind}-batch.safetensors"), "overlap": True, "chunks": chunks}
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
        for kind, chunks in kinds:
            targets = TARGETS[family_of(kind)]
            ckpt = make_checkpoint(kind, root / kind / "base")
            model = peft_model(ckpt, kind, targets)
            start = start_checkpoint(model, ckpt, root / kind / "all")
            refs[(kind, targets)] = peft_reference(model, kind)
            cid = f"{kind}-N{n}-overlap-c{chunks}"
            cases[cid] = {"chunks": chunks, "id": cid, "kind": kind, "n": n, "task": task_of(kind), "ckpt": str(ckpt),
                          "start": str(start), "targets": list(targets), "layout": layout_of(kind, n),
                          "key": [kind, list(targets)], "overlap": True}
    torch.set_num_threads(threads)
    out = root / "out"
    run_world(HERE / "lora_worker.py", 3, {"phases": _phases(list(cases.values()), lambda c: c["n"])}, out,
              timeout=600)
    return out, refs, cases


def launched(chunks: int, lm: bool) -> int:
    """Asynchronous all-reduces of one step: every column region's input gradient (attention and
    MLP of every block, per chunk; the LM head's, unchunked) and, with chunks, every chunk's
    forward reduce (attention and MLP of every block)."""
    regions = 2 * LAYERS * chunks
    return regions + (1 if lm else 0) + (regions if chunks > 1 else 0)


def _infos(out: Path, cid: str, n: int) -> list[dict]:
    return [json.loads((out / f"{cid}.rank{r}.json").read_text()) for r in range(n)]


def full_id(kind: str, n: int, units: tuple[int, ...] | None, chunks: int) -> str:
    return case_id(kind, dict(MIXED[n])[kind] if units is None else units) + f"-overlap-c{chunks}"


FULL_IDS = [full_id(k, n, u, c) for n, es in FULL.items() for k, u, c in es]
LORA_IDS = [f"{k}-N{n}-overlap-c{c}" for n, ks in LORA.items() for k, c in ks]


@pytest.mark.parametrize("cid", FULL_IDS)
def test_full_fine_tuning_with_overlap_matches_transformers(full_world, cid):
    out, refs, cases = full_world
    assert_matches_transformers(out, refs, cases, cid)  # also: no collective added (its tag count)
    case = cases[cid]
    lm = case["task"] == "causal-lm"
    for info in _infos(out, cid, len(case["units"])):
        assert info["launched"] == launched(case["chunks"], lm), info


@pytest.mark.parametrize("cid", LORA_IDS)
def test_lora_with_overlap_matches_peft_over_20_steps(lora_world, cid):
    out, refs, cases = lora_world
    refs = {(k, tuple(t)): v for (k, t), v in refs.items()}
    assert_matches_peft(out, refs, cases, cid)
    case = cases[cid]
    lm = case["task"] == "causal-lm"
    c = case["chunks"]
    for info in _infos(out, cid, case["n"]):
        assert info["launched"] == STEPS * launched(c, lm), info
        per = 2 * LAYERS * c  # per kind and block: each chunk's forward reduce and backward all-reduce
        assert info["tags"] == {"attn": per, "mlp": per, "vocab": 1 + (4 if lm else 0)}, info["tags"]
        assert info["frozen_grads"] == 0 and info["rep_diff"] == 0.0, info
