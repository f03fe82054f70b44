"""xronos against uniform with the two strategies interleaved inside one run, on the virtual clock.

    .venv/bin/python -m xronos.bench.interleave [--cells set-a_gpt2-medium_s32_b6,...] [--pairs 3]
        [--phase 8] [--warmup 3] [--estimators med,min] [--out bench/results]

Why: the grid runs each strategy in its own processes, minutes apart, and the host's speed drifts
between runs (Set-B's uniform ran the same layout at 0.90, 0.90 and 0.76 s of compute in three
repeats, bench/results/vgrid): xronos/uniform then moves by 2-12 % between repeats for reasons that
are the host's. Here one run trains the cell's model with uniform's layout, then xronos's, then
uniform's again and so on (`--pairs` pairs of `--phase` steps each), the trainer re-sharding live
between them (`RunConfig.reshard_at`: exact, the weights and optimizer state move), so each pair's
two layouts are measured seconds apart in the same processes. Each phase's first `--warmup` steps
are left out: the one with the move, and those whose burst estimates the clock is refilling (a
re-shard clears its history). Per pair: the mean over the measured steps of the slowest rank's
iteration, xronos/uniform, and the worst per-rank idle of each layout; over the pairs: the spread
of xronos/uniform ((max - min) / mean), the figure issue #33 asks to be within 2 %.

Layouts come from the grid's own planning (`strategies.tp_plan` over the devices' profiles, taken
in the same clock), so the pairs compare exactly the grid's xronos and uniform. Results:
interleave.json and interleave.md in --out, naming the clock, the estimator and the host's load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ORDER = ("uniform", "xronos")  # every pair: uniform's phase, then xronos's
KEPT = ("step", "iteration_s", "compute_s", "comm_s", "idle_s", "reshard_s", "wall_s")  # per iteration, per rank


def schedule(pairs: int, phase: int) -> list[tuple[int, str]]:
    """(first step, strategy) of every phase, in order."""
    if pairs < 1 or phase < 2:
        raise ValueError(f"need pairs >= 1 and phase >= 2 steps, got {pairs} and {phase}")
    return [(i * phase, ORDER[i % 2]) for i in range(2 * pairs)]


def phase_figures(ranks: list[list[dict]], start: int, end: int, warmup: int) -> dict:
    """One phase's figures from every rank's per-iteration records (`step`, `iteration_s`,
    `idle_s`): steps [start + warmup, end). The iteration is the slowest rank's (they agree on the
    virtual clock up to rounding), idle the worst rank's share of it."""
    keep = [[r for r in rank if start + warmup <= r["step"] < end] for rank in ranks]
    n = min(len(k) for k in keep)
    if n == 0:
        raise ValueError(f"no measured step in [{start + warmup}, {end}): a phase must be longer than its warm-up")
    per_step = [max(k[i]["iteration_s"] for k in keep) for i in range(n)]
    it = statistics.mean(per_step)
    idle = [statistics.mean(r["idle_s"] for r in k[:n]) / it for k in keep]
    return {"steps": n, "iteration_s": it, "iteration_s_stdev": statistics.pstdev(per_step),
            "idle": idle, "worst_idle": max(idle)}


def pair_figures(ranks: list[list[dict]], pairs: int, phase: int, warmup: int) -> dict:
    """Per pair xronos/uniform and both layouts' figures; over the pairs the spread."""
    phases = schedule(pairs, phase)
    out = []
    for p in range(pairs):
        figs = {}
        for start, strat in phases[2 * p: 2 * p + 2]:
            figs[strat] = phase_figures(ranks, start, start + phase, warmup)
        figs["ratio"] = figs["xronos"]["iteration_s"] / figs["uniform"]["iteration_s"]
        out.append(figs)
    ratios = [f["ratio"] for f in out]
    mean = statistics.mean(ratios)
    return {"pairs": out, "ratios": ratios, "ratio_mean": mean,
            "spread": (max(ratios) - min(ratios)) / mean if mean > 0 else 0.0}


def interleaved(spec, pairs: int, phase: int, warmup: int):
    """The grid cell's spec with this run's steps (its data rows follow them) and warm-up."""
    return dataclasses.replace(spec, iters=2 * pairs * phase, warmup=warmup)


