"""The steady cell (issue 14): with boxes that do not change, live re-balancing changes nothing.

    python -m xronos.bench.steady_rebalance [--blocks 2] [--steps 200] [--shares 0.6,0.4,0.4]
        [--calibrate 10] [--out bench/results/steady_rebalance]

Three emulated boxes of different speeds (cgroup CPU quotas `--shares`, one thread per rank)
fine-tune a GPT-2-Medium-shaped classifier (`--blocks` of its 24 blocks, the full vocabulary).
The start layout is the one their measured speeds call for: a short static calibration run
(`--calibrate` iterations at the layout proportional to the shares) feeds the policy's own
estimate (`xronos.gateway.plan.rebalance`, unit cost model), a second one at the segment planner's
layout over it gives the estimate a second share per kind (its intercepts), and the planner's
layout over both is the start (`calibrated_layout`) — what a profile would have planned. Then the same cell runs
`--steps` iterations twice, side by side: static (no control) and live (`--rebalance`'s policy on
rank 0). Reported: the live run's re-plans (must be none) and the policy's last reason; the
median iteration time (the slowest rank's, first 3 iterations left out) off and on and their
ratio; the policy's own time per boundary on rank 0 (`policy_s_mean`: observe and decide,
measured around those calls) and the whole boundary's (`boundary_s_mean`: the gather too, which
includes rank 0 waiting there for the slowest rank, a wait the static run spends in its first
collective instead), each over the live run's median iteration time. The end-to-end cost of
re-balancing when nothing moves is the on / off ratio; the policy's own share is the lower bound
of what it can be.
Timings on a shared machine are provisional: the load (`os.getloadavg`) is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from xronos.bench.background_load import run_one
from xronos.bench.workloads import kind_parameters, shape_config, write_checkpoint, write_dataset
from xronos.gateway.plan.planner import plan
from xronos.gateway.plan.rebalance import NO_CAP, PolicyConfig, Rebalancer
from xronos.gateway.plan.refit import unit_costs
from xronos.node.emulate.cpumode import default_cpu_mode
from xronos.protocol.layout import KINDS, QUANTA, Layout, Sizes

WARMUP = 3  # iterations left out of the medians (allocator and caches settle)


def proportional_layout(sizes: Sizes, shares: list[float]) -> Layout:
    """Every kind split in proportion to the shares, on its quantum (largest remainders)."""
    def split(total: int) -> list[int]:
        raw = [total * s / sum(shares) for s in shares]
        out = [int(x) for x in raw]
        for d in sorted(range(len(raw)), key=lambda d: raw[d] - out[d], reverse=True)[:total - sum(out)]:
            out[d] += 1
        return out

    return Layout.from_quanta(split(sizes.attn), split(sizes.quanta("mlp")), split(sizes.quanta("vocab")), sizes,
                              QUANTA)


def per_kind(doc: dict) -> list[list[dict[str, float]]]:
    """Per iteration, every rank's {kind: compute_{kind}_s} and its rest (compute_rest_s)."""
    ranks = doc["ranks"]
    return [[{k: r["iterations"][i][f"compute_{k}_s"] for k in (*KINDS, "rest")} for r in ranks]
            for i in range(len(ranks[0]["iterations"]))]


def calibrated_layout(stages: list[tuple[Layout, list[list[dict[str, float]]]]], sizes: Sizes,
                      unit_params: dict[str, float] | None = None) -> Layout:
    """The segment planner's layout over the policy's speed estimate from static runs' per-kind
    compute: `stages` of (layout, rows measured under it), in order (the policy moves to each
    stage's layout, so a second stage gives it two shares per kind: its intercepts). With
    `unit_params` (parameters per unit of each kind) a row's rest is booked to the kinds as the
    live policy books it (`xronos.cli.liverank`: bytes per unit, in proportion)."""
    start = stages[0][0]
    n = start.world_size
    policy = Rebalancer(sizes, start, unit_costs([f"rank{d}" for d in range(n)]), [NO_CAP] * n,
                        unit_params or dict.fromkeys(KINDS, 0.0), config=PolicyConfig(warmup=1))
    for i, (layout, rows) in enumerate(stages):
        if i:
            policy.moved_to(layout)
        for row in rows:
            policy.observe(row)
    nodes = policy.refitted()
    if nodes is None:
        raise ValueError(f"calibration: {len(stages[-1][1])} iterations at the last stage measured nothing "
                         f"(need at least 2)")
    return plan(nodes, sizes, "segment", [NO_CAP] * n).layout


def iteration_times(doc: dict) -> list[float]:
    ranks = doc["ranks"]
    return [max(r["iterations"][i]["iteration_s"] for r in ranks) for i in range(len(ranks[0]["iterations"]))]


def compare(static: dict, live: dict) -> dict:
    """The side-by-side figures of the two runs (see the module docstring)."""
    off = statistics.median(iteration_times(static)[WARMUP:])
    on = statistics.median(iteration_times(live)[WARMUP:])
    reb = live.get("rebalance") or {}
    return {
        "replans": reb.get("replans", []), "reshards": live.get("reshards", []), "last_reason": reb.get("last_reason"),
        "median_off_s": off, "median_on_s": on, "on_over_off": on / off,
        "policy_s_mean": reb.get("policy_s_mean"), "boundary_s_mean": reb.get("boundary_s_mean"),
        "policy_over_iteration": reb["policy_s_mean"] / on if "policy_s_mean" in reb else None,
        "boundary_over_iteration": reb["boundary_s_mean"] / on if "boundary_s_mean" in reb else None,
        "decisions": reb.get("decisions"), "setup_s": reb.get("setup_s"),
    }


