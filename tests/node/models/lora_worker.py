"""One rank of a LoRA equivalence world: for each case build the sharded model with adapters from
the shared start checkpoint, train STEPS steps (Xronos' AdamW over the trainable parameters, its
global-norm clipping), consolidate on rank 0 and, for some cases, export the adapter (and merged)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tp"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from equiv_worker import full_logits  # noqa: E402
from lora_ref import ALPHA, LR, MAX_GRAD_NORM, STEPS, R, batches  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tp_world import worker_setup  # noqa: E402

from ckpts import WEIGHT_DECAY  # noqa: E402
from xronos.node.models.adapters import save_lora_exports  # noqa: E402
from xronos.node.models.export import gather_full  # noqa: E402
from xronos.node.models.loading import SafetensorsSource, materialize  # noqa: E402
from xronos.node.models.registry import family_for  # noqa: E402
from xronos.node.rank.optim import adamw  # noqa: E402
from xronos.node.rank.streaming import load_shard  # noqa: E402
from xronos.node.tp.group import TPGroup  # noqa: E402
from xronos.node.tp.layout import ShardLayout  # noqa: E402
from xronos.node.tp.lora import LoraSettings, add_lora  # noqa: E402
from xronos.node.rank.tpengine import clip_global_grad_norm, trainable  # noqa: E402


def run_case(case: dict, rank: int, group: TPGroup, out: Path) -> None:
    group.overlap = bool(case.get("overlap"))  # test_overlap_equivalence: the same bar, overlap on
    group.launched = 0
    group.chunks = case.get("chunks", 1)
    start = Path(case["start"])
    config = json.loads((start / "config.json").read_text())
    family = family_for(config)
    layout = ShardLayout(**{k: tuple(case["layout"][k]) for k in ("attn", "mlp", "vocab")}, rank=rank)
    model = family.build(config, case["task"], layout, group, dropout=0.0)
    settings = LoraSettings(R, ALPHA, case.get("lora_dropout", 0.0), tuple(case["targets"]))
    modules = add_lora(model, settings)
    if case.get("stream") and group.world_size > 1:
        source = SafetensorsSource(start) if rank == 0 else None
        load_shard(model, group, source)
    else:
        materialize(model, SafetensorsSource(start))
    specs = model.tensor_specs()
    replicated = {n for n, s in specs.items() if s.dim is None}
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = adamw(trainable(model), lr=LR, weight_decay=WEIGHT_DECAY)
    frozen_before = gather_full({n: p for n, p in model.named_parameters() if not p.requires_grad},
                                {n: s for n, s in specs.items() if n not in trained}, layout, group)
    bs = batches(case["kind"])
    res: dict[str, torch.Tensor] = {}
    model.train()
    if case.get("lora_dropout"):
        model.seed(99)
    logits = full_logits(model, bs[0], config, layout, group)
    model.train()
    if logits is not None:
        res["logits_before"] = logits
    rep_diff, frozen_grads, tags = 0.0, 0, {}
    launched = group.launched
    for step in range(STEPS):
        b = bs[step % len(bs)]
        group.drain_spans()
        loss = model(b["input_ids"], b["attention_mask"], b["labels"], b.get("token_type_ids"))
        loss.backward()
        if step == 0:
            for span in group.drain_spans():
                if span.name != "mark":
                    tags[str(span.tag)] = tags.get(str(span.tag), 0) + 1
        if step == STEPS - 1:  # asynchronous all-reduces of the training steps (not the evaluations)
            launched = group.launched - launched
        frozen_grads += sum(p.grad is not None for p in model.parameters() if not p.requires_grad)
        clip_global_grad_norm(model, replicated, MAX_GRAD_NORM, group)
        res[f"loss/{step}"] = loss.detach().reshape(1)
        if step in (0, STEPS - 1):
            tag = "grad0" if step == 0 else "grad"
            grads = {n: p.grad for n, p in trained.items()}
            res.update((f"{tag}/{k}", v) for k, v in gather_full(grads, {n: specs[n] for n in trained},
                                                                 layout, group).items())
            for n, p in trained.items():  # replicated trainable gradients agree bit for bit
                if specs[n].dim is None:
                    t = p.grad.clone()
                    group.broadcast(t, 0)
                    rep_diff = max(rep_diff, (t - p.grad).abs().max().item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = gather_full(model, specs, layout, group)
    res.update((f"param/{k}", v) for k, v in state.items() if k in {specs[n].hf_name for n in trained})
    exp_avg = {n: opt.state[p]["exp_avg"] for n, p in trained.items()}
    res.update((f"exp_avg/{k}", v) for k, v in gather_full(exp_avg, {n: specs[n] for n in trained},
                                                           layout, group).items())
    logits = full_logits(model, bs[0], config, layout, group)
    if logits is not None:
        res["logits"] = logits
    if rank == 0:
        frozen_moved = max((state[k] - v).abs().max().item() for k, v in frozen_before.items())
        save_file({k: v.contiguous() for k, v in res.items()}, str(out / f"{case['id']}.safetensors"))
        if case.get("export"):
            save_lora_exports(out / f"{case['id']}-export", config, case["task"], state, settings, modules,
                              start, merged=True)
    info = {"launched": launched, "modules": modules, "rep_diff": rep_diff, "frozen_grads": frozen_grads, "tags": tags,
            "opt_params": sum(len(g["params"]) for g in opt.param_groups), "opt_states": len(opt.state),
            "trained": sorted(specs[n].hf_name for n in trained),
            "frozen_moved": frozen_moved if rank == 0 else None}
    (out / f"{case['id']}.rank{rank}.json").write_text(json.dumps(info))


def main() -> None:
    job, rank, world_group = worker_setup(sys.argv)
    out = Path(job["out"])
    groups = []
    for phase in job["phases"]:
        for sub in phase:
            pg = dist.new_group(sub["ranks"]) if len(sub["ranks"]) > 1 else None
            groups.append((sub, pg))
    for phase in job["phases"]:
        for sub, pg in groups:
            if sub in phase and rank in sub["ranks"]:
                n = len(sub["ranks"])
                me = sub["ranks"].index(rank)
                group = TPGroup(pg, me, n) if n > 1 else TPGroup.single()
                for case in sub["cases"]:
                    run_case(case, me, group, out)
        world_group.barrier()


if __name__ == "__main__":
    main()
