"""A rank of test_dp_vclock.py: data-parallel training of a tiny model on a virtual clock of the
job's speed; writes, per step, the gradient buckets' spans on the clock and the step's virtual time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tp"))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tp_world import worker_setup  # noqa: E402

from xronos.node.data.batches import Batch  # noqa: E402
from xronos.node.dp.replica import DataParallel  # noqa: E402
from xronos.node.dp.rows import rows_of, target_count  # noqa: E402
from xronos.node.emulate.link import Link  # noqa: E402
from xronos.node.emulate.vclock import Box, VirtualClock  # noqa: E402
from xronos.node.models.loading import SafetensorsSource, materialize  # noqa: E402
from xronos.node.models.registry import family_for  # noqa: E402
from xronos.node.tp.group import TPGroup  # noqa: E402
from xronos.node.tp.layout import ShardLayout  # noqa: E402


def main() -> None:
    job, rank, group = worker_setup(sys.argv)
    group.clock = VirtualClock(Box(job["speeds"][rank], Link(job["bandwidth_Bps"], job["latency_s"])))
    config = json.loads((Path(job["ckpt"]) / "config.json").read_text())
    family = family_for(config)
    model = family.build(config, "causal-lm", ShardLayout.single(family.sizes(config)), TPGroup.single())
    materialize(model, SafetensorsSource(job["ckpt"]))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    dp = DataParallel(model, group)  # auto: a virtual clock puts each bucket through the group's clock
    t = load_file(job["batch"])
    batch = Batch(t["input_ids"], t["attention_mask"], t["labels"])
    steps = []
    for _ in range(job["steps"]):
        group.drain_spans()
        t0 = group.now()
        dp.forward_backward(rows_of(batch, job["shares"], rank), target_count(batch, "causal-lm"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        group.settle()
        steps.append({"t0": t0, "t1": group.now(), "buckets": [b.nbytes for b in dp.sync.drain()],
                      "spans": [(s.name, s.tag, s.start, s.seconds) for s in group.drain_spans()]})
    (Path(job["out"]) / f"rank{rank}.json").write_text(json.dumps({"mode": dp.sync.mode, "steps": steps}))


if __name__ == "__main__":
    main()
