"""One rank of a re-shard world. Per case: build the model at layout A from the checkpoint, train
two AdamW steps, consolidate weights and moments (rank 0 writes them), re-shard live to layout B,
then check on every rank that (1) every local tensor — weight and moment — is exactly the slice
of the consolidated state layout B gives this rank, step counts and learning rate unchanged, and
(2) one more step of the re-sharded model equals, bit for bit, that step of a model built at B
from the consolidated state. A failed check exits non-zero."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tp_world import worker_setup

from xronos.node.rank.checkpoint import MOMENTS, load_moments
from xronos.node.models.export import gather_full
from xronos.node.models.loading import SafetensorsSource, materialize
from xronos.node.models.registry import family_for
from xronos.node.rank.optim import adamw
from xronos.node.tp.layout import ShardLayout
from xronos.node.tp.lora import add_lora
from xronos.node.tp.reshard import reshard, specs_per_rank, transfer_plan
from xronos.protocol.layout import Layout
from xronos.protocol.messages import LoraSpec

LR = 1e-3


class FullSource:
    """Local slices of consolidated tensors (weights by HF name, moments as "<moment>.<HF name>")."""

    def __init__(self, full: dict[str, torch.Tensor]) -> None:
        self.full = full

    def read(self, spec):
        return spec.take(self.full[spec.hf_name]).clone()


def batch(config: dict, task: str, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, config["vocab_size"], (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    labels = torch.randint(0, 3, (2,), generator=g) if task == "classify" else ids.masked_fill(mask == 0, -100)
    return ids, mask, labels, None


def step(model, opt, sched, config, task, seed) -> None:
    loss = model(*batch(config, task, seed))
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def run_case(case: dict, rank: int, group, out: Path) -> None:
    ckpt = Path(case["ckpt"])
    config = json.loads((ckpt / "config.json").read_text())
    family, task = family_for(config), case["task"]
    old, new = Layout.model_validate(case["old"]), Layout.model_validate(case["new"])
    lora = family.lora_settings(LoraSpec(r=case["lora_r"], alpha=8.0)) if case.get("lora_r") else None

    def build(layout: Layout):
        m = family.build(config, task, ShardLayout.of(layout, rank), group, dropout=0.0)
        if lora is not None:  # adapters (fresh: A random, B zero) on the family's targets, the base frozen
            add_lora(m, lora)
        return m

    model = build(old)
    materialize(model, SafetensorsSource(ckpt))
    model.train()
    opt = adamw([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    for s in range(2):
        step(model, opt, sched, config, task, s)

    specs = model.tensor_specs()
    params = dict(model.named_parameters())
    full = gather_full(model, specs, ShardLayout.of(old, rank), group)
    trained = {n: specs[n] for n, p in params.items() if p.requires_grad}
    for m in MOMENTS:
        local = {n: opt.state[params[n]][m] for n in trained}
        full.update({f"{m}.{k}": v for k, v in gather_full(local, trained, ShardLayout.of(old, rank), group).items()})
    saved = out / f"{case['name']}.safetensors"
    if rank == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, str(saved))
    group.barrier()
    full = load_file(str(saved))
    lr_before = opt.param_groups[0]["lr"]

    plan = transfer_plan(specs_per_rank(family, config, task, old, lora=lora),
                         specs_per_rank(family, config, task, new, lora=lora))
    # every other case one tensor per exchange (a batch budget of 1 byte), the old parts freed as it goes
    moved = reshard(model, opt, plan, lambda: build(new), group, **({"batch_bytes": 1} if case.get("batched") else {}))
    new_specs = moved.tensor_specs()
    # the old shard's moved parts are gone (freed batch by batch), its replicated tensors live on in `moved`
    assert all(p.numel() == 0 for n, p in model.named_parameters() if n in plan.shapes), case["name"]
    for name, p in moved.named_parameters():
        spec = new_specs[name]
        want = spec.take(full[spec.hf_name])
        assert torch.equal(p.detach(), want), (case["name"], rank, name, "weight")
        assert p.requires_grad == (lora is None or "lora_" in name or "score" in name or "classifier" in name)
        if not p.requires_grad:
            assert p not in opt.state  # a frozen base weight has no AdamW state, before or after
            continue
        st = opt.state[p]
        assert float(st["step"]) == 2.0, (name, st["step"])
        for m in MOMENTS:
            assert torch.equal(st[m], spec.take(full[f"{m}.{spec.hf_name}"])), (case["name"], rank, name, m)
    assert len(opt.state) == len([p for p in moved.parameters() if p.requires_grad])
    assert opt.param_groups[0]["params"] == [p for p in moved.parameters() if p.requires_grad]
    assert opt.param_groups[0]["lr"] == lr_before and sched.optimizer is opt

    # The reference: built at B from the consolidated state, its optimizer at the same step.
    ref = build(new)
    source = FullSource(full)
    materialize(ref, source)
    ref.train()
    ref_opt = adamw([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    load_moments(ref_opt, ref, ref.tensor_specs(), source, 2)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: min(1.0, (s + 3) / 4))
    step(moved, opt, sched, config, task, 2)
    step(ref, ref_opt, ref_sched, config, task, 2)
    ref_params = dict(ref.named_parameters())
    for name, p in moved.named_parameters():
        assert torch.equal(p.detach(), ref_params[name].detach()), (case["name"], rank, name, "after a step")
    plan_info = {"moved": plan.moved_elements(), "kept": plan.kept_elements()}
    (out / f"ok-{case['name']}-{rank}.json").write_text(json.dumps(plan_info))


def main() -> None:
    job, rank, group = worker_setup(sys.argv)
    out = Path(job["out"])
    for case in job["cases"]:
        run_case(case, rank, group, out)


if __name__ == "__main__":
    main()
