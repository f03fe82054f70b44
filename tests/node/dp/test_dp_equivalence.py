"""Data parallelism with uneven batch shares == transformers (+ peft) on one device, over 20 fp32 steps.

Each rank holds a whole replica (full fine-tune, or LoRA: the frozen base and peft's adapters) in
torch's DistributedDataParallel over the case's own Gloo subgroup of a 5-process world, and takes
its rows of each global batch of 7 (shares lopsided, a rank with 0 rows in most cases — rank 0
among them). The rows hold different numbers of target tokens (padding), so only a loss weighted
by the global token count gives the single device's gradient. Compared, as test_lora compares TP:
the loss of every step, logits before and after, every trained tensor's gradient at the first and
last step, the parameters and AdamW moments at the end. Also: every rank ends with the same model
and optimizer state bit for bit, the frozen base gets no gradient and does not move, every step
all-reduced gradient buckets on every rank (share 0 included), and the `clocked` mode put each
bucket's all-reduce on the group's timeline. And DP×TP meshes (`MESH`): two TP groups of two ranks,
each at the same lopsided per-segment layout, data-parallel with each other through the same
`DataParallel` over the groups of same-place ranks (no default group involved).

`make test` runs a representative set (`FAST`); XRONOS_DP_FULL=1 runs the whole matrix: every
family, full and LoRA, N = 1..5 (`FULL`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from ckpts import KINDS, _configs, make_batch, make_checkpoint, task_of
from lora_ref import LR, MAX_GRAD_NORM, STEPS, TARGETS, family_of, hf_model, peft_model, plain_name, start_checkpoint
from safetensors.torch import load_file, save_file
from test_equivalence import MIXED, PHASES, max_rel_err, worst_rel_err
from test_lora import MAX_ABS, MAX_REL, norm_rel
from tp_world import run_world

from ckpts import WEIGHT_DECAY

WORKER = Path(__file__).with_name("dp_worker.py")
B, S, N_BATCHES = 7, 12, 4

# Rows of the global batch (7) per rank: lopsided, a 0 share for N >= 3 (at rank 0 in some).
SHARES: dict[int, list[tuple[int, ...]]] = {
    1: [(7,)],
    2: [(2, 5), (0, 7), (6, 1)],
    3: [(4, 0, 3), (0, 6, 1), (1, 1, 5)],
    4: [(1, 5, 0, 1), (0, 0, 3, 4), (2, 2, 0, 3)],
    5: [(2, 0, 1, 3, 1), (0, 1, 4, 0, 2), (1, 0, 0, 0, 6)],
}
# (kind, N, LoRA?, shares, gradient sync mode): GPT-2 full with a 0 share, LLaMA LoRA, BERT
# classification lopsided; a 0 share on rank 0, Qwen LoRA through the clock, a lone rank.
FAST = [("gpt2-lm", 3, False, (4, 0, 3), "overlap"), ("llama-gqa-lm", 2, True, (2, 5), "overlap"),
        ("qwen3-cls", 2, True, (0, 7), "clocked"), ("bert-cls", 4, False, (1, 5, 0, 1), "overlap"),
        ("gpt2-cls", 1, True, (7,), "overlap"), ("qwen2-lm", 5, True, (2, 0, 1, 3, 1), "clocked")]
FULL = [(kind, n, lora, SHARES[n][i % len(SHARES[n])], ("overlap", "clocked")[(i + lora) % 2])
        for i, kind in enumerate(KINDS) for n in SHARES for lora in (False, True)]
CASES = FULL if os.environ.get("XRONOS_DP_FULL") == "1" else FAST
# DP×TP meshes of 4 ranks: two TP groups of two (the same lopsided per-segment layout in both:
# test_equivalence's MIXED), data-parallel with each other at uneven shares, one group at 0.
MESH = [("gpt2-lm", False, (5, 2), "overlap"), ("llama-gqa-lm", True, (0, 7), "clocked"),
        ("bert-cls", True, (6, 1), "overlap")]
# These tiny models' gradients fit DDP's first bucket (1 MiB); these cases cut them into several
# buckets (20 kB for a full fine-tune, 4 kB for adapters), so that every rank, share 0 too, issues
# several all-reduces per step in DDP's order (in the full matrix: about half the cases).
SMALL_BUCKETS = {"gpt2-lm-full-N3-4.0.3-overlap", "qwen2-lm-lora-N5-2.0.1.3.1-clocked",
                 "llama-gqa-lm-lora-mesh2x2-0.7-clocked", "gpt2-lm-full-mesh2x2-5.2-overlap"}
MESH_TP = 2


def case_id(kind: str, n: int, lora: bool, shares: tuple[int, ...], sync: str) -> str:
    return f"{kind}-{'lora' if lora else 'full'}-N{n}-{'.'.join(map(str, shares))}-{sync}"


def mesh_id(kind: str, lora: bool, shares: tuple[int, ...], sync: str) -> str:
    return f"{kind}-{'lora' if lora else 'full'}-mesh{len(shares)}x{MESH_TP}-{'.'.join(map(str, shares))}-{sync}"


def dp_batch(kind: str, seed: int) -> dict[str, torch.Tensor]:
    """make_batch's 7 rows with more right padding on most rows: their target counts differ."""
    batch = make_batch(kind, B=B, S=S, seed=seed)
    mask = batch["attention_mask"]
    for r in range(2, B):  # rows 0 and 1 are padded by make_batch already
        pad = (3 * r + seed) % 6
        if pad:
            mask[r, S - pad:] = 0
    pad = _configs()[kind][1].pad_token_id  # as make_batch pads
    batch["input_ids"] = batch["input_ids"].masked_fill(mask == 0, 0 if pad is None else pad)
    if task_of(kind) == "causal-lm":
        batch["labels"] = batch["input_ids"].masked_fill(mask == 0, -100)
    return batch


