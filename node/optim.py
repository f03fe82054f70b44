"""The one optimizer every training rank and the profiler build: AdamW with the job's settings.

One definition, so that what the profiler times and measures (speed and the step's peak memory)
is what training runs, and a library setting that trades speed for memory (e.g. AdamW's
multi-tensor `foreach` path, whose temporaries set a rank's peak) is changed in one place.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def adamw(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW as the trainer runs it (torch's defaults otherwise: betas, eps, foreach on CPU)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
