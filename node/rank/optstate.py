"""AdamW's state allocated when the optimizer is built, not at its first step.

torch creates each parameter's `exp_avg` and `exp_avg_sq` lazily inside the first `step()`, while
that iteration's gradients are alive and after its activations were freed. Under the training
ranks' allocator setting (`xronos.node.measure.allocator`: freed blocks stay in the heap) those 2 x the
parameters' bytes then land above the space the activations and gradients cycle through, and the
next iteration's gradients no longer fit the holes they left: a GPT-2-Medium rank grew by another
150 MiB in its second backward pass. Allocated up front, the long-lived state sits below the
per-iteration working set, whose pattern then repeats every iteration (the resident set stops
growing after the first). The values are torch's own lazy initialisation (zeros, step 0), so the
first step computes exactly what it would have.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import _get_scalar_dtype


def allocate_state(opt: torch.optim.AdamW) -> None:
    """Create the state torch's AdamW would create at its first step, for every parameter that
    has none yet (a resumed optimizer's loaded moments are kept)."""
    for group in opt.param_groups:
        fused_or_capturable = bool(group.get("fused")) or bool(group.get("capturable"))
        for p in group["params"]:
            state = opt.state[p]
            if len(state) != 0:
                continue
            if fused_or_capturable:
                state["step"] = torch.zeros((), dtype=_get_scalar_dtype(is_fused=bool(group.get("fused"))),
                                            device=p.device)
            else:
                state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
