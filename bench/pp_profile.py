"""Per-layer profile for the pipeline partitioner (Asteroid profiles each device at micro-batch size).

For the chain [emb, blk, out] we time forward + backward of ONE micro-batch through the very
modules a stage runs, and separately that layer's AdamW step (once per iteration), and count its resident bytes (weights, grads,
two AdamW moments = 16 B per fp32 parameter). Activation bytes per micro-batch are the saved
tensors autograd keeps for backward (measured with saved-tensor hooks). All blocks share a shape,
so one block stands for all B. Median over `iters` after `warmup`.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from xronos.bench.pp_model import ADAPTERS, Stage, StageSpan, _get


def _saved_bytes(fn) -> tuple[torch.Tensor, int]:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def profile_layers(model_dir: str, micro_rows: int, seq_len: int, *, iters: int = 5, warmup: int = 2,
                   pad_token_id: int = 0, seed: int = 0) -> dict:
    """{"times": [t_emb, t_blk, t_out], "weights": [...], "acts": [...], "hidden": H} (s, bytes)."""
    import json
    from pathlib import Path

    config = json.loads((Path(model_dir) / "config.json").read_text())
    from xronos.bench.pp_model import num_blocks

    B = num_blocks(config)
    torch.manual_seed(seed)
    stage = Stage(model_dir, StageSpan(0, B + 2, B), pad_token_id)
    stage.train()
    H = stage.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, stage.full_vocab, (micro_rows, seq_len), generator=g)
    mask = torch.ones_like(ids)
    labels = torch.randint(0, 2, (micro_rows,), generator=g)
    block = _get(stage.model, ADAPTERS[stage.family].blocks)[0]
    ad = ADAPTERS[stage.family]
    groups = {
        "emb": [p for n, p in stage.model.named_parameters() if n.startswith(tuple(m + "." for m in ad.embed))],
        "blk": list(block.parameters()),
        "out": [p for n, p in stage.model.named_parameters() if n.startswith(tuple(m + "." for m in ad.head))],
    }
    opts = {k: torch.optim.AdamW(v, lr=1e-5) for k, v in groups.items()}

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

    times, steps, acts = {}, {}, {}
    for key, fn in (("emb", run_emb), ("blk", run_blk), ("out", run_out)):
        fb, st = [], []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            out, saved = _saved_bytes(fn)
            out.backward(torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out))
            t1 = time.perf_counter()
            opts[key].step()
            opts[key].zero_grad(set_to_none=True)
            if i >= warmup:
                fb.append(t1 - t0)
                st.append(time.perf_counter() - t1)
            acts[key] = saved
        times[key], steps[key] = statistics.median(fb), statistics.median(st)
    weights = {k: 16 * sum(p.numel() for p in v) for k, v in groups.items()}
    return {"times": [times["emb"], times["blk"], times["out"]],  # per micro-batch, forward + backward
            "step_times": [steps["emb"], steps["blk"], steps["out"]],  # AdamW, once per iteration
            "weights": [weights["emb"], weights["blk"], weights["out"]],
            "acts": [acts["emb"], acts["blk"], acts["out"]], "hidden": H, "num_blocks": B}


def chain(profile: dict, micro_batches: int) -> tuple[list[float], list[float], list[float]]:
    """Expand [emb, blk, out] to the B + 2 layer chain: (time per micro-batch slot, weights, acts).
    The optimizer step runs once per iteration; it is spread over the M micro-batch slots."""
    B = profile["num_blocks"]

    def expand(v: list[float]) -> list[float]:
        return [v[0]] + [v[1]] * B + [v[2]]

    slot = [t + s / micro_batches for t, s in zip(profile["times"], profile["step_times"])]
    return expand(slot), expand(profile["weights"]), expand(profile["acts"])
