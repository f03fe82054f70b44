"""Profile one emulated device: `python -m xronos.bench.profile_device CONFIG.json`.

Run inside the device's cgroup, so the times are those of that device's CPU share: the Xronos
profiler's report (the planner's input, paper §IV-A) and the pipeline baseline's per-layer
micro-batch profile (Asteroid's input), each for full fine-tuning or the LoRA job. All are written
as JSON (no pickle).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from xronos.protocol.recipe import LoraSpec


class ProfileJob(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model_dir: str
    batch_size: int
    seq_len: int
    micro_rows: int
    threads: int = 1
    tp_out: str | None = None
    pp_out: str | None = None
    iters: int = 5
    # The LoRA job's profile (issue 17): the profiling set trains these adapters on a frozen base.
    tp_lora_out: str | None = None
    pp_lora_out: str | None = None  # the pipeline's per-layer profile of the same LoRA job
    lora_r: int = 8
    lora_targets: list[str] | None = None


def main(argv: list[str]) -> int:
    import torch

    from xronos.node.measure import allocator

    allocator.tune()  # as the ranks run (node/measure/allocator.py): both profiles must predict them
    job = ProfileJob.model_validate_json(Path(argv[1]).read_text())
    torch.set_num_threads(job.threads)
    if job.tp_out is not None:
        from xronos.node.measure.profiler import profile

        config = json.loads((Path(job.model_dir) / "config.json").read_text())
        # As the cell's TP runs train: no clipping and no weight decay (RunConfig's defaults, and
        # the baselines' too); profiling a clipping pass the runs never take over-predicts them.
        report = profile(config, "classify", job.batch_size, job.seq_len, threads=job.threads,
                         iters=job.iters, warmup=1, clip=False, weight_decay=0.0)
        Path(job.tp_out).write_text(json.dumps(report.model_dump(mode="json")))
    if job.tp_lora_out is not None:
        from xronos.node.measure.profiler import profile

        config = json.loads((Path(job.model_dir) / "config.json").read_text())
        report = profile(config, "classify", job.batch_size, job.seq_len, threads=job.threads,
                         iters=job.iters, warmup=1, clip=False, weight_decay=0.0,
                         lora=LoraSpec(r=job.lora_r, targets=job.lora_targets))
        Path(job.tp_lora_out).write_text(json.dumps(report.model_dump(mode="json")))
    if job.pp_out is not None:
        from xronos.bench.pp_profile import profile_layers

        Path(job.pp_out).write_text(json.dumps(profile_layers(job.model_dir, job.micro_rows, job.seq_len,
                                                              iters=job.iters, warmup=1)))
    if job.pp_lora_out is not None:
        from xronos.bench.pp_profile import profile_layers
        from xronos.node.models.registry import family_for

        config = json.loads((Path(job.model_dir) / "config.json").read_text())
        lora = family_for(config).lora_settings(LoraSpec(r=job.lora_r, targets=job.lora_targets))
        Path(job.pp_lora_out).write_text(json.dumps(profile_layers(job.model_dir, job.micro_rows, job.seq_len,
                                                                   iters=job.iters, warmup=1, lora=lora)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
