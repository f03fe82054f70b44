"""The standard benchmark grid (`make bench`): every cell side by side, then one summary.

    .venv/bin/python -m xronos.bench.grid [--quick] [--out bench/results]

Cells run one after another (each needs the whole machine's CPU). Shapes are the paper's with one
transformer block kept (`--blocks 1`, full layer width) so that the grid fits in under 40 minutes on
two idle cores; every table says so. Every rank sits behind an emulated 1 Gbit/s link, the paper's
LAN (network namespaces + tc, `bench/netem.py`; needs root, like the cgroup quotas). The grid's
summary (grid.md, grid-iteration.png, grid-predicted.png) collects the per-cell ratios; a cell that
fails is reported, not fatal.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from xronos.bench.harness import CellSpec
from xronos.bench.netem import PAPER_RATE_MBIT

TP = ("xronos", "uniform", "pp")  # every cell: CellSpec's default network, the paper's 1 Gbit/s
STANDARD: list[CellSpec] = [
    CellSpec("set-a", "gpt2-medium", TP, iters=8, blocks=1, seq_len=32),
    CellSpec("set-b", "gpt2-medium", TP, iters=8, blocks=1, seq_len=32),
    CellSpec("set-c", "gpt2-medium", TP, iters=8, blocks=1, seq_len=32),
    CellSpec("set-a", "roberta-base", TP, iters=8, blocks=2, seq_len=64),
    # The homogeneous control: transformers' own TP runs here (16 heads, 5632 divide 4).
    # No memory caps here: this cell compares speed, and transformers' loader peaks above 1 GiB.
    CellSpec("homo", "mobilellama-1.4b", ("xronos", "uniform", "hf-tp"), iters=8, blocks=1, seq_len=32,
             mem_scale=None),
]
QUICK: list[CellSpec] = [STANDARD[0], STANDARD[-1]]
TTA = dict(scenario="set-a", strategies=("xronos", "uniform", "pp"), steps=40, bandwidth_mbit=PAPER_RATE_MBIT)


def summary_markdown(docs: list[dict], tta: dict | None, seconds: float) -> str:
    from xronos.bench.results import network

    nets = sorted({network(d) for d in docs})
    lines = ["# Benchmark grid", "",
             f"{len(docs)} cells in {seconds / 60:.1f} min. Machine: {docs[0]['environment']['cpu_model']}, "
             f"{docs[0]['environment']['cores']} cores (shared with other work: see each cell's load average). "
             f"Network: {'; '.join(nets)}.", "",
             "| cell | xronos s | uniform s | pp s | hf-tp s | xronos/uniform | xronos/pp | xronos/ideal (measured fit) | "
             "xronos/ideal (profile) | "
             "uniform/hf-tp | max idle xronos | max idle uniform | MAPE xronos |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def it(d, s):
        v = d["summary"].get(s)
        if v:
            return f"{v['iteration_s']:.3f}"
        e = d["strategies"].get(s)
        return "–" if e is None else ("n/a" if "not_run" in e else "failed")

    def ratio(d, k):
        v = d["ratios"].get(k)
        return "–" if v is None else f"{v:.3f}"

    def idle(d, s):
        v = d["summary"].get(s)
        return "–" if not v else f"{100 * v['max_idle_ratio']:.1f}%"

    for d in docs:
        x = d["summary"].get("xronos", {})
        lines.append(f"| {d['spec']['cell_name']} | {it(d, 'xronos')} | {it(d, 'uniform')} | {it(d, 'pp')} | "
                     f"{it(d, 'hf-tp')} | {ratio(d, 'xronos/uniform')} | {ratio(d, 'xronos/pp')} | "
                     f"{ratio(d, 'xronos/ideal (measured fit)')} | {ratio(d, 'xronos/ideal (profile)')} | {ratio(d, 'uniform/hf-tp')} | {idle(d, 'xronos')} | "
                     f"{idle(d, 'uniform')} | {x.get('mape_pct', float('nan')):.1f}% |")
    if tta:
        lines += ["", "Time to accuracy (MiniLM, target "
                  f"{tta['tta']['target']:.0%}): " + ", ".join(
                      f"{k} {'not reached' if v is None else f'{v:.1f} s'}"
                      for k, v in tta["tta"]["time_to_target_s"].items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from xronos.bench import results
    from xronos.bench.harness import run_cell, validate
    from xronos.bench.tta import run_tta

    ap = argparse.ArgumentParser(prog="python -m xronos.bench.grid", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="Set-A and the homogeneous control only, no TTA")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--rerender", action="store_true",
                    help="run nothing: re-summarize the cells' JSON already in --out, rewrite tables and plots")
    args = ap.parse_args(argv)
    cells = QUICK if args.quick else STANDARD
    if args.rerender:
        return rerender(cells, args.out, with_tta=True)
    for spec in cells:
        validate(spec)  # refuse the whole grid before spending time on any cell
    t0 = time.time()
    docs: list[dict] = []
    for spec in cells:
        print(f"== {spec.cell_name}", flush=True)
        doc = results.summarize(run_cell(spec))
        results.write(doc, args.out)
        print(results.markdown(doc), flush=True)
        docs.append(doc)
    tta = None
    if not args.quick:
        tta = run_tta(TTA["scenario"], TTA["strategies"], steps=TTA["steps"], bandwidth_mbit=TTA["bandwidth_mbit"])
        results.write(tta, args.out)
    write_summary(docs, tta, args.out, time.time() - t0)
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