def reference(model, batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """transformers (+ peft) on one device, the whole batch each step: as lora_ref.peft_reference,
    on these batches."""
    trained = {plain_name(n): p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(trained.values(), lr=LR, weight_decay=WEIGHT_DECAY)
    ref: dict[str, torch.Tensor] = {}
    model.train()
    inputs = {k: v for k, v in batches[0].items() if k != "labels"}
    with torch.no_grad():
        ref["logits_before"] = model(**inputs).logits
    for step in range(STEPS):
        loss = model(**batches[step % len(batches)]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained.values(), MAX_GRAD_NORM)
        ref[f"loss/{step}"] = loss.detach().reshape(1)
        if step in (0, STEPS - 1):
            ref.update((f"{'grad0' if step == 0 else 'grad'}/{n}", p.grad.clone()) for n, p in trained.items())
        opt.step()
        opt.zero_grad(set_to_none=True)
    ref.update((f"param/{n}", p.detach().clone()) for n, p in trained.items())
    ref.update((f"exp_avg/{n}", opt.state[p]["exp_avg"].clone()) for n, p in trained.items())
    with torch.no_grad():
        ref["logits"] = model(**inputs).logits
    return ref


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only contend
    refs, starts, cases = {}, {}, {}
    mesh = [(kind, len(shares) * MESH_TP, lora, shares, sync) for kind, lora, shares, sync in MESH]
    for kind, n, lora, shares, sync in CASES + mesh:
        key = (kind, lora)
        if key not in refs:
            base = root / kind / "base"
            if not base.exists():
                make_checkpoint(kind, base)
                batches = [dp_batch(kind, s) for s in range(N_BATCHES)]
                save_file({f"b{i}/{k}": v for i, b in enumerate(batches) for k, v in b.items()},
                          str(root / kind / "batches.safetensors"))
            batches = [dp_batch(kind, s) for s in range(N_BATCHES)]
            if lora:
                model = peft_model(base, kind, TARGETS[family_of(kind)])
                starts[key] = start_checkpoint(model, base, root / kind / "lora")
            else:
                model, starts[key] = hf_model(base, task_of(kind)), base
            refs[key] = reference(model, batches)
        meshed = len(shares) != n
        cid = mesh_id(kind, lora, shares, sync) if meshed else case_id(kind, n, lora, shares, sync)
        cases[cid] = {"id": cid, "kind": kind, "n": n, "task": task_of(kind), "start": str(starts[key]),
                      "targets": list(TARGETS[family_of(kind)]) if lora else None, "shares": list(shares),
                      "sync": sync, "batches": str(root / kind / "batches.safetensors"), "lora": lora}
        if cid in SMALL_BUCKETS or (CASES is FULL and n > 1 and sum(map(ord, cid)) % 2):
            cases[cid]["bucket_cap_mb"] = 0.004 if lora else 0.02
        if meshed:
            lay = dict(MIXED[MESH_TP])[kind]
            cases[cid].update(mesh_tp=MESH_TP, layout=dict(zip(("attn", "mlp", "vocab"), map(list, lay))))
    phases = [[{"ranks": list(ranks), "cases": [c for c in cases.values() if c["n"] == len(ranks)]}
               for ranks, _ in phase] for phase in PHASES]
    torch.set_num_threads(threads)
    run_world(WORKER, 5, {"phases": phases}, root / "out", timeout=900)
    return root / "out", refs, cases


def infos(out: Path, case: dict) -> list[dict]:
    return [json.loads((out / f"{case['id']}.rank{r}.json").read_text()) for r in range(case["n"])]


IDS = [case_id(*c) for c in CASES] + [mesh_id(*m) for m in MESH]


@pytest.mark.slow
@pytest.mark.parametrize("cid", IDS)
def test_data_parallel_matches_single_device(world, cid):
    out, refs, cases = world
    case = cases[cid]
    ref = refs[(case["kind"], case["lora"])]
    res = load_file(str(out / f"{cid}.safetensors"))
    assert {k for k in res if "/" in k} == {k for k in ref if "/" in k}
    # The engine contract, as test_lora holds TP to it: the first step (identical weights) per
    # tensor, then after 20 steps max abs <= 5e-4 and ||diff|| / ||ref|| <= 1e-5; the last step's
    # gradients and the first moment get 10x the relative bound (test_lora says why).
    errs = {"loss": max(max_rel_err(res[k], ref[k]) for k in ref if k.startswith("loss/")),
            "grad0": worst_rel_err(res, ref, "grad0/")}
    abs_errs = {}
    for what in ("logits", "grad", "exp_avg", "param"):
        keys = [k for k in ref if k == what or k.startswith(what + "/") or k == f"{what}_before"]
        errs[what] = norm_rel(res, ref, keys)
        abs_errs[what] = max((res[k] - ref[k]).abs().max().item() for k in keys)
    print(cid, {k: f"{v:.1e}" for k, v in {**errs, **{f"abs_{k}": v for k, v in abs_errs.items()}}.items()})
    assert errs.pop("grad") < 10 * MAX_REL, errs
    assert errs.pop("exp_avg") < 10 * MAX_REL, errs
    assert all(v < MAX_REL for v in errs.values()), errs
    assert all(v < MAX_ABS for v in abs_errs.values()), abs_errs
    # The check can fail: training moved the trained tensors far beyond the tolerance.
    start = load_file(str(Path(case["start"]) / "model.safetensors"))
    moved = max((ref[k] - start[k.removeprefix("param/")]).abs().max().item()
                for k in ref if k.startswith("param/") and k.removeprefix("param/") in start)
    assert moved > 20 * MAX_ABS, moved


@pytest.mark.slow
@pytest.mark.parametrize("cid", IDS)
def test_replicas_stay_one_model_and_every_rank_joins_every_all_reduce(world, cid):
    out, refs, cases = world
    case = cases[cid]
    trained = sorted(k.removeprefix("param/") for k in refs[(case["kind"], case["lora"])] if k.startswith("param/"))
    for r, info in enumerate(infos(out, case)):
        assert info["rows"] == [case["shares"][r // case.get("mesh_tp", 1)]] * STEPS, info["rows"]
        assert info["trained"] == trained
        assert info["opt_states"] == len(trained)  # AdamW holds the trained tensors only (adapters under LoRA)
        # Bit for bit: the all-reduced gradients, and so every step and the optimizer's state.
        assert info["grad_diff"] == 0.0 and info["replica_diff"] == 0.0 and info["exp_avg_diff"] == 0.0, info
        assert info["frozen_grads"] == 0 and info["frozen_moved"] == 0.0, info
        assert info["mode"] == case["sync"]
        if case["n"] > 1:  # every rank, share 0 too, all-reduced the same buckets every step as its
            # data-parallel peers (in a mesh: the ranks at the same place of the other TP groups)
            # (DDP's first step runs on its initial buckets, rebuilt in the order backward made them)
            assert min(info["buckets"]) >= 1 and min(info["buckets"][1:]) >= (3 if "bucket_cap_mb" in case else 1)
            assert info["buckets"] == infos(out, case)[r % case.get("mesh_tp", case["n"])]["buckets"]
            # clocked: every bucket met the group's clock as a collective tagged "grad"; overlap: none did
            assert info["grad_spans"] == (info["buckets"] if case["sync"] == "clocked" else [0] * STEPS)
        else:  # a lone rank has no one to sync with: no DDP, no all-reduce
            assert info["buckets"] == [0] * STEPS
    # The replicated dropout stream after DataParallel.seed: the same within a TP group (its
    # replicated layers must drop alike), another on every data-parallel rank (other rows).
    draws = [info["dropout_draw"] for info in infos(out, case)]
    t = case.get("mesh_tp", 1)
    assert all(draws[r] == draws[r - r % t] for r in range(case["n"])), draws
    assert len(set(draws)) == case["n"] // t, draws
