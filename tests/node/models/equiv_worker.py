"""One rank of an equivalence world: for each case build the sharded model from the checkpoint,
run forward + backward + one AdamW step, and consolidate everything on rank 0 with gather_full."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tp"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tp_world import worker_setup  # noqa: E402

from xronos.node.models.export import gather_full, save_hf_dir  # noqa: E402
from xronos.node.models.loading import SafetensorsSource, materialize  # noqa: E402
from xronos.node.models.registry import family_for  # noqa: E402
from xronos.node.models.specs import TensorSpec  # noqa: E402
from xronos.node.rank.streaming import load_shard  # noqa: E402
from xronos.node.tp.group import TPGroup  # noqa: E402
from xronos.node.tp.layout import ShardLayout  # noqa: E402

LR, WEIGHT_DECAY = 1e-3, 0.01


def full_logits(model, batch: dict, config: dict, layout: ShardLayout, group) -> torch.Tensor | None:
    """The model's eval logits, the vocabulary slices of a causal LM gathered: full on rank 0."""
    model.eval()
    with torch.no_grad():
        logits = model.logits(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
    if model.task == "causal-lm":
        B, S, _ = logits.shape
        V = config["vocab_size"]
        logit_spec = {"logits": TensorSpec("logits", 2, (model.vocab_range,), (B, S, V))}
        logits = gather_full({"logits": logits}, logit_spec, layout, group).get("logits")
    return logits


def run_case(case: dict, rank: int, group, out: Path) -> None:
    group.overlap = bool(case.get("overlap"))  # test_overlap_equivalence: the same bar, overlap on
    group.launched = 0
    group.chunks = case.get("chunks", 1)
    ckpt = Path(case["ckpt"])
    config = json.loads((ckpt / "config.json").read_text())
    family = family_for(config)
    if "layout" in case:  # a mixed layout: its own counts per kind
        layout = ShardLayout(**{k: tuple(case["layout"][k]) for k in ("attn", "mlp", "vocab")}, rank=rank)
    else:
        layout = ShardLayout.tied(tuple(case["units"]), family.sizes(config), rank)
    model = family.build(config, case["task"], layout, group, dropout=case.get("dropout", 0.0))
    if case.get("stream") and group.world_size > 1:  # the owner streams the others their slices
        source = SafetensorsSource(ckpt) if rank == 0 else None
        load_shard(model, group, source)
    else:
        source = SafetensorsSource(ckpt)
        materialize(model, source)
    specs = model.tensor_specs()
    batch = load_file(case["batch"])
    args = (batch["input_ids"], batch["attention_mask"], batch["labels"], batch.get("token_type_ids"))

    model.train()
    if case.get("dropout"):
        model.seed(1234)
    group.drain_timings()
    group.drain_spans()
    loss = model(*args)
    loss.backward()
    launched = group.launched  # asynchronous all-reduces of the training step (not the evaluations after)
    # Every collective of forward + backward is tagged with its segment kind (per-kind compute).
    tags: dict[str, int] = {}
    for span in group.drain_spans():
        if span.name != "mark":
            tags[str(span.tag)] = tags.get(str(span.tag), 0) + 1
    res: dict[str, torch.Tensor] = {"loss": loss.detach().reshape(1)}
    grads = {n: p.grad for n, p in model.named_parameters()}
    res.update((f"grad/{k}", v) for k, v in gather_full(grads, specs, layout, group).items())

    # Replicated parameters must get identical gradients on every rank without communication.
    rep_diff = 0.0
    for n, p in model.named_parameters():
        if specs[n].dim is None:
            t = p.grad.clone()
            group.broadcast(t, 0)
            rep_diff = max(rep_diff, (t - p.grad).abs().max().item())
    loss0 = loss.detach().reshape(1).clone()
    group.broadcast(loss0, 0)

    logits = full_logits(model, batch, config, layout, group)
    if logits is not None:
        res["logits"] = logits

    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    opt.step()
    res.update((f"param/{k}", v) for k, v in gather_full(model, specs, layout, group).items())
    if case.get("export"):  # what the exported model must reproduce when transformers loads it
        logits = full_logits(model, batch, config, layout, group)
        if logits is not None:
            res["logits_after"] = logits
    exp_avg = {n: opt.state[p]["exp_avg"] for n, p in model.named_parameters()}
    res.update((f"exp_avg/{k}", v) for k, v in gather_full(exp_avg, specs, layout, group).items())

    if layout.rank == 0:
        save_file({k: v.contiguous() for k, v in res.items()}, str(out / f"{case['id']}.safetensors"))
        if case.get("export"):
            state = {k.removeprefix("param/"): v for k, v in res.items() if k.startswith("param/")}
            save_hf_dir(out / f"{case['id']}-export", config, case["task"], state, ckpt)
    info = {"launched": launched, "loss": loss.item(), "rank0_loss": loss0.item(), "replicated_grad_diff": rep_diff,
            "slice_reads": source.slice_reads if source else 0, "full_reads": source.full_reads if source else 0,
            "collectives": len(group.drain_timings()), "tags": tags}
    (out / f"{case['id']}.rank{rank}.json").write_text(json.dumps(info))


def main() -> None:
    """Phases run one after another; within a phase, disjoint subgroups of the world run their
    cases concurrently (so one 5-process world covers N = 1..5 with few process launches)."""
    job, rank, world_group = worker_setup(sys.argv)
    out = Path(job["out"])
    groups = []  # every rank creates every subgroup, in the same order
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
