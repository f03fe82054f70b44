"""The standard benchmark grid (`make bench`): every cell side by side, then one summary.

    .venv/bin/python -m xronos.bench.grid [--quick] [--out bench/results]

Cells run one after another (each needs the whole machine's CPU). Shapes are the paper's at full
layer width with a realistic depth (`workloads.realistic_blocks`: at least 6 transformer blocks or a
quarter of the model, whichever is more), so the vocabulary does not dominate and the pipeline has
blocks to pipeline; every table says how many blocks. Memory caps scale with the fraction of the
model's parameters kept (`scenarios.py`), so a cell binds memory exactly when the full model would
on the real devices; a strategy whose plan exceeds a cap is reported infeasible, not timed. The
heterogeneous cells compare xronos (per-segment planner), xronos-paper (the paper's head-tied
greedy) and uniform side by side, with the pipeline, and transformers' own TP where it can shard
(LLaMA, head counts and MLP width divisible by the ranks). Every rank sits behind an emulated
1 Gbit/s link, the paper's LAN (network namespaces + tc, `bench/netem.py`; needs root, like the
cgroup quotas). The grid's summary (grid.md, grid-iteration.png, grid-predicted.png) collects the
per-cell ratios; a cell that fails is reported, not fatal.

On the virtual clock (the default, `--cpu-mode`; the link is then modelled at the cell's rate, not
shaped) `--repeats N` runs every cell N times, repeats interleaved (all cells, then all again), and
`--estimators min,med` each repeat under each burst estimator in turn; grid-targets.md tables per
cell and estimator xronos/uniform of every repeat, its spread ((max - min) / mean), and the
product's figures against issue #33's targets (`gridtargets.py`, which also reads them back from the
files). The first estimator's first repeat is the cell's result file; the others are
`<cell>_<estimator>_r<k>`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from xronos.bench.harness import CellSpec
from xronos.bench.netem import PAPER_RATE_MBIT
from xronos.bench.workloads import realistic_blocks
from xronos.node.emulate.cpumode import CPU_MODE_ENV
from xronos.node.emulate.estimator import DEFAULT_MODE

TP = ("xronos", "xronos-paper", "uniform", "pp")  # every cell: CellSpec's default network, the paper's 1 Gbit/s
# Iterations per strategy, the first WARMUP excluded: the first step runs 1.5-2.5x slow (allocation),
# the second still up to 5-8 % slow (pp, and TP on the larger LLaMA), from the third on steps agree
# within a few per cent (the sd every table gives: 2-4 % of a step on GPT-2-Medium at 6 blocks, measured
# under load). 8 measured steps where a step takes ~3 s, 6 on the 4-8 s TinyLlama cell; the grid's time
# goes mostly into fixed costs (profiling, ~60-110 s a cell; ~30-40 s to start each run).
# On the virtual clock the first iterations also fill the estimator's windows (a median over two or
# three samples per burst still follows the host's noise): 4 warm-up steps of 12, and the measured
# steps then agree within ~1-2 % (a Set-A GPT-2-Medium cell at load 11-14, bench/results/vclock.md).
ITERS, WARMUP = 12, 4


def _cell(scenario: str, model: str, strategies: tuple[str, ...] = TP, **kw) -> CellSpec:
    kw.setdefault("blocks", realistic_blocks(model))
    return CellSpec(scenario, model, strategies, iters=kw.pop("iters", ITERS), warmup=kw.pop("warmup", WARMUP), **kw)


STANDARD: list[CellSpec] = [
    _cell("set-a", "gpt2-medium", seq_len=32),
    _cell("set-b", "gpt2-medium", seq_len=32),
    _cell("set-c", "gpt2-medium", seq_len=32),
    _cell("set-a", "roberta-base", seq_len=64),
    # Grouped-query attention: 4 attention units (KV-head groups) over Set-B's 4 ranks, and 32 heads,
    # 4 KV heads and 5632 MLP columns divide 4, so transformers' own TP runs here too.
    _cell("set-b", "tinyllama-1.1b", (*TP, "hf-tp"), seq_len=32, iters=8),
    # The homogeneous control: transformers' own TP runs here (16 heads, 5632 divide 4). No memory
    # caps: this cell compares speed, and transformers' loader peaks above the scaled caps.
    _cell("homo", "mobilellama-1.4b", ("xronos", "uniform", "hf-tp"), blocks=1, seq_len=32, mem_scale=None,
          iters=8),
]
QUICK: list[CellSpec] = [STANDARD[0], STANDARD[-1]]
TTA = dict(scenario="set-a", strategies=("xronos", "uniform", "pp"), steps=40, bandwidth_mbit=PAPER_RATE_MBIT)
COLUMNS = ("xronos", "xronos-paper", "uniform", "pp", "hf-tp")


def summary_markdown(docs: list[dict], tta: dict | None, seconds: float) -> str:
    from xronos.bench.cellreport import cpu_emulation, memory_note, network

    nets = sorted({network(d) for d in docs})
    lines = ["# Benchmark grid", "",
             f"{len(docs)} cells in {seconds / 60:.1f} min. Machine: {docs[0]['environment']['cpu_model']}, "
             f"{docs[0]['environment']['cores']} cores (shared with other work: see each cell's load average), "
             f"{'; '.join(sorted({cpu_emulation(d['environment']) for d in docs}))} (`{CPU_MODE_ENV}`). "
             f"Network: {'; '.join(nets)}. Iteration times are the mean over the measured steps ± their sd.", "",
             "| cell | blocks | mem scale | " + " | ".join(f"{c} s" for c in COLUMNS) + " | xronos/uniform | "
             "xronos/xronos-paper | xronos/pp | xronos/ideal (measured fit) | xronos/ideal (whole heads) | "
             "xronos/ideal (profile) | uniform/hf-tp | max idle xronos | max idle xronos-paper | max idle uniform | "
             "MAPE xronos |",
             "|" + "---|" * (3 + len(COLUMNS) + 11)]

    def it(d, s):
        v = d["summary"].get(s)
        if v:
            same = f" (= {v['same_layout_as']})" if v.get("same_layout_as") else ""
            return f"{v['iteration_s']:.3f} ± {v['iteration_s_stdev']:.3f}{same}"
        e = d["strategies"].get(s)
        if e is None:
            return "–"
        return "n/a" if "not_run" in e else ("infeasible" if "infeasible" in e else "failed")

    def ratio(d, k):
        v = d["ratios"].get(k)
        return "–" if v is None else f"{v:.3f}"

    def idle(d, s):
        v = d["summary"].get(s)
        return "–" if not v else f"{100 * v['max_idle_ratio']:.1f}%"

    def scale(d):
        v = d["scenario"].get("mem_scale")
        return "none" if not any(d["scenario"]["memory_caps"]) else ("fixed" if v is None else f"{v:.3f}")

    for d in docs:
        x = d["summary"].get("xronos", {})
        mape = x.get("mape_pct")
        lines.append(f"| {d['spec']['cell_name']} | {d['model']['blocks']}/{d['model']['paper_blocks']} | {scale(d)} | "
                     + " | ".join(it(d, c) for c in COLUMNS) + " | "
                     f"{ratio(d, 'xronos/uniform')} | {ratio(d, 'xronos/xronos-paper')} | {ratio(d, 'xronos/pp')} | "
                     f"{ratio(d, 'xronos/ideal (measured fit)')} | {ratio(d, 'xronos/ideal (measured fit, whole heads)')} | "
                     f"{ratio(d, 'xronos/ideal (profile)')} | {ratio(d, 'uniform/hf-tp')} | {idle(d, 'xronos')} | "
                     f"{idle(d, 'xronos-paper')} | {idle(d, 'uniform')} | "
                     f"{'–' if mape is None else f'{mape:.1f}%'} |")
    lines += ["", "Memory caps per cell: " + "; ".join(f"{d['spec']['cell_name']}: {memory_note(d)}" for d in docs)]
    infeasible = [f"{d['spec']['cell_name']} {s}: {e['infeasible'].splitlines()[0][:200]}"
                  for d in docs for s, e in d["strategies"].items() if "infeasible" in e]
    if infeasible:
        lines += ["", "Infeasible (plan over a memory cap; not timed): " + "; ".join(infeasible)]
    if tta:
        lines += ["", "Time to accuracy (MiniLM, target "
                  f"{tta['tta']['target']:.0%}): " + ", ".join(
                      f"{k} {'not reached' if v is None else f'{v:.1f} s'}"
                      for k, v in tta["tta"]["time_to_target_s"].items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from xronos.bench import cellreport, results
    from xronos.bench.harness import run_cell, validate
    from xronos.bench.tta import run_tta

    ap = argparse.ArgumentParser(prog="python -m xronos.bench.grid", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="Set-A and the homogeneous control only, no TTA")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--rerender", action="store_true",
                    help="run nothing: re-summarize the cells' JSON already in --out, rewrite tables and plots")
    ap.add_argument("--cpu-mode", choices=("virtual", "quota", "pace"), default="virtual")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every cell, interleaved (3 for stability)")
    ap.add_argument("--estimators", default=DEFAULT_MODE, help="virtual clock: burst estimators, each repeat under each")
    ap.add_argument("--cells", default="", help="only these cells (names, comma-separated)")
    args = ap.parse_args(argv)
    cells = QUICK if args.quick else STANDARD
    if args.cells:
        cells = [c for c in STANDARD if c.cell_name in args.cells.split(",")]
        if not cells:
            raise SystemExit(f"no cell named {args.cells!r}; known: {', '.join(c.cell_name for c in STANDARD)}")
    if args.rerender:
        return rerender(cells, args.out, with_tta=True)
    from xronos.bench.command import cpu_mode

    estimators = [e for e in args.estimators.split(",") if e] if args.cpu_mode == "virtual" else [DEFAULT_MODE]
    if args.repeats < 1 or not estimators:
        raise SystemExit("--repeats must be >= 1 and --estimators name at least one")
    for est in estimators:
        with cpu_mode(args.cpu_mode, est):
            for spec in cells:
                validate(spec)  # refuse the whole grid before spending time on any cell
    t0 = time.time()
    docs: list[dict] = []
    runs: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.repeats):
        for spec in cells:
            for est in estimators:
                first = rep == 0 and est == estimators[0]
                print(f"== {spec.cell_name} ({args.cpu_mode}, {est}, repeat {rep + 1}/{args.repeats})", flush=True)
                with cpu_mode(args.cpu_mode, est):
                    doc = results.summarize(run_cell(spec))
                if not first:
                    doc["spec"]["cell_name"] = f"{spec.cell_name}_{est}_r{rep}"
                results.write(doc, args.out, plots=first)
                print(cellreport.markdown(doc), flush=True)
                runs.setdefault((spec.cell_name, est), []).append(doc)
                if first:
                    docs.append(doc)
    tta = None
    if not args.quick and not args.cells:
        with cpu_mode(args.cpu_mode, estimators[0]):
            tta = run_tta(TTA["scenario"], TTA["strategies"], steps=TTA["steps"], bandwidth_mbit=TTA["bandwidth_mbit"])
        results.write(tta, args.out)
    write_summary(docs, tta, args.out, time.time() - t0)
    if args.repeats > 1 or len(estimators) > 1:
        from xronos.bench import gridtargets

        md = gridtargets.markdown(gridtargets.targets(runs), str(args.out))
        results.atomic_write(args.out / "grid-targets.md", md.encode())
        print(md)
    return 0


def rerender(cells: list[CellSpec], out: Path, with_tta: bool) -> int:
    from xronos.bench import results

    docs, seconds = [], 0.0
    for spec in cells:
        path = out / f"{spec.cell_name}.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no result to re-render (run the grid first)")
        doc = results.summarize(json.loads(path.read_text()))
        results.write(doc, out)
        docs.append(doc)
        seconds += doc["environment"].get("finished_at", 0) - doc["environment"].get("started_at", 0)
    tta = None
    tta_path = out / f"tta_{TTA['scenario']}.json"
    if with_tta and tta_path.is_file():
        tta = json.loads(tta_path.read_text())
        summarize_tta = results.summarize(tta)
        results.write(summarize_tta, out)
    write_summary(docs, tta, out, seconds)
    return 0


def write_summary(docs: list[dict], tta: dict | None, out: Path, seconds: float) -> None:
    from xronos.bench import plots, results

    md = summary_markdown(docs, tta, seconds)
    pts = [(f"{d['scenario']['name']} {s}", p, m) for d in docs for s, v in d["summary"].items()
           for p, m in v.get("predicted_vs_measured", [])]
    results.atomic_write(out / "grid.md", md.encode())
    results.atomic_write(out / "grid-iteration.png", plots.iteration_bars(docs, "Iteration time per cell"))
    if pts:
        results.atomic_write(out / "grid-predicted.png", plots.predicted_scatter(pts, "Predicted vs measured"))
    results.atomic_write(out / "grid.json", json.dumps(
        {"cells": [d["spec"]["cell_name"] for d in docs], "ratios": {d["spec"]["cell_name"]: d["ratios"] for d in docs},
         "seconds": seconds}, indent=1).encode())
    print(md)


if __name__ == "__main__":
    sys.exit(main())
