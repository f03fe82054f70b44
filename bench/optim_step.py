"""AdamW's three CPU implementations side by side: time and peak memory of one optimizer step.

    python -m xronos.bench.optim_step [--shape gpt2-medium-block] [--reps 7] [--threads 1]

Each variant runs in its own child process (so one variant's freed heap never hides another's
peak), on the parameter shapes of one model part with random gradients, and reports the median
step time and the step's peak resident-set growth over the state it leaves (VmHWM after the step
minus VmRSS before it, with the AdamW state already allocated by two warm-up steps). This is the
measurement behind `node/rank/optim.py`'s choice of implementation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

# name -> parameter shapes ([out, in] matrices and vectors) of one model part.
SHAPES: dict[str, list[tuple[int, ...]]] = {
    # One GPT-2-Medium block (hidden 1024, MLP 4096): qkv, proj, fc, fc-proj, 2 layer norms, biases.
    "gpt2-medium-block": [(3072, 1024), (3072,), (1024, 1024), (1024,), (4096, 1024), (4096,),
                          (1024, 4096), (1024,), (1024,), (1024,), (1024,), (1024,)],
    # The real MiniLM (hidden 384, 6 blocks, vocabulary 30522): embeddings and six blocks.
    "minilm": [(30522, 384), (512, 384), (2, 384), (384,), (384,)]
    + [(384, 384), (384,)] * 4 * 6 + [(1536, 384), (1536,), (384, 1536), (384,)] * 6 + [(384,)] * 4 * 6,
}
VARIANTS = ("for-loop", "foreach", "fused")


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_hwm() -> None:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(shape: str, variant: str, reps: int, threads: int) -> dict[str, float]:
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES[shape]]
    for p in params:
        p.grad = torch.randn_like(p)
    kw = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[variant]
    opt = torch.optim.AdamW(params, lr=1e-4, **kw)
    for _ in range(2):
        opt.step()
    times, peaks = [], []
    for _ in range(reps):
        before = _rss_kib("VmRSS")
        _reset_hwm()
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
        peaks.append(_rss_kib("VmHWM") - before)
    n = sum(p.numel() for p in params)
    return {"params": n, "step_s": statistics.median(times), "peak_mib": max(peaks) / 1024}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gpt2-medium-block")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.shape, a.child, a.reps, a.threads)))
        return
    rows = {}
    for v in VARIANTS:
        out = subprocess.run([sys.executable, "-m", "xronos.bench.optim_step", "--shape", a.shape,
                              "--reps", str(a.reps), "--threads", str(a.threads), "--child", v],
                             check=True, capture_output=True, text=True).stdout
        rows[v] = json.loads(out)
    n = rows["fused"]["params"]
    print(f"AdamW step, {a.shape} ({n / 1e6:.1f} M params, {a.threads} thread(s), median of {a.reps})")
    print(f"{'variant':<10} {'step ms':>9} {'x fused':>8} {'peak MiB':>9}")
    for v, r in rows.items():
        print(f"{v:<10} {r['step_s'] * 1e3:9.1f} {r['step_s'] / rows['fused']['step_s']:8.2f} {r['peak_mib']:9.1f}")


if __name__ == "__main__":
    main()
