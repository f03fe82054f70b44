"""Sharded == transformers: loss, logits, the gradient of every parameter, one AdamW step.

One 5-process Gloo world covers N = 1..5: in each phase disjoint subgroups run their cases
concurrently. Layouts are deliberately lopsided and include ranks with 0 units and ranks with all
but one unit: head-tied ones (`WORLDS`, the paper's unit) and mixed per-segment ones (`MIXED`:
attention units, MLP columns and vocabulary rows each cut on its own). Families: GPT-2, BERT,
RoBERTa, LLaMA (default, llama3, linear and dynamic RoPE), Qwen2, Qwen3. Also here: replicated
dropout agreeing across ranks, every collective tagged with its segment kind, slices streamed from
the owner (`STREAMED`), and exports that transformers loads with no Xronos code and that compute
the trained model's logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpts import LR, hf_reference, make_batch, make_checkpoint, task_of
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tp_world import run_world

WORKER = Path(__file__).with_name("equiv_worker.py")

# N -> (kind, units per rank). H = 4 except the GQA LLaMAs (H = num_key_value_heads = 2), MiniLM 12.
WORLDS: dict[int, list[tuple[str, tuple[int, ...]]]] = {
    1: [("gpt2-lm", (4,)), ("gpt2-cls", (4,)), ("bert-cls", (4,)), ("roberta-cls", (4,)),
        ("llama-gqa-lm", (2,)), ("llama-mha-lm", (4,)), ("llama-cls", (2,))],
    2: [("gpt2-lm", (1, 3)), ("gpt2-cls", (0, 4)), ("bert-cls", (3, 1)), ("roberta-cls", (2, 2)),
        ("llama-gqa-lm", (1, 1)), ("llama-mha-lm", (3, 1)), ("llama-cls", (0, 2))],
    3: [("gpt2-lm", (0, 3, 1)), ("gpt2-cls", (1, 2, 1)), ("bert-cls", (0, 2, 2)), ("roberta-cls", (1, 3, 0)),
        ("llama-gqa-lm", (0, 1, 1)), ("llama-mha-lm", (1, 2, 1)), ("llama-cls", (1, 0, 1)),
        ("minilm", (1, 10, 1))],
    4: [("gpt2-lm", (1, 1, 1, 1)), ("gpt2-cls", (2, 0, 1, 1)), ("bert-cls", (1, 1, 1, 1)),
        ("roberta-cls", (0, 0, 3, 1)), ("llama-gqa-lm", (0, 1, 0, 1)), ("llama-mha-lm", (0, 1, 1, 2))],
    5: [("gpt2-lm", (1, 1, 0, 1, 1)), ("bert-cls", (0, 1, 1, 1, 1)), ("roberta-cls", (1, 0, 1, 1, 1)),
        ("llama-gqa-lm", (1, 0, 0, 1, 0)), ("llama-mha-lm", (0, 1, 1, 1, 1)), ("llama-cls", (0, 0, 1, 0, 1))],
}
# The LLaMA-style variants (sizes attn/mlp/vocab: llama3-lm 2/40/103, llama-linear-cls 4/45/103,
# llama-dynamic-lm 2/51/103, qwen2-lm 2/51/103, qwen2-cls 2/45/103, qwen3-lm 2/50/103, qwen3-cls
# 4/45/103), head-tied and mixed (the same rules for the mixed ones), added to the same world.
VARIANT_WORLDS: dict[int, list[tuple[str, tuple[int, ...]]]] = {
    1: [("llama3-lm", (2,)), ("llama-linear-cls", (4,)), ("llama-dynamic-lm", (2,)), ("qwen2-lm", (2,)),
        ("qwen2-cls", (2,)), ("qwen3-lm", (2,)), ("qwen3-cls", (4,))],
    2: [("llama3-lm", (0, 2)), ("llama-linear-cls", (3, 1)), ("llama-dynamic-lm", (1, 1)), ("qwen2-lm", (2, 0)),
        ("qwen2-cls", (1, 1)), ("qwen3-lm", (0, 2)), ("qwen3-cls", (1, 3))],
    3: [("llama3-lm", (1, 0, 1)), ("llama-linear-cls", (0, 3, 1)), ("llama-dynamic-lm", (0, 1, 1)),
        ("qwen2-lm", (1, 1, 0)), ("qwen2-cls", (0, 1, 1)), ("qwen3-lm", (1, 0, 1)), ("qwen3-cls", (2, 0, 2))],
    4: [("llama3-lm", (0, 1, 1, 0)), ("qwen2-lm", (0, 1, 0, 1)), ("qwen3-lm", (1, 0, 0, 1)),
        ("qwen3-cls", (1, 1, 1, 1))],
    5: [("llama-dynamic-lm", (1, 0, 0, 0, 1)), ("qwen2-cls", (1, 0, 0, 1, 0)), ("qwen3-lm", (0, 1, 0, 0, 1))],
}
# N -> (kind, (attention units, MLP columns, vocabulary rows) per rank): every kind cut on its own.
# Sizes (attn, mlp, vocab): gpt2-lm 4/128/97, gpt2-cls 4/70/89, bert-cls and roberta-cls 4/50/101,
# llama-gqa-lm 2/51/103, llama-mha-lm 4/50/103, llama-cls 2/45/103, minilm 12/1536/30522. Every
# case has a rank with 0 attention units but MLP columns, a rank with attention units but 0
# vocabulary rows, and a rank that holds much of one kind and little or none of another (the
# splits are lopsided in opposite directions per kind). No quantum: the engine takes any cut.
Mixed = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
MIXED: dict[int, list[tuple[str, Mixed]]] = {
    2: [("gpt2-lm", ((0, 4), (100, 28), (97, 0))), ("gpt2-cls", ((4, 0), (6, 64), (0, 89))),
        ("bert-cls", ((0, 4), (45, 5), (101, 0))), ("roberta-cls", ((4, 0), (2, 48), (0, 101))),
        ("llama-gqa-lm", ((2, 0), (1, 50), (0, 103))), ("llama-mha-lm", ((0, 4), (50, 0), (103, 0))),
        ("llama-cls", ((0, 2), (40, 5), (103, 0)))],
    3: [("gpt2-lm", ((3, 0, 1), (5, 90, 33), (0, 17, 80))), ("gpt2-cls", ((0, 1, 3), (50, 20, 0), (89, 0, 0))),
        ("bert-cls", ((2, 0, 2), (0, 50, 0), (0, 1, 100))), ("roberta-cls", ((0, 4, 0), (20, 0, 30), (60, 0, 41))),
        ("llama-gqa-lm", ((0, 1, 1), (33, 18, 0), (103, 0, 0))), ("llama-mha-lm", ((0, 1, 3), (45, 5, 0), (53, 50, 0))),
        ("llama-cls", ((1, 1, 0), (0, 5, 40), (0, 50, 53))),
        ("minilm", ((0, 10, 2), (1024, 0, 512), (0, 30522, 0)))],
    4: [("gpt2-lm", ((1, 0, 3, 0), (60, 30, 1, 37), (10, 87, 0, 0))),
        ("gpt2-cls", ((0, 2, 0, 2), (30, 0, 40, 0), (0, 0, 80, 9))),
        ("bert-cls", ((1, 1, 0, 2), (10, 0, 35, 5), (50, 51, 0, 0))),
        ("roberta-cls", ((0, 3, 0, 1), (25, 0, 25, 0), (0, 0, 50, 51))),
        ("llama-cls", ((1, 0, 1, 0), (0, 30, 0, 15), (0, 0, 60, 43))),
        ("llama-gqa-lm", ((1, 0, 0, 1), (0, 20, 31, 0), (0, 3, 100, 0))),
        ("llama-mha-lm", ((2, 0, 1, 1), (0, 40, 5, 5), (0, 0, 3, 100)))],
    5: [("gpt2-lm", ((0, 1, 0, 2, 1), (40, 0, 50, 8, 30), (0, 0, 90, 7, 0))),
        ("bert-cls", ((0, 1, 1, 1, 1), (46, 1, 1, 1, 1), (0, 0, 0, 0, 101))),
        ("roberta-cls", ((1, 0, 2, 0, 1), (0, 25, 0, 25, 0), (0, 50, 0, 51, 0))),
        ("llama-gqa-lm", ((0, 0, 1, 0, 1), (10, 10, 1, 30, 0), (0, 20, 0, 83, 0))),
        ("llama-mha-lm", ((1, 1, 1, 1, 0), (0, 0, 0, 10, 40), (0, 0, 0, 0, 103))),
        ("llama-cls", ((0, 1, 0, 1, 0), (9, 0, 9, 0, 27), (20, 0, 20, 0, 63))),
        ("minilm", ((3, 0, 6, 0, 3), (0, 1024, 256, 256, 0), (30000, 0, 0, 0, 522)))],
}
VARIANT_MIXED: dict[int, list[tuple[str, Mixed]]] = {
    2: [("llama3-lm", ((2, 0), (0, 40), (0, 103))), ("qwen2-lm", ((2, 0), (1, 50), (0, 103))),
        ("qwen3-lm", ((0, 2), (50, 0), (103, 0))), ("qwen3-cls", ((0, 4), (40, 5), (103, 0)))],
    3: [("llama-linear-cls", ((1, 0, 3), (5, 40, 0), (0, 103, 0))),
        ("llama-dynamic-lm", ((0, 1, 1), (33, 18, 0), (3, 0, 100))),
        ("qwen2-lm", ((1, 0, 1), (0, 51, 0), (0, 50, 53))), ("qwen2-cls", ((0, 1, 1), (33, 12, 0), (103, 0, 0))),
        ("qwen3-lm", ((1, 1, 0), (0, 5, 45), (0, 50, 53))), ("qwen3-cls", ((0, 1, 3), (45, 0, 0), (53, 50, 0)))],
    4: [("qwen3-lm", ((1, 0, 1, 0), (0, 20, 0, 30), (0, 3, 100, 0)))],
    5: [("qwen2-lm", ((0, 0, 1, 0, 1), (10, 10, 1, 30, 0), (0, 20, 0, 83, 0))),
        ("qwen3-cls", ((1, 1, 0, 1, 1), (0, 0, 5, 0, 40), (0, 0, 0, 0, 103)))],
}
for _table, _extra in ((WORLDS, VARIANT_WORLDS), (MIXED, VARIANT_MIXED)):
    for _n, _cases in _extra.items():
        _table.setdefault(_n, []).extend(_cases)
EXPORTS = {("gpt2-lm", 3), ("gpt2-cls", 2), ("llama-gqa-lm", 2), ("llama-mha-lm", 4), ("bert-cls", 4),
           ("roberta-cls", 5), ("llama-cls", 5), ("minilm", 3), ("llama3-lm", 2), ("llama-linear-cls", 3),
           ("llama-dynamic-lm", 5), ("qwen2-lm", 3), ("qwen2-cls", 2), ("qwen3-lm", 4), ("qwen3-cls", 3)}
MIXED_EXPORTS = {("gpt2-lm", 4), ("gpt2-cls", 3), ("bert-cls", 5), ("roberta-cls", 2), ("llama-gqa-lm", 5),
                 ("llama-mha-lm", 2), ("llama-cls", 3), ("minilm", 5), ("llama3-lm", 2), ("qwen2-lm", 5),
                 ("qwen3-lm", 3), ("qwen3-cls", 2)}
DROPOUT = [("gpt2-lm", (0, 3, 1)), ("bert-cls", (2, 1, 1)), ("llama-cls", (0, 1, 1)),
           ("qwen3-lm", (0, 1, 1))]  # run with p = 0.1
MIXED_DROPOUT = [("llama-gqa-lm", ((0, 1, 1), (33, 18, 0), (103, 0, 0)))]
# Cases whose non-owner ranks get their slices streamed from rank 0 (xronos.node.rank.streaming), as a
# job's ranks do, instead of reading the checkpoint themselves.
STREAMED = {("llama3-lm", 2), ("qwen2-cls", 3), ("qwen3-lm", 3), ("qwen3-cls", 5)}
# phase -> subgroups (ranks, N); N = 1 runs on a lone rank with TPGroup.single()
PHASES = [[((0, 1), 2), ((2, 3, 4), 3)], [((0, 1, 2, 3), 4), ((4,), 1)], [((0, 1, 2, 3, 4), 5)]]


def case_id(kind: str, units: tuple[int, ...] | Mixed, dropout: bool = False) -> str:
    """`gpt2-lm-N3-0.3.1` (head-tied) or `gpt2-lm-N3-a3.0.1-m5.90.33-v0.17.80` (mixed)."""
    if isinstance(units[0], tuple):
        split = "-".join(k + ".".join(map(str, c)) for k, c in zip("amv", units))
        n = len(units[0])
    else:
        split, n = ".".join(map(str, units)), len(units)
    return f"{kind}-N{n}-{split}" + ("-dropout" if dropout else "")


ALL_CASES = [case_id(k, u) for n in WORLDS for k, u in WORLDS[n]]
MIXED_CASES = [case_id(k, lay) for n in MIXED for k, lay in MIXED[n]]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Run the whole world once: returns (results dir, kind -> reference, case id -> case)."""
    root = tmp_path_factory.mktemp("equiv")
    refs, batches, ckpts = {}, {}, {}
    kinds = {k for table in (WORLDS, MIXED) for cases in table.values() for k, _ in cases}
    for kind in sorted(kinds):
        ckpts[kind] = make_checkpoint(kind, root / kind)
        batch = make_batch(kind)
        batches[kind] = root / f"{kind}-batch.safetensors"
        save_file(batch, str(batches[kind]))
        refs[kind] = hf_reference(ckpts[kind], task_of(kind), batch)

    def case(kind: str, units: tuple[int, ...], dropout: bool = False) -> dict:
        return {"id": case_id(kind, units, dropout), "kind": kind, "ckpt": str(ckpts[kind]),
                "task": task_of(kind), "units": list(units), "batch": str(batches[kind]),
                "export": (kind, len(units)) in EXPORTS and not dropout, "dropout": 0.1 if dropout else 0.0,
                "stream": (kind, len(units)) in STREAMED}

    def mixed(kind: str, lay: Mixed, dropout: bool = False) -> dict:
        n = len(lay[0])
        return {"id": case_id(kind, lay, dropout), "kind": kind, "ckpt": str(ckpts[kind]),
                "task": task_of(kind), "units": list(lay[0]), "batch": str(batches[kind]),
                "layout": dict(zip(("attn", "mlp", "vocab"), map(list, lay))),
                "export": (kind, n) in MIXED_EXPORTS and not dropout, "dropout": 0.1 if dropout else 0.0,
                "stream": (kind, n) in STREAMED}

    phases, cases = [], {}
    for phase in PHASES:
        subs = []
        for ranks, n in phase:
            sub_cases = [case(k, u) for k, u in WORLDS[n]] + [mixed(k, lay) for k, lay in MIXED.get(n, [])]
            if n == 3:
                sub_cases += [case(k, u, dropout=True) for k, u in DROPOUT]
                sub_cases += [mixed(k, lay, dropout=True) for k, lay in MIXED_DROPOUT]
            cases.update((c["id"], c) for c in sub_cases)
            subs.append({"ranks": list(ranks), "cases": sub_cases})
        phases.append(subs)
    out = root / "out"
    run_world(WORKER, 5, {"phases": phases}, out, timeout=600)
    return out, refs, cases


