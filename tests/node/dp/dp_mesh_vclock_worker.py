"""A rank of test_dp_vclock.py's mesh case: a 2x2 DP×TP mesh (`node/dp/mesh.form_mesh`) of a tiny
GPT-2 at a lopsided layout, each rank on a virtual clock of its own speed; writes, per step, the
spans of its TP group (activation all-reduces) and of its DP group (gradient buckets)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tp"))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tp_world import worker_setup  # noqa: E402

from xronos.node.data.batches import Batch  # noqa: E402
from xronos.node.dp.mesh import form_mesh  # noqa: E402
from xronos.node.dp.replica import DataParallel  # noqa: E402
from xronos.node.dp.rows import rows_of, target_count  # noqa: E402
from xronos.node.emulate.link import Link  # noqa: E402
from xronos.node.emulate.vclock import Box, VirtualClock  # noqa: E402
from xronos.node.models.loading import SafetensorsSource, materialize  # noqa: E402
from xronos.node.models.registry import family_for  # noqa: E402
from xronos.node.tp.layout import ShardLayout  # noqa: E402


def main() -> None:
    job, rank, world = worker_setup(sys.argv)
    world.clock = VirtualClock(Box(job["speeds"][rank], Link(job["bandwidth_Bps"], job["latency_s"])))
    mesh = form_mesh(world, 2, job["shares"])
    config = json.loads((Path(job["ckpt"]) / "config.json").read_text())
    layout = ShardLayout(**{k: tuple(job["layout"][k]) for k in ("attn", "mlp", "vocab")}, rank=mesh.tp.rank)
    model = family_for(config).build(config, "causal-lm", layout, mesh.tp)
    materialize(model, SafetensorsSource(job["ckpt"]))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    dp = DataParallel(model, mesh.dp)
    t = load_file(job["batch"])
    batch = Batch(t["input_ids"], t["attention_mask"], t["labels"])
    steps = []
    for _ in range(job["steps"]):
        for g in (mesh.tp, mesh.dp):
            g.drain_spans()
        dp.forward_backward(rows_of(batch, job["shares"], mesh.dp.rank), target_count(batch, "causal-lm"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        world.settle()
        steps.append({g: [(s.name, s.tag, s.start, s.seconds) for s in grp.drain_spans()]
                      for g, grp in (("tp", mesh.tp), ("dp", mesh.dp))})
    out = {"mode": dp.sync.mode, "tp": [mesh.tp.rank, mesh.tp.world_size], "dp": [mesh.dp.rank, mesh.dp.world_size],
           "steps": steps}
    (Path(job["out"]) / f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
