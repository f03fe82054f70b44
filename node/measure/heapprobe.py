"""The heap's free holes of real training iterations at two depths, each in a fresh process.

Under the training ranks' allocator setting (`xronos.node.measure.allocator`: no mmap, no trimming) the
heap keeps every block it spread to, and blocks of mixed sizes leave free gaps they do not fit:
resident bytes no tensor holds (`memprobe`, "Heap slack"). Those holes grow with the model's
depth — every block's saved activations and gradients cycle through the heap once per iteration
— so one block's slack under-predicts a deeper rank: a qwen2.5-1.5b LoRA rank at seq 256 needed
0.8-1.4x the one-block slack at 2 blocks and 1.6-2.3x at 3 (bench/results/mem-peak-lora.md).

`measure` builds the job's model with `blocks` transformer blocks at full width (rank 0 of a
two-rank world holding everything, `TPGroup.alone`), its AdamW state allocated at build as the
trainer does (`node/rank/optstate.py`), and runs the trainer's iteration (forward, backward, the
chunked clipping pass, the fused step, `zero_grad(set_to_none=True)`) until glibc's heap stops
growing, then once more under torch's memory profiler: slack = the heap's span minus (bytes in
use before + c10's peak above them), as `ProfilingSet.heap_slack`, without the timing hooks.
`slack_per_depth` runs it at 1 and 4 blocks, three times each, every run in its own fresh
process under the ranks' environment (a process that built one model already has holes the next
one fills), and gives the median one-block slack and each further block's growth between the two
depths' medians (never negative). One run is one draw of the allocator's placement: RoBERTa-base's
smallest width at seq 64 measured 26.8-41.4 MiB at one block and 63.5-89.5 at four over five
runs, so one pair of draws gave anything from 11 to 21 MiB per block (main's grid profile drew
20.9 and over-predicted the 6-block ranks by ~30 MiB); the median of three steadies it. The cost
model puts them together linearly in the rank's depth: each block adds one more round of the same
pattern (236, 291, 352 MiB at 1, 2, 3 blocks of a qwen2.5-1.5b LoRA rank's shape at seq 256). They
do not level off with depth (medians at 1, 4, 6 blocks of the grid's RoBERTa shape, no clipping:
38, 74, 104 MiB; the line through the first two gives 98 at six), so no cap is put on the growth
(bench/results/mem-peak-v9.md).

    python -m xronos.node.box.boxed xronos.node.measure.heapprobe REQUEST.json  # a child: sends {"slack": bytes, ...}

The profiler (`node/measure/profiler.py`) measures one block at full width (once: the costliest probe) and
at its smallest width, and the growth with depth at the smallest width (cheap there, and the
ranks of a plan are rarely wide), the smallest width's two depths three times each.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

_LAYER_KEYS = ("n_layer", "num_hidden_layers", "num_layers")
SETTLE_ITERS = 6  # the heap grows for 3-4 iterations, then is flat (bench/results/mem-peak-lora.md)
SETTLED_BYTES = 1 << 20  # growth below 1 MiB over one iteration counts as settled


def blocks_config(config: dict[str, Any], blocks: int) -> dict[str, Any]:
    """The same model with `blocks` transformer blocks, pad id defined (the profiling set: one)."""
    c = dict(config)
    keys = [k for k in _LAYER_KEYS if c.get(k) is not None]
    if not keys:
        raise ValueError(f"config has none of {_LAYER_KEYS}: cannot tell the number of blocks")
    for k in keys:
        c[k] = blocks
    if c.get("pad_token_id") is None:
        c["pad_token_id"] = int(c["vocab_size"]) - 1
    return c


def measure(config: dict[str, Any], task: str, layout: dict[str, tuple[int, int]], batch: int, seq: int, *,
            blocks: int, seed: int = 0, clip: bool = True, weight_decay: float = 0.0,
            lora: dict[str, Any] | None = None) -> dict[str, int]:
    """This process's heap slack over the trainer's iteration of the `blocks`-block model (see the
    module docstring); {} without glibc's mallinfo2."""
    import torch

    from xronos.node.rank.gradnorm import squared_norm
    from xronos.node.measure import memwatch
    from xronos.node.measure.memprobe import AllocTrace
    from xronos.node.models.loading import init_random
    from xronos.node.models.registry import family_for
    from xronos.node.rank.optim import adamw
    from xronos.node.rank.optstate import allocate_state
    from xronos.node.tp.group import TPGroup
    from xronos.node.tp.layout import ShardLayout
    from xronos.node.tp.lora import LoraSettings, add_lora
    from xronos.protocol.layout import Layout

    if not memwatch.heap():
        return {}
    cfg = blocks_config(config, blocks)
    family = family_for(cfg)
    lay = Layout(**{k: tuple(v) for k, v in layout.items()})
    model = family.build(cfg, task, ShardLayout.of(lay, 0), TPGroup.alone(2))
    if lora is not None:
        add_lora(model, LoraSettings(**lora))
    init_random(model, seed)
    model.train()
    opt = adamw([p for p in model.parameters() if p.requires_grad], lr=2e-5, weight_decay=weight_decay)
    allocate_state(opt)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, int(cfg["vocab_size"]), (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    labels = torch.randint(0, model.num_labels, (batch,), generator=g) if task == "classify" else ids.clone()

    def iteration() -> None:  # the trainer's step (node/rank/tpengine.train_step), alone
        loss = model(ids, mask, labels)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if clip:
            sq = torch.zeros(1, dtype=torch.float64)
            for gr in grads:
                sq.add_(squared_norm(gr))
            for gr in grads:
                gr.mul_(0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)

    iteration()
    span = memwatch.heap()["span"]
    for _ in range(SETTLE_ITERS):
        iteration()
        now = memwatch.heap()["span"]
        grown, span = now - span, now
        if grown <= SETTLED_BYTES:
            break
    before = memwatch.heap()
    # One traced iteration only: the profiler's own small allocations split freed blocks.
    with AllocTrace() as trace:
        iteration()
    peak = before["used"] + trace.peak_bytes()
    return {"slack": max(0, before["span"] - peak), "span": before["span"], "in_use_peak": peak}


def measure_in_child(job: dict[str, Any], threads: int, timeout_s: float = 1800.0) -> dict[str, int]:
    """`measure(**job)` in a fresh process under the ranks' environment; RuntimeError if it fails."""
    import tempfile

    from xronos.node.rank.spawn import ChildProcess, rank_env

    with tempfile.TemporaryDirectory(prefix="xronos-heapprobe-") as tmp:
        req = Path(tmp) / "request.json"
        req.write_text(json.dumps(job))
        # Without limits of its own: it dies with the profile child and is inside that child's
        # cgroups and rlimits, which it inherits (node/box/limits.py).
        child = ChildProcess("xronos.node.measure.heapprobe", str(req), env=rank_env(threads), name="heapprobe",
                             events=True)
        try:
            code = child.wait(timeout_s)
        finally:
            child.close()
    lines = child.drain_lines()
    if code != 0 or not lines:
        raise RuntimeError(f"the heap probe ({job.get('blocks')} blocks) failed ({child.why()}):\n{child.tail(15)}")
    return json.loads(lines[-1])


DEPTH = 4  # the second depth: three more blocks than one, so that each block's growth is the
# mean of three (one measurement's holes vary by ~20 MiB run to run: 39 / 57 MiB for the same
# RoBERTa-base block; a one-block difference extrapolated over five more blocks was off by ~90)
REPEATS = 3  # fresh processes per depth, their median taken: an odd count, so one draw in the
# allocator's other placement mode is outvoted rather than averaged in


def slack_per_depth(job: dict[str, Any], threads: int, depth: int = DEPTH,
                    repeats: int = REPEATS) -> tuple[int, int]:
    """(median slack at one block, each further block's growth >= 0 between the medians at 1 and
    `depth` blocks), bytes, from `repeats` fresh processes per depth; (0, 0) where glibc cannot
    tell."""
    ones, deeps = [], []
    for _ in range(repeats):  # interleaved, so that a drift of the machine's state meets both depths alike
        ones.append(measure_in_child(job | {"blocks": 1}, threads))
        deeps.append(measure_in_child(job | {"blocks": depth}, threads))
    if not all(ones) or not all(deeps):
        return 0, 0
    one = statistics.median(r["slack"] for r in ones)
    deep = statistics.median(r["slack"] for r in deeps)
    return round(one), max(0, round((deep - one) / (depth - 1)))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m xronos.node.measure.heapprobe REQUEST.json", file=sys.stderr)
        return 2
    import torch

    from xronos.node.rank.spawn import send_result

    job = json.loads(Path(argv[1]).read_text())
    torch.set_num_threads(int(job.pop("threads", 1)))
    send_result(measure(**job))  # on the events pipe of `measure_in_child`
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