def max_rel_err(got: torch.Tensor, ref: torch.Tensor, floor: float = 1e-6) -> float:
    assert got.shape == ref.shape, (got.shape, ref.shape)
    return (got - ref).abs().max().item() / max(ref.abs().max().item(), floor)


def worst_rel_err(res: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], prefix: str) -> float:
    """Max over tensors of the error relative to the tensor's scale, that scale floored at 1% of
    the model's largest: some gradients are 0 in exact arithmetic (a key bias shifts every score of
    a query equally) and hold only rounding noise, ~1e-10, on both sides."""
    keys = [k for k in ref if k.startswith(prefix)]
    floor = 1e-2 * max(ref[k].abs().max().item() for k in keys)
    return max(max_rel_err(res[k], ref[k], floor) for k in keys)


def rank_infos(out: Path, cid: str, n: int) -> list[dict]:
    return [json.loads((out / f"{cid}.rank{r}.json").read_text()) for r in range(n)]


@pytest.mark.parametrize("cid", ALL_CASES + MIXED_CASES)
def test_sharded_matches_transformers(world, cid):
    assert_matches_transformers(*world, cid)


def assert_matches_transformers(out: Path, refs: dict, cases: dict, cid: str) -> None:
    """The case's results against transformers' (also test_overlap_equivalence's bar)."""
    case = cases[cid]
    ref = refs[case["kind"]]
    res = load_file(str(out / f"{cid}.safetensors"))
    ours, theirs = {k for k in res if "/" in k}, {k for k in ref if "/" in k}
    assert ours == theirs, f"parameter sets differ: {sorted(ours ^ theirs)[:8]}"
    errs = {"loss": max_rel_err(res["loss"], ref["loss"]), "logits": max_rel_err(res["logits"], ref["logits"])}
    for kind in ("grad", "exp_avg"):  # every parameter, consolidated under its HF name
        errs[kind] = worst_rel_err(res, ref, kind + "/")
    # One AdamW step moves each weight by ~lr * g / (|g| + eps): where |g| is near eps (gradients
    # that are 0 in exact arithmetic hold rounding noise) the direction is arbitrary on both sides,
    # so the step is compared where it is well-conditioned (|g| > 100 eps) and only bounded elsewhere.
    errs["param"] = errs["param_any"] = 0.0
    for k in (k for k in ours if k.startswith("param/")):
        diff = (res[k] - ref[k]).abs()
        well = ref["grad/" + k.removeprefix("param/")].abs() > 1e-6
        errs["param"] = max(errs["param"], diff[well].max().item() if well.any() else 0.0)
        errs["param_any"] = max(errs["param_any"], diff.max().item())
    print(cid, {k: f"{v:.1e}" for k, v in errs.items()})
    assert errs["loss"] < 1e-5 and errs["logits"] < 1e-5, errs
    assert errs["grad"] < 1e-5 and errs["exp_avg"] < 1e-5, errs
    assert errs["param"] < 1e-3 * LR and errs["param_any"] <= 2 * LR, errs
    for info in rank_infos(out, cid, len(case["units"])):
        assert info["loss"] == info["rank0_loss"], info  # every rank computes the same loss
        assert info["replicated_grad_diff"] == 0.0, info  # replicated grads agree bit for bit
        if len(case["units"]) > 1:  # forward + backward: one all-reduce each way per partitioned layer
            layers = 6 if case["kind"] == "minilm" else 2
            lm = 4 if case["task"] == "causal-lm" else 0  # LM-head copy + 3 in the cross-entropy
            # (Qwen3's q/k norm gradients share the attention input's all-reduce: no extra one.)
            # Forward chunking (test_overlap_equivalence) runs each chunk's rows through the blocks on
            # their own: one all-reduce each way per partitioned layer and chunk.
            per = 2 * case.get("chunks", 1)
            assert info["tags"] == {"attn": per * layers, "mlp": per * layers, "vocab": 1 + lm}, info["tags"]


