"""One rank of a data-parallel equivalence world: for each case build the whole model (LoRA or
not) from the case's start checkpoint, wrap it in `DataParallel` over the case's group, train STEPS
steps on this rank's rows of each global batch (Xronos' AdamW and global-norm clipping, as a rank
runs them), and write what the test compares: rank 0 the trained tensors, every rank its checks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tp"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from equiv_worker import full_logits  # noqa: E402
from lora_ref import ALPHA, LR, MAX_GRAD_NORM, STEPS, R  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tp_world import worker_setup  # noqa: E402

from ckpts import WEIGHT_DECAY  # noqa: E402
from xronos.node.data.batches import Batch  # noqa: E402
from xronos.node.dp.replica import DataParallel  # noqa: E402
from xronos.node.dp.rows import rows_of, target_count  # noqa: E402
from xronos.node.models.export import gather_full  # noqa: E402
from xronos.node.models.loading import SafetensorsSource, materialize  # noqa: E402
from xronos.node.models.registry import family_for  # noqa: E402
from xronos.node.rank.optim import adamw  # noqa: E402
from xronos.node.tp.group import TPGroup  # noqa: E402
from xronos.node.tp.layout import ShardLayout  # noqa: E402
from xronos.node.tp.lora import LoraSettings, add_lora  # noqa: E402
from xronos.node.rank.tpengine import clip_global_grad_norm  # noqa: E402

N_BATCHES = 4


def load_batches(path: str) -> list[Batch]:
    t = load_file(path)
    return [Batch(t[f"b{i}/input_ids"], t[f"b{i}/attention_mask"], t[f"b{i}/labels"], t.get(f"b{i}/token_type_ids"))
            for i in range(N_BATCHES)]


def diff_to_rank0(tensors: list[torch.Tensor], group: TPGroup) -> float:
    """max |t - rank 0's t| over `tensors` (every rank calls it; untimed broadcasts)."""
    worst = 0.0
    for t in tensors:
        ref = t.detach().clone()
        if group.world_size > 1:
            group.broadcast(ref, 0, timed=False)
        worst = max(worst, maxabs(ref - t))
    return worst


def maxabs(t: torch.Tensor) -> float:
    return t.abs().max().item() if t.numel() else 0.0  # a TP rank may hold 0 columns of a tensor


