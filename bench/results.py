"""Summaries, ratios and the Markdown table of a benchmark cell; atomic result files.

Iteration time: a step ends when its slowest rank ends, so per step we take the max over ranks of
the rank's iteration time, and report the mean over the steps after warm-up. Idle ratio per node:
- TP (ours): the trainer's idle time (own time in collectives minus the fastest rank's) / iteration;
- pp: time blocked receiving (bubbles + transfers, which PP cannot tell apart) / iteration;
- hf-tp: no per-collective timings exist, so 1 - CPU time / (CPU share x wall time), a
  utilisation estimate (also given for pp as a cross-check).
MAPE: predicted (cost model) vs measured per-node compute time, over nodes holding units.
Ideal lower bound, two ways: from the planner (profiles: fractional perfect balance) and from this
cell's measured per-node compute times (see `measured_ideal`), each plus the measured communication.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path


def _steady(iters: list[dict], warmup: int) -> list[dict]:
    return iters[warmup:] if len(iters) > warmup else iters


def summarize_strategy(name: str, entry: dict, shares: list[float], warmup: int) -> dict | None:
    raw = entry.get("raw")
    if raw is None:
        return None
    ranks = raw["ranks"]
    steady = [_steady(r["iterations"], warmup) for r in ranks]
    steps = min(len(s) for s in steady)
    per_step = [max(s[i]["iteration_s"] for s in steady) for i in range(steps)]
    nodes = []
    for r, s in zip(ranks, steady):
        it = statistics.mean(x["iteration_s"] for x in s)
        node = {"device": r["device"], "iteration_s": it,
                "ctx_switches_per_iter": statistics.mean(x["voluntary_ctx_switches"] + x["involuntary_ctx_switches"] for x in s),
                "peak_rss": max(x["peak_rss"] for x in r["iterations"])}
        if "idle_s" in s[0]:  # our trainer
            node |= {"units": r["units"], "compute_s": statistics.mean(x["compute_s"] for x in s),
                     "comm_s": statistics.mean(x["comm_s"] for x in s),
                     "data_s": statistics.mean(x["data_s"] for x in s),
                     "idle_ratio": statistics.mean(x["idle_s"] for x in s) / it}
        if "recv_wait_s" in s[0]:  # pipeline
            node |= {"span": r["span"], "idle_ratio": statistics.mean(x["recv_wait_s"] for x in s) / it}
        if "cpu_s" in s[0]:
            util = statistics.mean(x["cpu_s"] for x in s) / (shares[r["device"]] * it)
            node["cpu_idle_ratio"] = max(0.0, 1.0 - util)
            node.setdefault("idle_ratio", node["cpu_idle_ratio"])
        nodes.append(node)
    out = {"iteration_s": statistics.mean(per_step), "iteration_s_stdev": statistics.pstdev(per_step),
           "steps_measured": steps, "nodes": nodes,
           "max_idle_ratio": max(n["idle_ratio"] for n in nodes),
           "comm_s": max((n.get("comm_s", 0.0) for n in nodes), default=0.0),
           "ctx_switches_per_iter": statistics.mean(n["ctx_switches_per_iter"] for n in nodes)}
    plan = entry.get("plan") or {}
    if "rows" in plan:  # a TP plan: predicted vs measured compute per node
        pairs = [(row["predicted_compute_s"], n["compute_s"]) for row, n in zip(plan["rows"], nodes)
                 if row["units"] > 0]
        out["predicted_vs_measured"] = pairs
        out["mape_pct"] = 100 * statistics.mean(abs(p - m) / m for p, m in pairs)
        out["predicted_iteration_s"] = plan["predicted_iteration_s"]
        if plan.get("ideal_compute_s") is not None:
            # The lower bound: fractional perfect balance + the communication measured here.
            out["ideal_iteration_s"] = plan["ideal_compute_s"] + out["comm_s"] + max(n["data_s"] for n in nodes)
    return out


def summarize(doc: dict) -> dict:
    warmup = doc["spec"]["warmup"]
    shares = doc["scenario"]["shares"]
    summ = {k: summarize_strategy(k, v, shares, warmup) for k, v in doc["strategies"].items()}
    doc["summary"] = {k: v for k, v in summ.items() if v is not None}
    for x in ("xronos", "xronos-optimal"):
        if x in doc["summary"]:
            measured = measured_ideal(doc["summary"])
            if measured is not None:
                x_sum = doc["summary"][x]
                x_sum["ideal_measured_s"] = measured + x_sum["comm_s"] + max(n["data_s"] for n in x_sum["nodes"])
    doc["ratios"] = ratios(doc["summary"])
    return doc


def measured_ideal(summary: dict) -> float | None:
    """Perfect-balance compute time from *measured* per-node compute (not the profile): each
    node's compute(units) = a + b*units fitted through its points from the TP runs of this cell
    (two distinct unit counts; otherwise through the origin), then the continuous balance
    sum_d (T - a_d) / b_d = H solved for T (nodes that would get a negative share dropped)."""
    runs = [summary[k] for k in ("xronos", "xronos-optimal", "uniform") if k in summary]
    if not runs or "units" not in runs[0]["nodes"][0]:
        return None
    H = sum(n["units"] for n in runs[0]["nodes"])
    fits = []
    for d in range(len(runs[0]["nodes"])):
        pts = {n["units"]: n["compute_s"] for r in runs for n in [r["nodes"][d]] if n["units"] > 0}
        if not pts:
            return None
        if len(pts) >= 2:
            (u0, t0), (u1, t1) = min(pts.items()), max(pts.items())
            b = (t1 - t0) / (u1 - u0)
            a = t0 - b * u0
            if b <= 0 or a < 0:  # noise: fall back to proportional
                a, b = 0.0, statistics.mean(t / u for u, t in pts.items())
        else:
            (u, t), = pts.items()
            a, b = 0.0, t / u
        fits.append((a, b))
    active = list(range(len(fits)))
    while active:
        T = (H + sum(fits[d][0] / fits[d][1] for d in active)) / sum(1 / fits[d][1] for d in active)
        drop = [d for d in active if fits[d][0] > T]
        if not drop:
            return max(T, max(fits[d][0] for d in range(len(fits))))
        active = [d for d in active if d not in drop]
    return None


def ratios(s: dict) -> dict:
    def r(a: str, b: str) -> float | None:
        return s[a]["iteration_s"] / s[b]["iteration_s"] if a in s and b in s else None

    out = {}
    for x in ("xronos", "xronos-optimal"):
        if x not in s:
            continue
        out[f"{x}/uniform"] = r(x, "uniform")
        out[f"{x}/pp"] = r(x, "pp")
        out[f"{x}/hf-tp"] = r(x, "hf-tp")
        if s[x].get("ideal_measured_s"):
            out[f"{x}/ideal (measured fit)"] = s[x]["iteration_s"] / s[x]["ideal_measured_s"]
        if s[x].get("ideal_iteration_s"):
            out[f"{x}/ideal (profile)"] = s[x]["iteration_s"] / s[x]["ideal_iteration_s"]
            if "uniform" in s:  # share of the ideal gain over uniform that was captured
                u, i = s["uniform"]["iteration_s"], s[x]["ideal_iteration_s"]
                # Only where there is a gain to capture: on equal devices u - i is run-to-run noise,
                # and a ratio over it means nothing (the homogeneous control read -55 once).
                out[f"{x} gain captured"] = (u - s[x]["iteration_s"]) / (u - i) if u > 1.05 * i else None
    out["uniform/hf-tp"] = r("uniform", "hf-tp")
    return {k: v for k, v in out.items() if v is not None}


# -- Markdown -----------------------------------------------------------------------------------
def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def network(doc: dict) -> str:
    """How the cell's ranks were connected; results from before the network emulator ran on loopback."""
    from xronos.bench.netem import describe

    return doc["environment"].get("network") or describe(doc["spec"].get("bandwidth_mbit"))