@pytest.mark.parametrize("kind,units", DROPOUT + MIXED_DROPOUT)
def test_replicated_dropout_is_identical_on_every_rank(world, kind, units):
    out, refs, _ = world
    n = len(units[0]) if isinstance(units[0], tuple) else len(units)
    infos = rank_infos(out, case_id(kind, units, dropout=True), n)
    assert all(i["loss"] == infos[0]["rank0_loss"] for i in infos), infos
    assert all(i["replicated_grad_diff"] == 0.0 for i in infos), infos
    assert abs(infos[0]["loss"] - refs[kind]["loss"].item()) > 1e-4  # dropout was active


@pytest.mark.parametrize("kind,n,split", [(k, n, "tied") for k, n in sorted(EXPORTS)]
                         + [(k, n, "mixed") for k, n in sorted(MIXED_EXPORTS)])
def test_export_loads_in_plain_transformers(world, kind, n, split):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    out, _, cases = world
    cid = next(c for c, case in cases.items() if case["kind"] == kind and len(case["units"]) == n
               and case["export"] and ("layout" in case) == (split == "mixed"))
    export = out / f"{cid}-export"
    config = json.loads((export / "config.json").read_text())
    auto = AutoModelForCausalLM if task_of(kind) == "causal-lm" else AutoModelForSequenceClassification
    model = auto.from_pretrained(export)
    assert type(model).__name__ == config["architectures"][0]
    res = load_file(str(out / f"{cid}.safetensors"))
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), res[f"param/{name}"]), name
    # ... and it computes what the trained sharded model computes.
    batch = load_file(cases[cid]["batch"])
    model.eval()
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    err = max_rel_err(logits, res["logits_after"])
    print(cid, f"export logits {err:.1e}")
    assert err < 1e-5, err
    with safe_open(str(export / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    tied = config.get("tie_word_embeddings", task_of(kind) == "causal-lm" and kind.startswith("gpt2"))
    if task_of(kind) == "causal-lm":
        assert ("lm_head.weight" in keys) == (not tied)  # tied heads stored once, as save_pretrained does
    if kind == "minilm":
        for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json"):
            assert (export / name).is_file()
