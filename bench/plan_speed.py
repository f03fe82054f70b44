"""How fast and how close does the gateway plan? `python -m xronos.bench.plan_speed [--nodes 64]`.

Builds synthetic but schema-valid ProfileReports for N heterogeneous nodes of a GPT-2-medium-
shaped model (16 heads, 4096 MLP columns, 50,000 vocabulary rows, 24 blocks), then

1. *speed*, memory plentiful (4, 8 or 16 GiB a node): per strategy, the planner alone, the whole
   `xronos plan` path in process (JSON files on disk -> validation -> cost model -> plan ->
   printed table) and the same command as a fresh process (interpreter start and imports);
2. *binding caps*, `--seeds` instances per node count in `--gap-nodes`: each node's memory is
   its fair share of the model times 0.9 + 0.3 x slowness x U(0.5, 1.5) — the fast nodes the
   tightest, so that the caps couple the kinds — and the `segment` plan's time, its compute
   against the proven lower bound (the gap), whether it is proven optimal, and the search's size.

Prints the figures; the house rule is that speed is measured here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from xronos.gateway.plan.costmodel import node_cost, tied
from xronos.gateway.plan.memorymodel import not_coexisting
from xronos.gateway.plan.planner import STRATEGIES, plan
from xronos.gateway.plan.profiles import memory_cap, node_profile
from xronos.protocol.layout import KINDS
from xronos.protocol.layout import Sizes
from xronos.protocol.messages import ArchSpec, Capabilities, LayerProfile, ProfileReport

GiB = 1024**3
SAMPLE_RATIOS = (0.25, 0.5, 1.0)


def synthetic_report(
    node_id: str,
    *,
    slowness: float = 1.0,
    overhead_s: float = 0.002,
    memory_available: int = 8 * GiB,
    units: int = 16,
    num_blocks: int = 24,
    hidden: int = 1024,
    batch_size: int = 8,
    seq_len: int = 32,
    task: str = "classify",
) -> ProfileReport:
    """A plausible profile: partitioned layers cost `overhead_s + slowness * work * p`."""
    act = batch_size * seq_len * hidden * 4

    def part(name: str, kind: str, work: float, weights: int, acts: int, temp: int) -> LayerProfile:
        samples = [(p, overhead_s + slowness * work * p) for p in SAMPLE_RATIOS]
        segment = "vocab" if kind == "emb" else name
        return LayerProfile(name=name, kind=kind, partitioned=True, segment=segment, time_s=samples[-1][1],
                            time_samples=samples, weight_bytes=weights, activation_bytes=acts,
                            temp_bytes=temp)

    def repl(name: str, kind: str, work: float, weights: int, acts: int, temp: int) -> LayerProfile:
        return LayerProfile(name=name, kind=kind, partitioned=False, time_s=slowness * work,
                            time_samples=[], weight_bytes=weights, activation_bytes=acts, temp_bytes=temp)

    w = hidden * hidden * 4 * 4  # one [h, h] fp32 matrix with grad and two AdamW moments
    layers = [
        part("emb", "emb", 0.004, 50_000 * w // hidden, act, act),
        part("attn", "blk", 0.030, 4 * w, 4 * act, 8 * act),
        part("mlp", "blk", 0.050, 8 * w, 6 * act, 8 * act),
        repl("norms", "blk", 0.002, 4 * hidden * 4, 2 * act, act),
        repl("head", "out", 0.001, 2 * hidden * 4 * 4, act // seq_len, act),
    ]
    caps = Capabilities(node_id=node_id, hostname=node_id, arch="x86_64", cpu_model="synthetic",
                        cores=4, memory_total=memory_available * 2, memory_available=memory_available,
                        torch_version=None, data_host="127.0.0.1", sent_at=0.0)
    arch = ArchSpec(family="gpt2", hidden_size=hidden, num_layers=num_blocks, num_heads=units,
                    num_kv_heads=units, intermediate_size=4 * hidden, vocab_size=50_000,
                    max_positions=1024, num_labels=2 if task == "classify" else None,
                    tie_word_embeddings=True)
    return ProfileReport(node_id=node_id, request_id="bench", job_id="bench", capabilities=caps,
                         arch=arch, task=task, batch_size=batch_size, seq_len=seq_len, threads=None,
                         sizes=Sizes(attn=units, mlp=4 * hidden, vocab=50_000), num_blocks=num_blocks, layers=layers, profile_seconds=1.0,
                         created_at=0.0)


def _best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def tight_reports(n: int, seed: int, units: int = 16) -> list[ProfileReport]:
    """Nodes whose memory is about their fair share of the model, the fast ones the tightest."""
    rng = random.Random(seed)
    probe = node_cost(node_profile(synthetic_report("probe", units=units)))
    # the partitioned model's bytes at share 1, as predict_memory counts them (less what never coexists)
    model = sum(probe.kind(k).mem_slope for k in KINDS) - (
        not_coexisting(probe, tied(1.0)) - not_coexisting(probe, tied(0.0)))
    fixed = (probe.mem_repl - not_coexisting(probe, tied(0.0))
             + 2 * max(probe.temp_repl, *(probe.kind(k).temp_slope for k in KINDS)))
    out = []
    for d in range(n):
        slow = rng.uniform(1, 4)
        mem = fixed + model / n * (0.9 + 0.3 * slow * rng.uniform(0.5, 1.5)) + 512 * 1024**2
        out.append(synthetic_report(f"node{d:02d}", slowness=slow, units=units, memory_available=int(mem)))
    return out


def gaps(node_counts: list[int], seeds: int, repeat: int) -> None:
    print(f"binding caps, segment strategy ({seeds} instances per N, best of {repeat}):")
    worst = 0.0
    for n in node_counts:
        for seed in range(seeds):
            reports = tight_reports(n, seed)
            nodes = [node_cost(node_profile(r)) for r in reports]
            caps = [memory_cap(r) for r in reports]
            sizes = reports[0].sizes
            res = plan(nodes, sizes, "segment", caps)
            t = _best_of(lambda: plan(nodes, sizes, "segment", caps), repeat)
            s = res.search
            worst = max(worst, res.gap)
            print(f"  N={n:>3} seed {seed}: {t * 1e3:8.1f} ms  compute {s.objective_s:.5f} s  lower bound "
                  f"{res.lower_bound_s:.5f} s  gap {100 * res.gap:.3f}%  separable {s.separable_s:.5f}  "
                  f"ideal {res.ideal_compute_s:.5f}  {'optimal' if res.optimal else 'not proven'}  "
                  f"coupled={s.coupled} boxes={s.boxes} exact_test={s.exact_test}")
    print(f"  largest gap to the proven lower bound: {100 * worst:.3f}%")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--units", type=int, default=16, help="attention heads (default: GPT-2-Medium's 16)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gap-nodes", default="3,5,16,64", help="node counts of the binding-caps instances")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    from xronos.cli.main import main as xronos_main

    rng = random.Random(0)
    reports = [synthetic_report(f"node{d:02d}", slowness=rng.uniform(1, 4), units=args.units,
                                memory_available=rng.choice([4, 8, 16]) * GiB)
               for d in range(args.nodes)]
    nodes = [node_cost(node_profile(r)) for r in reports]
    caps = [memory_cap(r) for r in reports]
    sizes = reports[0].sizes
    print(f"N = {args.nodes} nodes, {sizes.describe()} (best of {args.repeat}); memory plentiful")
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for r in reports:
            path = Path(tmp) / f"{r.node_id}.json"
            path.write_text(json.dumps(r.model_dump(mode="json")))
            paths.append(str(path))
        for strategy in STRATEGIES:
            core = _best_of(lambda: plan(nodes, sizes, strategy, caps), args.repeat)

            def cli() -> None:
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    xronos_main(["plan", *paths, "--strategy", strategy])

            whole = _best_of(cli, args.repeat)
            cmd = [sys.executable, "-m", "xronos.cli.main", "plan", *paths, "--strategy", strategy]
            cold = _best_of(lambda: subprocess.run(cmd, capture_output=True, check=True), args.repeat)
            res = plan(nodes, sizes, strategy, caps)
            print(f"{strategy:>8}: planner {core * 1e3:7.2f} ms | in-process xronos plan "
                  f"(load+validate+plan+print) {whole * 1e3:7.2f} ms | fresh process {cold * 1e3:7.1f} ms | "
                  f"compute {res.bottleneck_s:.4f} s, ideal {res.ideal_compute_s:.4f} s")
    if args.gap_nodes:
        gaps([int(x) for x in args.gap_nodes.split(",")], args.seeds, args.repeat)


if __name__ == "__main__":
    main()
