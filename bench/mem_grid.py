"""Peak memory of every bench grid cell, predicted afresh by today's cost model from the cell's own
profiles, against the peaks its ranks measured.

    python -m xronos.bench.mem_grid                        # every cell JSON in bench/results
    python -m xronos.bench.mem_grid bench/results/set-a_roberta-base_s64_b6.json --terms

A grid cell's JSON (`xronos bench`) keeps each device's profile report and, per TP strategy, each
rank's layout and its whole-run resident high-water mark (`raw.memory[r].peak_rss_bytes`). The
prediction is what the bench's planner computes for that rank (`bench/strategies.tp_plan`: rank 0
the owner, no export: the timed runs export nothing), recomputed with the cost model of this
checkout, so a change to the model can be checked against every measured cell without re-running
it. `--terms` adds the prediction's terms per rank (MiB): the process R, the model's tensors M
(Eq. 9 less the smaller of the activations and the gradients),
the temporary T, loading's buffer L, the heap's holes H and the owner's data stack O.

`--remeasured DIR` takes the fields whose measurement changed with profiler version 8 (each
layer's `temp_bytes` and the heap's holes: `heap_slack_*`) from a fresh profile of the
same shape, task, batch and sequence length in DIR (`<model>_s<seq>.json`, `xronos profile`
output), every other field from the cell's own profile: memory does not depend on the CPU's
speed, so the cell's measured peaks stay comparable. Version 9 measures the same fields (the heap
probes' depths drawn three times, medians): `bench/results/mem-profiles-v9`, from the cells'
1-block checkpoints (`bench.workloads.write_checkpoint`: dropout 0, which `--arch` shapes do not
have and which shifts the holes), `mem-peak-v9.md`.

`--rerun OUT.json` measures the peaks afresh instead: every distinct layout of every cell's TP
strategies trained by real `xronos run` ranks of this checkout (`bench/mem_peak.measure`: the
cell's shape, depth, batch and sequence length, 6 steps, no clipping, as the grid's ranks), each
rank's highest resident set outside the export (the grid's timed runs export nothing) kept in
OUT.json; `--measured OUT.json` then compares the predictions with those peaks, not the cell's
recorded ones — for a change of what a rank holds (mem-peak-v10.md: the loader's file maps), which
the cells' recorded peaks predate. A few minutes per cell.
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


def tp_layouts(doc: dict) -> dict[str, str]:
    """Each TP strategy of a cell with measured peaks -> its layout as `xronos run --layout` text."""
    from xronos.protocol.layout import KINDS

    out = {}
    for strategy, res in doc["strategies"].items():
        raw = res.get("raw") if isinstance(res, dict) else None
        if isinstance(raw, dict) and "memory" in raw and "ranks" in raw and strategy not in LORA_STRATEGIES:
            out[strategy] = ";".join(f"{k}=" + ",".join(str(r[k]) for r in raw["ranks"]) for k in KINDS)
    return out


def rerun(paths: list[Path], out: Path) -> dict:
    """Measure every distinct TP layout of each cell on real ranks (see the module docstring)."""
    import tempfile

    from xronos.bench.mem_peak import measure
    from xronos.bench.workloads import get_shape, shape_config, write_checkpoint, write_dataset

    steps = 6
    found = json.loads(out.read_text()) if out.is_file() else {}
    for path in paths:
        doc = json.loads(path.read_text())
        spec, cell = doc["spec"], path.stem
        batch, seq = spec["batch_size"], spec["seq_len"]
        layouts = tp_layouts(doc)
        if not layouts or cell in found:
            continue
        with tempfile.TemporaryDirectory(prefix="xronos-memgrid-") as tmp:
            work = Path(tmp)
            model_dir = write_checkpoint(work / "model", shape_config(spec["model"], spec.get("blocks")))
            data = write_dataset(work / "data.jsonl", batch * (steps + 2), seq, get_shape(spec["model"])["vocab_size"])
            done: dict[str, list[int]] = {}
            peaks = {}
            for strategy, text in layouts.items():
                if text not in done:
                    run = work / f"run{len(done)}"
                    run.mkdir()
                    res = measure(model_dir, data, "classify", text, len(doc["strategies"][strategy]["raw"]["ranks"]),
                                  batch=batch, seq=seq, steps=steps, work=run, clip=False,
                                  profile_json=RESULTS / "mem-profiles-v9" / f"{spec['model']}_s{seq}.json")
                    done[text] = [row["train_peak"] for row in res["rows"]]
                    print(f"{cell} {strategy}: {[round(p / MiB) for p in done[text]]} MiB "
                          f"(load {res['loadavg'][0]:.1f})", file=sys.stderr, flush=True)
                peaks[strategy] = done[text]
        found[cell] = peaks
        out.write_text(json.dumps(found, indent=1))  # a cell at a time: a long run keeps what it measured
    return found


def cell_rows(doc: dict, fresh: dict | None = None, peaks: dict | None = None) -> list[dict]:
    """One row per (TP strategy, rank) of a cell with measured peaks: predicted, measured, terms."""
    from xronos.gateway.plan.costmodel import KINDS, node_cost
    from xronos.gateway.plan.memorymodel import heap_slack, not_coexisting, predict_memory
    from xronos.gateway.plan.profiles import node_profile
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
            measured = (raw["memory"][r] or {}).get("peak_rss_bytes") if peaks is None else peaks[strategy][r]
            if not measured:
                continue
            raw_report = doc["profiles"][names[r]][key]
            report = ProfileReport.model_validate(raw_report if fresh is None else remeasured(raw_report, fresh))
            node = replace(node_cost(node_profile(report)), owner=r == 0, exports=False)
            shares = {k: counts[k][r] / sizes[k] for k in KINDS}
            pred = predict_memory(node, shares)
            temp = max([node.temp_repl] + [node.kind(k).temp_slope * shares[k] for k in KINDS])
            load = max([node.load_repl] + [node.kind(k).load_slope * shares[k] for k in KINDS])
            model = (node.mem_repl + sum(node.kind(k).mem_slope * shares[k] for k in KINDS)
                     - not_coexisting(node, shares))
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
    ap.add_argument("--rerun", metavar="OUT.json", help="measure every cell's TP layouts afresh on real ranks "
                    "into OUT.json (cells already in it are kept), then compare with those peaks")
    ap.add_argument("--measured", metavar="OUT.json", help="compare with the peaks a --rerun measured")
    args = ap.parse_args(argv)
    errs = []
    measured = None
    if args.rerun:
        measured = rerun(cell_files(args.cells), Path(args.rerun))
    elif args.measured:
        measured = json.loads(Path(args.measured).read_text())
    for path in cell_files(args.cells):
        if measured is not None and path.stem not in measured:
            print(f"## {path.stem}: skipped (not re-measured)")
            continue
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
        rows = cell_rows(doc, fresh, None if measured is None else measured[path.stem])
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
