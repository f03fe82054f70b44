"""Peak memory of every bench grid cell, predicted afresh by today's cost model from the cell's own
profiles, against the peaks its ranks measured.

    python -m xronos.bench.mem_grid                        # every cell JSON in bench/results
    python -m xronos.bench.mem_grid bench/results/set-a_roberta-base_s64_b6.json --terms

A grid cell's JSON (`xronos bench`) keeps each device's profile report and, per TP strategy, each
rank's layout and its whole-run resident high-water mark (`raw.memory[r].peak_rss_bytes`). The
prediction is what the bench's planner computes for that rank (`bench/strategies.tp_plan`: rank 0
the owner, no export: the timed runs export nothing), recomputed with the cost model of this
checkout, so a change to the model can be checked against every measured cell without re-running
it. `--terms` adds the prediction's terms per rank (MiB): the process R, the model's tensors M,
the temporary T, loading's buffer L, the heap's holes H and the owner's data stack O.

`--remeasured DIR` takes the fields whose measurement changed with profiler version 8 (each
layer's `temp_bytes` and the heap's holes: `heap_slack_*`) from a fresh profile of the
same shape, task, batch and sequence length in DIR (`<model>_s<seq>.json`, `xronos profile`
output), every other field from the cell's own profile: memory does not depend on the CPU's
speed, so the cell's measured peaks stay comparable. Version 9 measures the same fields (the heap
probes' depths drawn three times, medians): `bench/results/mem-profiles-v9`, from the cells'
1-block checkpoints (`bench.workloads.write_checkpoint`: dropout 0, which `--arch` shapes do not
have and which shifts the holes), `mem-peak-v9.md`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

MiB = 1 << 20
RESULTS = Path(__file__).resolve().parent / "results"
LORA_STRATEGIES = ("xronos-lora",)


def remeasured(report: dict, fresh: dict) -> dict:
    """`report` with the fields profiler version 8 measures differently taken from `fresh`."""
    for k in ("batch_size", "seq_len", "task", "sizes"):
        if report[k] != fresh[k]:
            raise ValueError(f"the fresh profile differs in {k}: {fresh[k]!r}, the cell's {report[k]!r}")
    # the same shape at any depth: the profile measures one block (and two, in its heap probe)
    mine, theirs = ({k: v for k, v in r["arch"].items() if k != "num_layers"} for r in (report, fresh))
    if mine != theirs:
        raise ValueError(f"the fresh profile's architecture differs: {theirs}, the cell's {mine}")
    temps = {lay["name"]: lay["temp_bytes"] for lay in fresh["layers"]}
    layers = [lay | {"temp_bytes": temps[lay["name"]]} for lay in report["layers"]]
    return report | {"layers": layers, **{k: fresh.get(k) for k in (
        "heap_slack_bytes", "heap_slack_block_bytes", "heap_slack_small_bytes", "heap_slack_small_counts")}}


def cell_rows(doc: dict, fresh: dict | None = None) -> list[dict]:
    """One row per (TP strategy, rank) of a cell with measured peaks: predicted, measured, terms."""
    from xronos.gateway.costmodel import KINDS, heap_slack, node_cost, predict_memory
    from xronos.gateway.profiles import node_profile
    from xronos.protocol.messages import ProfileReport

    names = [d["name"] for d in doc["scenario"]["devices"]]
    rows = []
    for strategy, res in doc["strategies"].items():
        raw = res.get("raw") if isinstance(res, dict) else None
        if not isinstance(raw, dict) or "memory" not in raw or "ranks" not in raw:
            continue
        key = "tp-lora" if strategy in LORA_STRATEGIES else "tp"
        n = len(raw["ranks"])
        counts = {k: [raw["ranks"][r][k] for r in range(n)] for k in KINDS}
        sizes = {k: sum(v) for k, v in counts.items()}
        for r in range(n):
            measured = (raw["memory"][r] or {}).get("peak_rss_bytes")
            if not measured:
                continue
            raw_report = doc["profiles"][names[r]][key]
            report = ProfileReport.model_validate(raw_report if fresh is None else remeasured(raw_report, fresh))
            node = replace(node_cost(node_profile(report)), owner=r == 0, exports=False)
            shares = {k: counts[k][r] / sizes[k] for k in KINDS}
            pred = predict_memory(node, shares)
            temp = max([node.temp_repl] + [node.kind(k).temp_slope * shares[k] for k in KINDS])
            load = max([node.load_repl] + [node.kind(k).load_slope * shares[k] for k in KINDS])
            model = node.mem_repl + sum(node.kind(k).mem_slope * shares[k] for k in KINDS)
            rows.append(dict(cell=doc["spec"].get("cell_name"), strategy=strategy, rank=r, device=names[r],
                             layout={k: counts[k][r] for k in KINDS}, predicted=pred, measured=measured,
                             error=100 * (pred - measured) / measured,
                             terms=dict(R=node.mem_runtime, M=model, T=temp, L=load, H=heap_slack(node, shares),
                                        O=node.owner_bytes if r == 0 else 0.0)))
    return rows


def cell_files(paths: list[str]) -> list[Path]:
    if paths:
        return [Path(p) for p in paths]
    out = []
    for p in sorted(RESULTS.glob("*.json")):
        try:
            doc = json.loads(p.read_text())
        except ValueError:
            continue
        if isinstance(doc, dict) and "strategies" in doc and "profiles" in doc:
            out.append(p)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xronos.bench.mem_grid", description=__doc__.split("\n\n")[0])
    ap.add_argument("cells", nargs="*", help="cell JSON files (default: every cell in bench/results)")
    ap.add_argument("--terms", action="store_true", help="print the prediction's terms per rank")
    ap.add_argument("--remeasured", help="a directory of fresh profiles (<model>_s<seq>.json) for the "
                    "fields profiler version 8 measures differently; cells without one are skipped")
    args = ap.parse_args(argv)
    errs = []
    for path in cell_files(args.cells):
        doc = json.loads(path.read_text())
        fresh = None
        if args.remeasured:
            spec = doc["spec"]
            lora = "_lora" if any(s in LORA_STRATEGIES for s in doc["strategies"]) else ""
            fp = Path(args.remeasured) / f"{spec['model']}_s{spec['seq_len']}{lora}.json"
            if not fp.is_file():
                print(f"## {path.stem}: skipped (no {fp.name})")
                continue
            fresh = json.loads(fp.read_text())
        rows = cell_rows(doc, fresh)
        if not rows:
            continue
        e = [row["error"] for row in rows]
        errs += e
        print(f"## {path.stem}: {min(e):+.1f} … {max(e):+.1f} %")
        for row in rows:
            lay = "/".join(str(row["layout"][k]) for k in ("attn", "mlp", "vocab"))
            line = (f"{row['strategy']:>12} r{row['rank']} {lay:>16}  pred {row['predicted'] / MiB:6.0f}  "
                    f"meas {row['measured'] / MiB:6.0f}  {row['error']:+6.1f} %")
            if args.terms:
                line += "  " + " ".join(f"{k} {v / MiB:.0f}" for k, v in row["terms"].items())
            print(line)
    if errs:
        print(f"all: {len(errs)} (cell, strategy, rank) points, {min(errs):+.1f} … {max(errs):+.1f} %, "
              f"mean |error| {sum(abs(x) for x in errs) / len(errs):.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
