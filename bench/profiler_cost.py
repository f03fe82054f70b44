"""What profiling costs: the profiler's wall time vs one training epoch of the paper's CoLA setting.

    .venv/bin/python -m xronos.bench.profiler_cost [--arch gpt2-medium] [--full-iters 3] [--threads 1]

CoLA: 8,551 training sentences, batch 8, sequence length 32 -> 1,069 iterations per epoch. The
epoch time is 1,069 x the median time of a full-model (all blocks, unsharded engine model, world of
one) fine-tuning iteration measured here — forward, backward, global-norm clipping, AdamW step —
after one warm-up iteration. The profiler is timed end to end (model builds, random init, all
widths, the memory pass). Target: profiler < 5% of an epoch. Also printed: the profile's
prediction of that full-model iteration (cost model at p = 1) against the measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

COLA_TRAIN_ROWS = 8551


def full_model_iteration_s(config: dict, task: str, batch: int, seq: int, iters: int) -> list[float]:
    import torch

    from xronos.node.models.loading import init_random
    from xronos.node.models.registry import family_for
    from xronos.node.tp.group import TPGroup
    from xronos.node.tp.layout import ShardLayout
    from xronos.node.rank.optim import adamw
    from xronos.node.rank.tpengine import clip_global_grad_norm

    family = family_for(config)
    group = TPGroup.single()
    model = init_random(family.build(config, task, ShardLayout.single(family.sizes(config)), group), 0)
    model.train()
    replicated = {n for n, s in model.tensor_specs().items() if s.dim is None}
    opt = adamw(model.parameters(), lr=2e-5)  # the trainer's (fused), as the iteration it is set against
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, int(config["vocab_size"]), (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    labels = torch.randint(0, 2, (batch,), generator=g) if task == "classify" else ids.clone()
    times = []
    for _ in range(1 + iters):
        t0 = time.perf_counter()
        loss = model(ids, mask, labels)
        loss.backward()
        clip_global_grad_norm(model, replicated, 1.0, group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)
        times.append(time.perf_counter() - t0)
    return times[1:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="gpt2-medium")
    ap.add_argument("--task", default="classify", choices=["classify", "causal-lm"])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--full-iters", type=int, default=3)
    ap.add_argument("--train-rows", type=int, default=COLA_TRAIN_ROWS)
    ap.add_argument("--json", metavar="FILE", help="also write the numbers here")
    args = ap.parse_args(argv)

    import torch

    from xronos.gateway.plan.costmodel import node_cost, time_at
    from xronos.gateway.plan.profiles import node_profile
    from xronos.node.measure.profiler import profile
    from xronos.node.models.shapes import shape_config

    torch.set_num_threads(args.threads)
    config = shape_config(args.arch, args.task)
    t0 = time.perf_counter()
    report = profile(config, args.task, args.batch_size, args.seq_len, threads=args.threads)
    profile_s = time.perf_counter() - t0
    predicted = {fit: time_at(node_cost(node_profile(report), fit), 1.0) for fit in ("affine", "linear")}

    iters = full_model_iteration_s(config, args.task, args.batch_size, args.seq_len, args.full_iters)
    iteration_s = statistics.median(iters)
    per_epoch = math.ceil(args.train_rows / args.batch_size)
    epoch_s = per_epoch * iteration_s
    ratio = profile_s / epoch_s
    out = dict(arch=args.arch, task=args.task, batch_size=args.batch_size, seq_len=args.seq_len,
               threads=args.threads, profile_wall_s=profile_s, full_iteration_s=iters,
               iterations_per_epoch=per_epoch, epoch_s=epoch_s, profile_over_epoch=ratio,
               predicted_full_iteration_s=predicted)
    print(f"{args.arch} {args.task} B={args.batch_size} S={args.seq_len} threads={args.threads}")
    print(f"  profiler wall time          {profile_s:8.1f} s")
    print(f"  full-model iteration        {iteration_s:8.3f} s (median of {[round(t, 3) for t in iters]})")
    print(f"  one CoLA epoch              {epoch_s:8.1f} s ({per_epoch} iterations)")
    print(f"  profiler / epoch            {100 * ratio:8.2f} %  (target < 5%)")
    for fit, t in predicted.items():
        print(f"  predicted iteration ({fit:6s}) {t:7.3f} s  error {100 * (t - iteration_s) / iteration_s:+.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ratio < 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
