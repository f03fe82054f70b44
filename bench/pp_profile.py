"""Per-layer profile for the pipeline partitioner (Asteroid profiles each device at micro-batch size).

For the chain [emb, blk, out] we time forward + backward of ONE micro-batch through the very
modules a stage runs, and separately that layer's AdamW step (once per iteration), and count its resident bytes (weights, grads,
two AdamW moments = 16 B per fp32 parameter). Activation bytes per micro-batch are the saved
tensors autograd keeps for backward (measured with saved-tensor hooks). All blocks share a shape,
so one block stands for all B. Median over `iters` after `warmup`.

The ruler is the one the stages train on: wall time on a real box and under the emulator's quota
or pacing; on the virtual clock the process's clock, a burst's CPU time (window minimum per
recurring burst) over the emulated box's speed, with a pause before each micro-batch as a stage
waits in its receives (`readings.collective_pause_s`). Timed in wall seconds there, every box
would read the host's speed and the pipeline would be planned as if all boxes were alike.

With `lora` the profile is the LoRA job's: the stage trains adapters on a frozen base
(`Stage.add_lora`), so a layer's backward skips its frozen weights' gradients (the frozen
embedding runs forward only), its AdamW step covers what it trains, and its resident bytes are
4 B per frozen parameter and 16 B per trained one.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from xronos.bench.pp_model import ADAPTERS, Stage, StageSpan, _get
from xronos.node.measure.readings import collective_pause_s
from xronos.node.rank.optim import adamw


def _saved_bytes(fn) -> tuple[torch.Tensor, int]:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def profile_layers(model_dir: str, micro_rows: int, seq_len: int, *, iters: int = 5, warmup: int = 2,
                   pad_token_id: int = 0, seed: int = 0, lora=None) -> dict:
    """{"times": [t_emb, t_blk, t_out], "weights": [...], "acts": [...], "params": [...], "hidden": H}
    (s, bytes, parameter counts). `lora`: the LoraSettings of the LoRA job, None for full fine-tuning."""
    import json
    from pathlib import Path

    config = json.loads((Path(model_dir) / "config.json").read_text())
    from xronos.bench.pp_model import num_blocks

    B = num_blocks(config)
    torch.manual_seed(seed)
    stage = Stage(model_dir, StageSpan(0, B + 2, B), pad_token_id)
    if lora is not None:
        stage.add_lora(lora.r, lora.alpha, lora.targets, lora.dropout)
    stage.train()
    H = stage.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, stage.full_vocab, (micro_rows, seq_len), generator=g)
    mask = torch.ones_like(ids)
    labels = torch.randint(0, 2, (micro_rows,), generator=g)
    block = _get(stage.model, ADAPTERS[stage.family].blocks)[0]
    ad = ADAPTERS[stage.family]
    layers = {
        "emb": [p for n, p in stage.model.named_parameters() if n.startswith(tuple(m + "." for m in ad.embed))],
        "blk": list(block.parameters()),
        "out": [p for n, p in stage.model.named_parameters() if n.startswith(tuple(m + "." for m in ad.head))],
    }
    groups = {k: [p for p in v if p.requires_grad] for k, v in layers.items()}
    # the stage workers' own optimizer (pp_worker: the trainer's fused AdamW), so the pipeline's
    # plan is made from the step it will run
    opts = {k: adamw(v, lr=1e-5) if v else None for k, v in groups.items()}

    def run_emb():
        return stage.embed(ids, None)

    def run_blk():
        h = torch.randn(micro_rows, seq_len, H, generator=g).requires_grad_()
        ctx = stage.context(ids, mask)
        out = block(h, **ctx)
        return out[0] if isinstance(out, tuple) else out

    def run_out():
        h = torch.randn(micro_rows, seq_len, H, generator=g).requires_grad_()
        return F.cross_entropy(stage.head(h, ids).float(), labels, reduction="sum")

    clock = _virtual_clock()
    now = clock.now if clock is not None else time.perf_counter
    pause = collective_pause_s() if clock is not None else 0.0
    times, steps, acts = {}, {}, {}
    for key, fn in (("emb", run_emb), ("blk", run_blk), ("out", run_out)):
        fb, st = [], []
        if clock is not None:
            clock.forget()  # the layers' bursts recur under the same keys: one layer's minima are its own
        for i in range(warmup + iters):
            if pause:
                time.sleep(pause)
            t0 = now()
            out, saved = _saved_bytes(fn)
            if out.requires_grad:  # not a frozen embedding
                out.backward(torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out))
            t1 = now()
            if opts[key] is not None:
                opts[key].step()
                opts[key].zero_grad(set_to_none=True)
            t2 = now()
            if clock is not None:
                clock.settle()  # the next iteration's bursts recur with the same keys
            if i >= warmup:
                fb.append(t1 - t0)
                st.append(t2 - t1)
            acts[key] = saved
        times[key], steps[key] = statistics.median(fb), statistics.median(st)
    # weights, gradients and two AdamW moments of what is trained; the weights alone of what is frozen
    weights = {k: sum((16 if p.requires_grad else 4) * p.numel() for p in v) for k, v in layers.items()}
    params = {k: sum(p.numel() for p in v) for k, v in layers.items()}
    return {"times": [times["emb"], times["blk"], times["out"]],  # per micro-batch, forward + backward
            "step_times": [steps["emb"], steps["blk"], steps["out"]],  # AdamW, once per iteration
            "weights": [weights["emb"], weights["blk"], weights["out"]],
            "params": [params["emb"], params["blk"], params["out"]],
            "acts": [acts["emb"], acts["blk"], acts["out"]], "hidden": H, "num_blocks": B,
            "lora": None if lora is None else {"r": lora.r, "targets": list(lora.targets)}}


def _virtual_clock():
    """This process's virtual clock (an emulated box on the virtual clock), else None."""
    from xronos.node.emulate import process_clock

    clock = process_clock()
    return clock if clock is not None and clock.name == "virtual" else None


def chain(profile: dict, micro_batches: int) -> tuple[list[float], list[float], list[float]]:
    """Expand [emb, blk, out] to the B + 2 layer chain: (time per micro-batch slot, weights, acts).
    The optimizer step runs once per iteration; it is spread over the M micro-batch slots."""
    B = profile["num_blocks"]

    def expand(v: list[float]) -> list[float]:
        return [v[0]] + [v[1]] * B + [v[2]]

    slot = [t + s / micro_batches for t, s in zip(profile["times"], profile["step_times"])]
    return expand(slot), expand(profile["weights"]), expand(profile["acts"])


def chain_params(profile: dict) -> list[float]:
    """Parameters per layer of the B + 2 chain (a profile from before they were recorded: its
    full fine-tuning weights at 16 B per parameter)."""
    B = profile["num_blocks"]
    per = profile.get("params") or [w / 16 for w in profile["weights"]]
    return [per[0]] + [per[1]] * B + [per[2]]