def markdown(doc: dict) -> str:
    sp, sc, m, env = doc["spec"], doc["scenario"], doc["model"], doc["environment"]
    devs = ", ".join(f"{d['name']} ({d['speed']:g}x → {s:g} core"
                     + (f", {c / 2**30:.2g} GiB" if c else "") + ")"
                     for d, s, c in zip(sc["devices"], sc["shares"], sc["memory_caps"]))
    lines = [
        f"### {sp['cell_name']}", "",
        f"- Scenario **{sc['name']}**: {devs}",
        f"- Network: **{network(doc)}**",
        f"- Model: **{m['name']} shape with {m['blocks']} of {m['paper_blocks']} transformer blocks** "
        f"(full layer width, {m.get('weights', 'random weights')}, {m['parameters'] / 1e6:.1f} M parameters), fp32, batch "
        f"{sp['batch_size']}, sequence length {sp['seq_len']}, AdamW lr {sp['lr']}, classification",
        f"- {sp['iters']} iterations per strategy, first {sp['warmup']} excluded (warm-up); pp: "
        f"{sp['micro_batches']} micro-batches, 1F1B",
        f"- Machine: {env['cpu_model']}, {env['cores']} cores, torch {env['torch']}, cgroup v{env['cgroup_version']}, "
        f"load average {env['loadavg_start'][0]:.2f} → {env['loadavg_end'][0]:.2f} (shared machine)", "",
        "| strategy | iteration s | ±sd | max idle | idle per node | comm s | ctx sw/iter | peak RSS MiB per node | layout | MAPE |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in doc["strategies"].items():
        s = doc["summary"].get(name)
        if s is None:
            why = entry.get("not_run") or entry.get("failed", "?")
            lines.append(f"| {name} | {'not run' if 'not_run' in entry else 'FAILED'}: {why.splitlines()[0][:160]} |||||||||")
            continue
        idle = " / ".join(_pct(n["idle_ratio"]) for n in s["nodes"])
        rss = " / ".join(f"{n['peak_rss'] / 2**20:.0f}" for n in s["nodes"])
        if "units" in s["nodes"][0]:
            layout = "units " + "/".join(str(n["units"]) for n in s["nodes"])
        elif "span" in s["nodes"][0]:
            layout = "stages " + " ".join(f"d{n['device']}:{n['span'][0]}-{n['span'][1]}" for n in s["nodes"])
            out = entry["raw"].get("idle_devices") or []
            layout += f" (sits out: {', '.join(f'd{d}' for d in out)})" if out else ""
        else:
            layout = "even"
        mape = f"{s['mape_pct']:.1f}%" if "mape_pct" in s else "–"
        lines.append(f"| {name} | {s['iteration_s']:.3f} | {s['iteration_s_stdev']:.3f} | {_pct(s['max_idle_ratio'])} | "
                     f"{idle} | {s['comm_s']:.3f} | {s['ctx_switches_per_iter']:.0f} | {rss} | {layout} | {mape} |")
    if doc["ratios"]:
        lines += ["", "Ratios (iteration time; < 1 means the first is faster): " + ", ".join(
            f"**{k}** {v:.3f}" for k, v in doc["ratios"].items())]
    lines += ["", f"Ideal ratio to uniform from the device speeds alone (N·min s / Σs): "
              f"{sc['ideal_ratio_to_uniform_from_speeds']:.3f}"]
    return "\n".join(lines) + "\n"


# -- files ---------------------------------------------------------------------------------------
def atomic_write(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same directory and rename: never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; results are for everyone to read
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write(doc: dict, out_dir: Path, plots: bool = True) -> list[Path]:
    """Result JSON, Markdown and (optionally) PNG plots of one cell; returns the paths written."""
    name = doc["spec"]["cell_name"]
    md = markdown(doc)  # render everything before the first file lands
    if "tta" in doc:
        from xronos.bench.tta import markdown as tta_markdown

        md += "\n" + tta_markdown(doc)
    pngs = {}
    if plots:
        from xronos.bench.plots import accuracy_curves, cell_plots

        pngs = cell_plots(doc)
        if "tta" in doc:
            pngs["accuracy"] = accuracy_curves(doc["tta"]["curves"], doc["tta"]["target"], name)
    written = []
    for suffix, data in [(".json", json.dumps(doc, indent=1, default=str).encode()), (".md", md.encode()),
                         *[(f"-{k}.png", v) for k, v in pngs.items()]]:
        path = out_dir / f"{name}{suffix}"
        atomic_write(path, data)
        written.append(path)
    return written