def run_case(case: dict, group: TPGroup, out: Path, tp: TPGroup | None = None, rank_id: int | None = None) -> None:
    """`group` is the data-parallel group; `tp` the model's own tensor-parallel group (a DP×TP
    mesh: the case's `layout`, the same in every TP group), else a whole replica per rank."""
    start = Path(case["start"])
    config = json.loads((start / "config.json").read_text())
    family = family_for(config)
    rank = group.rank  # the data-parallel rank: which rows
    if tp is None:
        tp = TPGroup.single()  # a whole replica: the model's own tensor-parallel world is one rank
        layout = ShardLayout.single(family.sizes(config))
    else:
        layout = ShardLayout(**{k: tuple(case["layout"][k]) for k in ("attn", "mlp", "vocab")}, rank=tp.rank)
    model = family.build(config, case["task"], layout, tp, dropout=0.0)
    if case["targets"] is not None:
        add_lora(model, LoraSettings(R, ALPHA, 0.0, tuple(case["targets"])))
    materialize(model, SafetensorsSource(start))
    specs = model.tensor_specs()
    replicated = {n for n, s in specs.items() if s.dim is None}
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = adamw(trained.values(), lr=LR, weight_decay=WEIGHT_DECAY)
    dp = DataParallel(model, group, sync=case["sync"], bucket_cap_mb=case.get("bucket_cap_mb"))
    names = {n: specs[n].hf_name for n in trained}
    writer = rank == 0 and tp.rank == 0

    def gathered(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return gather_full(tensors, {n: specs[n] for n in tensors}, layout, tp)

    def logits(b: Batch) -> torch.Tensor | None:
        inputs = {"input_ids": b.input_ids, "attention_mask": b.attention_mask, "token_type_ids": b.token_type_ids}
        out = full_logits(model, inputs, config, layout, tp)
        model.train()
        return out

    bs = load_batches(case["batches"])
    shares = case["shares"]
    res: dict[str, torch.Tensor] = {"logits_before": logits(bs[0])}
    info = {"rows": [], "buckets": [], "grad_spans": [], "frozen_grads": 0, "grad_diff": 0.0}
    for step in range(STEPS):
        batch = bs[step % N_BATCHES]
        rows = rows_of(batch, shares, rank)
        group.drain_spans()
        part = dp.forward_backward(rows, target_count(batch, case["task"]))
        info["grad_spans"].append(sum(1 for s in group.drain_spans() if s.tag == "grad"))
        info["buckets"].append(len(dp.sync.drain()))
        info["rows"].append(0 if rows is None else int(rows.input_ids.shape[0]))
        info["frozen_grads"] += sum(p.grad is not None for p in model.parameters() if not p.requires_grad)
        res[f"loss/{step}"] = torch.tensor([dp.global_loss(part)], dtype=torch.float32)
        clip_global_grad_norm(model, replicated, MAX_GRAD_NORM, tp)
        if step in (0, STEPS - 1):
            grads = {n: p.grad for n, p in trained.items()}
            res.update((f"{'grad0' if step == 0 else 'grad'}/{k}", v) for k, v in gathered(grads).items())
            info["grad_diff"] = max(info["grad_diff"], diff_to_rank0(list(grads.values()), group))
        opt.step()
        opt.zero_grad(set_to_none=True)
    res.update((f"param/{k}", v) for k, v in gathered(dict(trained)).items())
    res.update((f"exp_avg/{k}", v) for k, v in gathered({n: opt.state[p]["exp_avg"] for n, p in trained.items()}).items())
    res["logits"] = logits(bs[0])
    if writer:
        save_file({k: v.contiguous() for k, v in res.items()}, str(out / f"{case['id']}.safetensors"))
    dp.seed(7)  # dropout streams: one per data-parallel rank, shared within a TP group
    draw = torch.rand(1, generator=model.streams.replicated).item()
    info.update(
        dropout_draw=draw,
        replica_diff=diff_to_rank0(list(trained.values()), group),  # the replicas stayed one model
        exp_avg_diff=diff_to_rank0([opt.state[p]["exp_avg"] for p in trained.values()], group),
        frozen_moved=max([maxabs(p.detach() - frozen[n]) for n, p in model.named_parameters()
                          if n in frozen] or [0.0]),
        opt_states=len(opt.state), trained=sorted(names.values()), mode=dp.sync.mode)
    (out / f"{case['id']}.rank{rank if rank_id is None else rank_id}.json").write_text(json.dumps(info))


def mesh_groups(ranks: list[int], tp_size: int) -> tuple[list, list]:
    """A DP×TP mesh over `ranks`: TP groups of `tp_size` consecutive ranks, data-parallel groups of
    the ranks at the same place in their TP group. Every rank of the world creates every group."""
    tps = [dist.new_group(ranks[g:g + tp_size]) for g in range(0, len(ranks), tp_size)]
    dps = [dist.new_group(ranks[t::tp_size]) for t in range(tp_size)]
    return tps, dps


def main() -> None:
    """As the TP equivalence workers: phases one after another, disjoint subgroups of the world
    running their cases concurrently within a phase (a mesh case uses its subgroup's ranks as a
    DP×TP mesh)."""
    job, rank, world_group = worker_setup(sys.argv)
    out = Path(job["out"])
    groups = []  # every rank creates every subgroup, in the same order
    for phase in job["phases"]:
        for sub in phase:
            pg = dist.new_group(sub["ranks"]) if len(sub["ranks"]) > 1 else None
            meshes = {c["id"]: mesh_groups(sub["ranks"], c["mesh_tp"]) for c in sub["cases"] if c.get("mesh_tp")}
            groups.append((sub, pg, meshes))
    for phase in job["phases"]:
        for sub, pg, meshes in groups:
            if sub in phase and rank in sub["ranks"]:
                n = len(sub["ranks"])
                me = sub["ranks"].index(rank)
                group = TPGroup(pg, me, n) if n > 1 else TPGroup.single()
                for case in sub["cases"]:
                    if case["id"] in meshes:
                        t = case["mesh_tp"]
                        tps, dps = meshes[case["id"]]
                        tp = TPGroup(tps[me // t], me % t, t)
                        run_case(case, TPGroup(dps[me % t], me // t, n // t), out, tp, rank_id=me)
                    else:
                        run_case(case, group, out)
        world_group.barrier()


if __name__ == "__main__":
    main()
