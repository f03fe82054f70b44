"""Which width quantum keeps GEMM throughput? `python -m xronos.bench.quantum [--out FILE.md]`.

The per-segment layout cuts the MLP's intermediate columns and the vocabulary's rows at multiples
of a quantum q. A smaller q balances finer; a width that is not a multiple of the CPU's vector
and cache blocking runs the GEMM's edge kernels and loses throughput. This measures, on this
machine and one thread (the training ranks' setting), one fine-tuning pass of the shard's GEMMs

    forward  y = x W_local^T       x [M, E], W_local [w, E]
    backward dx = dy W_local, dW = dy^T x

for every width w in a window around a typical share. Widths are grouped by the largest power of
two that divides them; each group's mean per-column cost is compared with that of the multiples
of 128. The quantum is the smallest q such that every group of multiples of q stays within
`--tolerance`.
Speed is measured here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128)
# (name, M = batch * seq tokens, E = hidden, window of widths): GPT-2-Medium's MLP at batch 8 x 32
# around a quarter share of 4096 columns, and its LM head around a share of the 50257 rows.
CASES = (
    ("mlp  gpt2-medium M=256 E=1024", 256, 1024, range(896, 1153)),
    ("vocab gpt2-medium M=256 E=1024", 256, 1024, range(3008, 3265)),
    ("mlp  roberta-base M=512 E=768", 512, 768, range(640, 897)),
)


def pass_seconds(M: int, E: int, w: int, reps: int) -> float:
    """Median seconds of one forward + backward of the shard's GEMMs at width w."""
    g = torch.Generator().manual_seed(w)
    x = torch.randn(M, E, generator=g)
    W = torch.randn(w, E, generator=g)
    dy = torch.randn(M, w, generator=g)
    for _ in range(2):
        _ = x @ W.t(), dy @ W, dy.t() @ x
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _ = x @ W.t()
        _ = dy @ W
        _ = dy.t() @ x
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(M: int, E: int, widths: range, reps: int) -> dict[int, float]:
    """Seconds per column at each width (interleaved over two sweeps to spread drift)."""
    per_col: dict[int, list[float]] = {w: [] for w in widths}
    for sweep in range(2):
        order = list(widths) if sweep == 0 else list(reversed(widths))
        for w in order:
            per_col[w].append(pass_seconds(M, E, w, reps) / w)
    return {w: min(v) for w, v in per_col.items()}


def quantum(per_col: dict[int, float], tolerance: float) -> tuple[int, dict[int, float]]:
    """Smallest candidate q such that no width that is a multiple of q costs, per column, more
    than `tolerance` above the widths that are multiples of the largest candidate.

    Widths are grouped by their exact power-of-two factor (odd, 2 mod 4, ..., multiple of 128),
    and each group's mean per-column cost is compared with the top group's: single widths are
    too noisy (a few %) to compare one by one, groups of 8-64 widths are not.
    """
    top = CANDIDATES[-1]

    def group(w: int) -> int:
        return next(q for q in reversed(CANDIDATES) if w % q == 0)

    by_group: dict[int, list[float]] = {}
    for w, c in per_col.items():
        by_group.setdefault(group(w), []).append(c)
    ref = statistics.mean(by_group.get(top) or min(by_group.values(), key=statistics.mean))
    excess = {q: statistics.mean(v) / ref - 1.0 for q, v in sorted(by_group.items())}
    chosen = next((q for q in CANDIDATES if all(e <= tolerance for g, e in excess.items() if g >= q)), top)
    return chosen, excess


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tolerance", type=float, default=0.02, help="allowed per-column loss (0.02 = 2%%)")
    ap.add_argument("--out", type=Path, help="also write the table as Markdown")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    lines = [f"# GEMM width quantum (1 thread, torch {torch.__version__}, tolerance "
             f"{100 * args.tolerance:.0f}%)", "",
             "Mean per-column cost of the widths whose largest power-of-two factor is q, relative to the "
             "multiples of 128 (forward + backward GEMMs of one shard; window of 257 widths).", "",
             "| case | " + " | ".join(f"q={q}" for q in CANDIDATES) + " | chosen |",
             "|---|" + "---|" * (len(CANDIDATES) + 1)]
    for name, M, E, widths in CASES:
        per_col = measure(M, E, widths, args.reps)
        q, worst = quantum(per_col, args.tolerance)
        cells = " | ".join(f"+{100 * worst[c]:.1f}%" if c in worst else "–" for c in CANDIDATES)
        lines.append(f"| {name} | {cells} | {q} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