def run_cell(spec, pairs: int, phase: int, warmup: int, scratch: str | None = None) -> dict:
    """Profile and plan the cell as the grid does, then one run alternating the two layouts."""
    from xronos.bench import harness
    from xronos.bench import strategies as st
    from xronos.node.rank.local import launch_local
    from xronos.node.runconfig import ReshardAt, RunConfig

    spec = interleaved(spec, pairs, phase, warmup)
    sc, config = harness.validate(spec)
    caps = harness.cell_caps(spec, sc)
    doc: dict = {"cell": spec.cell_name, "pairs": pairs, "phase": phase, "warmup": warmup,
                 "loadavg_start": os.getloadavg(), "started_at": time.time()}
    with tempfile.TemporaryDirectory(prefix="xronos-interleave-", dir=scratch) as tmp:
        work = Path(tmp)
        ctx = harness.cell_context(spec, sc, config, caps, work)
        t0 = time.perf_counter()
        profiles = st.profile_devices(ctx, True, False)
        doc["profiling_s"] = time.perf_counter() - t0
        plans = {s: st.tp_plan(ctx, profiles, s) for s in ORDER}
        for s, plan in plans.items():
            why = st.over_cap(plan)
            if why:
                raise st.Infeasible(f"{s}: {why}")
        layouts = {s: plans[s].layout for s in ORDER}
        doc["layouts"] = {s: layouts[s].to_text() for s in ORDER}
        doc["predicted_iteration_s"] = {s: plans[s].predicted_iteration_s for s in ORDER}
        if layouts["xronos"] == layouts["uniform"]:
            raise st.Infeasible("xronos planned uniform's layout: nothing to interleave")
        phases = schedule(pairs, phase)
        metrics = work / "metrics.json"
        cfg = RunConfig(recipe=st.cell_recipe(ctx), layout=layouts[phases[0][1]], threads=1,
                        metrics_path=str(metrics), progress=False, gloo_timeout_s=600,
                        reshard_at=tuple(ReshardAt(step=s, layout=layouts[strat]) for s, strat in phases[1:]))
        n = cfg.layout.world_size
        t0 = time.perf_counter()
        with st.confine(ctx, st.limits(ctx, list(range(n)))) as conf:
            launch_local(cfg, n, wrap=conf.wrap, echo_rank0=False)
            doc["quotas"] = conf.quotas()
        doc["run_wall_s"] = time.perf_counter() - t0
        m = json.loads(metrics.read_text())
    moved = [r["step"] for r in m.get("reshards", [])]
    if moved != [s for s, _ in phases[1:]]:  # a refused move leaves phases that are not what they say
        why = "; ".join(r["refused"] for r in m.get("reshards_refused", [])) or "no reason recorded"
        raise RuntimeError(f"the run moved before steps {moved}, not {[s for s, _ in phases[1:]]}: {why}")
    doc["reshard_s"] = [r["seconds"] for r in m["reshards"]]
    doc["clock"] = m.get("clock")
    doc["ranks"] = [[{k: it[k] for k in KEPT if k in it} for it in r["iterations"]] for r in m["ranks"]]
    doc["figures"] = pair_figures(doc["ranks"], pairs, phase, warmup)
    doc["loadavg_end"] = os.getloadavg()
    return doc


def markdown(docs: list[dict]) -> str:
    lines = ["# xronos / uniform, interleaved in one run (virtual clock)", "",
             "Each row: one run alternating uniform's and xronos's layouts by live re-shards; per pair, "
             "the mean over the measured steps of the slowest rank's iteration (virtual seconds). "
             "Spread: (max - min) / mean of the pairs' ratios (#33: <= 2 %).", "",
             "| cell | estimator | load start/end | pairs x steps (warm-up) | uniform s per pair | xronos s per pair | "
             "xronos/uniform per pair | spread | worst idle xronos | worst idle uniform | run wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in docs:
        if "error" in d:
            lines.append(f"| {d['cell']} | {d.get('estimator', '')} | | | failed: {d['error'][:200]} ||||||| ")
            continue
        f = d["figures"]
        u = " ".join(f"{p['uniform']['iteration_s']:.3f}" for p in f["pairs"])
        x = " ".join(f"{p['xronos']['iteration_s']:.3f}" for p in f["pairs"])
        r = " ".join(f"{v:.3f}" for v in f["ratios"])
        wi = lambda s: " ".join(f"{100 * p[s]['worst_idle']:.1f}" for p in f["pairs"])  # noqa: E731
        lines.append(f"| {d['cell']} | {d.get('estimator', '')} | {d['loadavg_start'][0]:.1f}/{d['loadavg_end'][0]:.1f} | "
                     f"{d['pairs']} x {d['phase']} ({d['warmup']}) | {u} | {x} | {r} | {100 * f['spread']:.1f} % | "
                     f"{wi('xronos')} % | {wi('uniform')} % | {d['run_wall_s']:.0f} |")
    lines += ["", "Layouts: " + "; ".join(f"{d['cell']}: uniform {d['layouts']['uniform']}, xronos {d['layouts']['xronos']}"
                                         for d in docs if "layouts" in d)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from xronos.bench import results
    from xronos.bench.command import cpu_mode
    from xronos.bench.grid import STANDARD
    from xronos.bench.harness import validate

    ap = argparse.ArgumentParser(prog="python -m xronos.bench.interleave", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="set-a_gpt2-medium_s32_b6,set-b_gpt2-medium_s32_b6,"
                                        "set-a_roberta-base_s64_b6,set-b_tinyllama-1.1b_s32_b6")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--phase", type=int, default=8, help="steps per phase")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out at the start of every phase")
    ap.add_argument("--estimators", default="med,min")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--name", default="interleave", help="result files' stem")
    a = ap.parse_args(argv)
    names = [c for c in a.cells.split(",") if c]
    known = {c.cell_name: c for c in STANDARD}
    unknown = [c for c in names if c not in known]
    if unknown:
        raise SystemExit(f"no cell named {', '.join(unknown)}; known: {', '.join(known)}")
    if not a.warmup < a.phase:
        raise SystemExit(f"--warmup {a.warmup} must be below --phase {a.phase}")
    schedule(a.pairs, a.phase)  # refuses bad counts before any process starts
    estimators = [e for e in a.estimators.split(",") if e]
    for est in estimators:
        with cpu_mode("virtual", est):
            for c in names:
                validate(interleaved(known[c], a.pairs, a.phase, a.warmup))
    docs = []
    for c in names:
        for est in estimators:
            print(f"== {c} ({est})", flush=True)
            with cpu_mode("virtual", est):
                try:
                    doc = run_cell(known[c], a.pairs, a.phase, a.warmup)
                except Exception as exc:  # a cell failing is a result, not the end of the bench
                    doc = {"cell": c, "error": f"{type(exc).__name__}: {exc}"[-2000:]}
            doc["estimator"] = est
            docs.append(doc)
            print(markdown([doc]), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    results.atomic_write(a.out / f"{a.name}.json", json.dumps(docs).encode())
    md = markdown(docs)
    results.atomic_write(a.out / f"{a.name}.md", md.encode())
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
