"""The LoRA cell (issue 17): LoRA and full fine-tuning of a Qwen2.5-1.5B shape, beside full
fine-tuning of a shape that fits.

    .venv/bin/python -m xronos.bench.lora_cell [--iters 10 --warmup 2] [--out bench/results]

Two cells on emulated Set-A (bench/scenarios.py: a MiniPC and two Raspberry Pi 5), each at the
grid's depth (`workloads.realistic_blocks`) and with the grid's memory caps (mem_scale "kept"), the
paper's 1 Gbit/s links:

- `qwen2.5-1.5b` (random weights, 7 of 28 blocks): full fine-tuning (`xronos`, 16 B per parameter)
  and LoRA (`xronos-lora`, r = 8 on peft's default targets q_proj/v_proj: the frozen base at 4 B
  per parameter, the adapters and the classification head at 16 B), beside the same LoRA job under
  the even split (`uniform-lora`) and the pipeline (`pp-lora`). Each is checked against the caps
  on its own (`harness.memory_shortfall`, then its planner over the devices' profiles: full
  fine-tuning's profile for `xronos`, the LoRA job's for the others); one that cannot fit is
  reported infeasible, with the numbers, and never run.
- `smollm2-360m` (8 of 32 blocks): full fine-tuning of a shape that fits the same devices.

Whether full fine-tuning of the Qwen shape fits is what the caps and the planner say; the cell
hard-codes no refusal. At sequence length 256 (the cells' `SEQ_LEN`) the planner finds no plan for
it ("No plan fits the memory caps": a Pi 5 alone holds at most 3104 of 8960 MLP columns), while
LoRA is planned at 2.42 / 1.33 / 1.09 GiB against 5.65 / 2.75 / 2.75. At the grid's 32 it is
planned at a Pi 5's cap instead (3.72 / 2.72 / 2.42 GiB), and in smoke runs that rank was
OOM-killed once and ran once.

`lora.md` in --out puts the cells' iteration times and per-node peak memory side by side; each
cell's own JSON/Markdown is written as every cell's is (`results.write`). `--plan-only` profiles
and plans (which strategies fit, the planned memory per node) without training.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from xronos.bench.grid import ITERS, WARMUP
from xronos.bench.harness import CellSpec
from xronos.bench.workloads import realistic_blocks

LORA_MODEL, FIT_MODEL = "qwen2.5-1.5b", "smollm2-360m"


# Sequence length 256 (batch 8), a fine-tuning length people use: at the grid's 32 the Qwen shape's
# full fine-tuning is planned at a Pi 5's cap (it fits, just), at 256 its activations make the
# planner refuse it. The caps scale with the parameters kept (0.363) while activations scale with
# the blocks kept (7/28), so the scaled cell is if anything kinder to full fine-tuning than the
# whole model on the real devices.
SEQ_LEN = 256


def _cell(model: str, strategies: tuple[str, ...], **kw) -> CellSpec:
    return CellSpec("set-a", model, strategies, iters=kw.pop("iters", ITERS), warmup=kw.pop("warmup", WARMUP),
                    blocks=realistic_blocks(model), seq_len=SEQ_LEN, mem_scale="kept", **kw)


CELLS: list[CellSpec] = [
    _cell(LORA_MODEL, ("xronos", "xronos-lora", "uniform-lora", "pp-lora"), lora_r=8),
    _cell(FIT_MODEL, ("xronos",)),
]


def rows(doc: dict) -> list[dict]:
    """One row per strategy of a summarized cell: what it trains, its result, per-node peak memory."""
    from xronos.bench.harness import CellSpec as _Spec, model_state_bytes
    from xronos.bench import strategies as st

    spec = _Spec(**{k: v for k, v in doc["spec"].items() if k in {f.name for f in dataclasses.fields(_Spec)}}
                 | {"strategies": tuple(doc["spec"]["strategies"]),
                    "lora_targets": tuple(doc["spec"].get("lora_targets") or ())})
    out = []
    for name, entry in doc["strategies"].items():
        state, what = model_state_bytes(spec, doc["model"]["config"], name)
        s = doc["summary"].get(name)
        plan = entry.get("plan") or {}
        row = {"cell": doc["spec"]["cell_name"], "model": doc["model"]["name"],
               "blocks": f"{doc['model']['blocks']}/{doc['model']['paper_blocks']}",
               "training": f"LoRA r={spec.lora_r}" if name in st.LORA_STRATEGIES else "full fine-tuning",
               "strategy": name, "state_gib": state / 2**30, "state_what": what,
               "caps_gib": [c / 2**30 for c in doc["scenario"]["memory_caps"]],
               "planned_gib": [r["predicted_memory"] / 2**30 for r in plan.get("rows", [])]}
        if s is not None:
            row |= {"iteration_s": s["iteration_s"], "iteration_s_stdev": s["iteration_s_stdev"],
                    "peak_rss_mib": [n["peak_rss"] / 2**20 for n in s["nodes"]]}
        else:
            reason = next((entry[k] for k in ("infeasible", "not_run", "failed") if k in entry), "?")
            row["result"] = ("INFEASIBLE: " if "infeasible" in entry else "FAILED: " if "failed" in entry else
                             "not run: ") + reason.splitlines()[0][:300]
            if "failed" in entry and "signal 9" in reason:  # the cgroup's OOM killer: over its cap
                row["result"] += " (signal 9 under a memory cap: the OOM killer)"
        out.append(row)
    return out


def markdown(docs: list[dict], seconds: float) -> str:
    from xronos.bench.cellreport import cpu_emulation

    env = docs[0]["environment"]
    loads = ", ".join(f"{d['spec']['cell_name']} {d['environment']['loadavg_start'][0]:.2f} → "
                      f"{d['environment']['loadavg_end'][0]:.2f}" for d in docs)
    lines = ["# LoRA cell (issue 17)", "",
             f"Emulated Set-A (ASUS MiniPC, two Raspberry Pi 5), memory caps scaled with the parameters kept "
             f"(each cell's own scale), 1 Gbit/s links; random weights, fp32, batch {docs[0]['spec']['batch_size']}, "
             f"sequence length {docs[0]['spec']['seq_len']}, classification; {docs[0]['spec']['iters']} iterations, "
             f"first {docs[0]['spec']['warmup']} excluded. Machine: {env['cpu_model']}, {env['cores']} cores, "
             f"load average {loads} (shared machine). {seconds / 60:.1f} min in all. Clock: "
             f"{cpu_emulation(env)}.", "",
             "| model (blocks) | training | training state (necessary) | caps GiB per node | planned GiB per node "
             "| iteration s ± sd | peak RSS MiB per node |",
             "|---|---|---|---|---|---|---|"]
    for d in docs:
        for r in rows(d):
            caps = " / ".join(f"{c:.2f}" for c in r["caps_gib"])
            planned = " / ".join(f"{c:.2f}" for c in r["planned_gib"]) or "–"
            if "iteration_s" in r:
                it = f"{r['iteration_s']:.3f} ± {r['iteration_s_stdev']:.3f}"
                rss = " / ".join(f"{m:.0f}" for m in r["peak_rss_mib"])
            else:
                it, rss = r["result"], "–"
            lines.append(f"| {r['model']} ({r['blocks']}) | {r['training']} (`{r['strategy']}`) | "
                         f"{r['state_gib']:.2f} GiB: {r['state_what']} | {caps} | {planned} | {it} | {rss} |")
    for d in docs:
        if d.get("ratios"):
            lines += ["", f"{d['spec']['cell_name']}: " + ", ".join(f"**{k}** {v:.3f}" for k, v in d["ratios"].items())]
    return "\n".join(lines) + "\n"


def plan_only(spec: CellSpec) -> dict:
    """Profile the devices and plan each strategy, train nothing: {strategy: feasible / infeasible + why}."""
    import tempfile

    from xronos.bench import strategies as st
    from xronos.bench.harness import cell_caps, memory_shortfall, validate
    from xronos.bench.workloads import get_shape, write_checkpoint, write_dataset

    sc, config = validate(spec)
    caps = cell_caps(spec, sc)
    out: dict[str, dict] = {}
    runnable = []
    for s in spec.strategies:
        why = memory_shortfall(spec, sc, config, caps, s)
        if why:
            out[s] = {"infeasible": why}
        else:
            runnable.append(s)
    if runnable:
        with tempfile.TemporaryDirectory(prefix="xronos-lora-plan-") as tmp:
            work = Path(tmp)
            model_dir = write_checkpoint(work / "model", config, seed=spec.seed)
            data = write_dataset(work / "data.jsonl", spec.batch_size, spec.seq_len, get_shape(spec.model)["vocab_size"])
            ctx = st.Ctx(work, model_dir, data, config, sc.shares(spec.unit_share), caps,
                         [d.name for d in sc.devices], spec.batch_size, spec.seq_len, spec.micro_batches,
                         spec.iters, spec.lr, spec.seed, bandwidth_mbit=spec.bandwidth_mbit,
                         lora_r=spec.lora_r, lora_alpha=spec.lora_alpha, lora_targets=spec.lora_targets or None)
            tp = [s for s in runnable if s in st.TP_STRATEGIES]
            profiles = st.profile_devices(ctx, any(s not in st.LORA_STRATEGIES for s in tp), "pp" in runnable,
                                          want_lora=any(s in st.LORA_STRATEGIES for s in tp),
                                          want_pp_lora="pp-lora" in runnable)
            for s in runnable:
                if s in st.PP_STRATEGIES:
                    from xronos.bench.pp_plan import InfeasiblePipeline

                    try:
                        pipe = st.pp_plan(ctx, profiles, s)
                    except InfeasiblePipeline as exc:
                        out[s] = {"infeasible": str(exc)[-1000:]}
                        continue
                    out[s] = {"feasible": [(x.device, x.start, x.stop) for x in pipe.stages],
                              "planned_gib": [round(x.memory / 2**30, 3) for x in pipe.stages],
                              "predicted_iteration_s": pipe.predicted_iteration_s}
                    continue
                try:
                    plan = st.tp_plan(ctx, profiles, s)
                except st.Infeasible as exc:
                    out[s] = {"infeasible": str(exc)[-1000:]}
                    continue
                why = st.over_cap(plan)
                out[s] = {"infeasible": why} if why else {
                    "feasible": plan.layout.to_text(),
                    "planned_gib": [round(r.predicted_memory / 2**30, 3) for r in plan.rows],
                    "caps_gib": [round(r.memory_cap / 2**30, 3) for r in plan.rows],
                    "predicted_iteration_s": plan.predicted_iteration_s}
    return out


def main(argv: list[str] | None = None) -> int:
    from xronos.bench import cellreport, results
    from xronos.bench.harness import run_cell, validate

    ap = argparse.ArgumentParser(prog="python -m xronos.bench.lora_cell", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--iters", type=int, default=ITERS, help=f"iterations per strategy (default {ITERS})")
    ap.add_argument("--warmup", type=int, default=WARMUP, help=f"excluded from the means (default {WARMUP})")
    ap.add_argument("--batch-size", type=int, default=None, help="override the cells' batch (a smoke run)")
    ap.add_argument("--seq-len", type=int, default=None, help="override the cells' sequence length (32)")
    ap.add_argument("--plan-only", action="store_true", help="profile and plan, train nothing; print the plans")
    args = ap.parse_args(argv)
    over = {"iters": args.iters, "warmup": args.warmup}
    if args.seq_len is not None:
        over["seq_len"] = args.seq_len
    if args.batch_size is not None:
        over |= {"batch_size": args.batch_size, "micro_batches": 1}
    cells = [dataclasses.replace(c, **over) for c in CELLS]
    for spec in cells:
        validate(spec)  # refuse everything before spending time on any cell
    if args.plan_only:
        import json

        for spec in cells:
            print(f"== {spec.cell_name}", flush=True)
            print(json.dumps(plan_only(spec), indent=1), flush=True)
        return 0
    t0 = time.time()
    docs = []
    for spec in cells:
        print(f"== {spec.cell_name}", flush=True)
        doc = results.summarize(run_cell(spec))
        results.write(doc, args.out)
        print(cellreport.markdown(doc), flush=True)
        docs.append(doc)
    md = markdown(docs, time.time() - t0)
    results.atomic_write(args.out / "lora.md", md.encode())
    print(md)
    return 1 if any("failed" in e for d in docs for e in d["strategies"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