def report(r: dict, meta: dict) -> str:
    pct = lambda x: "-" if x is None else f"{100 * x:.3f} %"  # noqa: E731
    ms = lambda x: "-" if x is None else f"{1000 * x:.2f} ms"  # noqa: E731
    return (f"# Steady cell: live re-balancing on vs off, {meta['steps']} iterations\n\n"
            f"GPT-2-Medium shapes ({meta['blocks']} blocks, classify), ranks at {meta['shares']} cores, batch "
            f"{meta['batch_size']} x {meta['seq_len']}; start layout {meta['start_layout']} (calibrated from "
            f"{meta['calibrate']} static iterations at {meta['proportional_layout']}, then as many at the layout "
            f"that called for); load average "
            f"{meta['loadavg_before'][0]:.1f} before, {meta['loadavg_after'][0]:.1f} after "
            f"(provisional when not 0). Clock: **{meta.get('clock', 'wall (quota)')}** (`XRONOS_EMULATOR_CPU`).\n\n"
            "| re-plans | median iteration off s | on s | on / off | policy per boundary | whole boundary (gather too) "
            "| boundaries decided |\n|---|---|---|---|---|---|---|\n"
            f"| {len(r['replans'])} | {r['median_off_s']:.4f} | {r['median_on_s']:.4f} | {r['on_over_off']:.4f} "
            f"| {ms(r['policy_s_mean'])} ({pct(r['policy_over_iteration'])}) "
            f"| {ms(r['boundary_s_mean'])} ({pct(r['boundary_over_iteration'])}) | {r['decisions']} |\n\n"
            f"The policy's last word: {r['last_reason']}\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xronos.bench.steady_rebalance", description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--shares", default="0.6,0.4,0.4")
    p.add_argument("--calibrate", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--out", default="bench/results/steady_rebalance")
    args = p.parse_args(argv)
    try:
        shares = [float(x) for x in args.shares.split(",")]
    except ValueError:
        raise SystemExit(f"--shares: comma-separated cores per rank, got {args.shares!r}") from None
    if len(shares) < 2 or not all(s > 0 for s in shares):
        raise SystemExit(f"--shares: at least two positive shares, got {args.shares!r}")
    if args.steps <= WARMUP + 1 or args.calibrate < 3:
        raise SystemExit(f"--steps must be > {WARMUP + 1} and --calibrate >= 3")
    config = shape_config("gpt2-medium", args.blocks)
    run_args = SimpleNamespace(batch_size=args.batch_size, seq_len=args.seq_len, share=None, change_at=None)
    with tempfile.TemporaryDirectory(prefix="xronos-steady-") as tmp:
        work = Path(tmp)
        model = write_checkpoint(work / "model", config)
        data = write_dataset(work / "data.jsonl", args.batch_size * args.steps + 8, args.seq_len, config["vocab_size"])
        from xronos.node.rank.validate import model_sizes

        sizes = model_sizes(str(model))
        load = {"loadavg_before": os.getloadavg()}
        prop = proportional_layout(sizes, shares)
        params = kind_parameters(config)
        unit_params = {k: params[k] / sizes.total(k) for k in KINDS}
        # Two calibration stages: at the proportional layout, then at the layout it calls for (two
        # shares per kind: the estimate's intercepts), so the start is what the measured speeds
        # call for, not a first guess the live policy would still correct.
        stages, layout = [], prop
        for i in range(2):
            cal = run_one(model, data, layout, run_args, live=False, variant="steady", work=work, shares=shares,
                          steps=args.calibrate, tag=f"-calibration{i}")
            stages.append((layout, per_kind(cal)))
            layout = calibrated_layout(stages, sizes, unit_params)
            print(f"calibration {i}: {layout.to_text()}", file=sys.stderr, flush=True)
            if layout == stages[-1][0]:
                break
        start = layout
        docs = {}
        for live in (False, True):  # side by side: the same cell, off then on
            docs[live] = run_one(model, data, start, run_args, live=live, variant="steady", work=work, shares=shares,
                                 steps=args.steps)
            print(f"steady {'live' if live else 'static'}: done", file=sys.stderr, flush=True)
        load["loadavg_after"] = os.getloadavg()
    result = compare(docs[False], docs[True])
    meta = {"model": "gpt2-medium", "blocks": args.blocks, "shares": shares, "steps": args.steps,
            "calibrate": args.calibrate, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "proportional_layout": prop.to_text(), "start_layout": start.to_text(),
            "clock": "virtual" if default_cpu_mode() == "virtual" else f"wall ({default_cpu_mode()})", **load}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "result": result, "iteration_s": {"static": iteration_times(docs[False]),
                                                          "live": iteration_times(docs[True])}}, indent=1))
    text = report(result, meta)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
