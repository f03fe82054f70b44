"""Summaries, ratios and ideal bounds of a benchmark cell; atomic result files (its Markdown is
`cellreport.py`'s).

Iteration time: a step ends when its slowest rank ends, so per step we take the max over ranks of
the rank's iteration time, and report the mean over the steps after warm-up, with the standard
deviation over those steps (the spread the plots show as error bars). Idle ratio per node:
- TP (ours): the trainer's idle time (own time in collectives minus the fastest rank's) / iteration;
- pp: time blocked receiving (bubbles + transfers, which PP cannot tell apart) / iteration;
- hf-tp: no per-collective timings exist, so 1 - CPU time / (CPU share x wall time), a
  utilisation estimate (also given for pp as a cross-check).
MAPE: predicted (cost model) vs measured per-node compute time, over nodes holding any shard.
Ideal lower bound, two ways: from the planner (profiles: the continuous relaxation under the caps)
and from this cell's measured per-node compute times (`measured_ideal`), each plus the measured
communication and data time. A strategy that was not timed says why: not run (the model or world
does not allow it), infeasible (its plan exceeds a memory cap: shown, never timed) or failed.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
from pathlib import Path

from xronos.bench.cellreport import markdown

TP_NAMES = ("xronos", "xronos-paper", "uniform", "xronos-optimal")  # the last: results from before issue 11
XRONOS = ("xronos", "xronos-paper", "xronos-optimal")
# The LoRA job trains something else than full fine-tuning: its strategies are compared, and its
# measured ideal fitted, among themselves (`LORA_SUFFIX` names each one's full fine-tuning twin).
LORA_SUFFIX = "-lora"
LORA_TP_NAMES = ("xronos-lora", "uniform-lora")
LORA_XRONOS = ("xronos-lora",)
KINDS = ("attn", "mlp", "vocab")


def _steady(iters: list[dict], warmup: int) -> list[dict]:
    return iters[warmup:] if len(iters) > warmup else iters


def _kind_means(s: list[dict]) -> dict[str, float] | None:
    """Mean per-kind compute (attn, mlp, vocab, rest) when the trainer reported it (issue 11)."""
    keys = [f"compute_{k}_s" for k in (*KINDS, "rest")]
    if not all(x.get(k) is not None for x in s for k in keys):
        return None
    return {k: statistics.mean(x[f"compute_{k}_s"] for x in s) for k in (*KINDS, "rest")}


def _row_work(row: dict) -> int:
    """Shards a plan row holds: per-kind counts, or the head-tied units of older results."""
    if any(k in row for k in KINDS):
        return sum(row.get(k) or 0 for k in KINDS)
    return row.get("units", 0)


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
                     "idle_ratio": statistics.mean(x["idle_s"] for x in s) / it,
                     "idle_ratio_stdev": statistics.pstdev(x["idle_s"] / x["iteration_s"] for x in s),
                     "compute_s_stdev": statistics.pstdev(x["compute_s"] for x in s)}
            node |= {k: r[k] for k in KINDS if k in r}
            kinds = _kind_means(s)
            if kinds:
                node["compute_by_kind_s"] = kinds
        if "recv_wait_s" in s[0]:  # pipeline
            node |= {"span": r["span"], "idle_ratio": statistics.mean(x["recv_wait_s"] for x in s) / it,
                     "idle_ratio_stdev": statistics.pstdev(x["recv_wait_s"] / x["iteration_s"] for x in s)}
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
    if entry.get("same_layout_as"):
        out["same_layout_as"] = entry["same_layout_as"]
    plan = entry.get("plan") or {}
    if "rows" in plan:  # a TP plan: predicted vs measured compute per node
        pairs = [(row["predicted_compute_s"], n["compute_s"]) for row, n in zip(plan["rows"], nodes)
                 if _row_work(row) > 0]
        out["predicted_vs_measured"] = pairs
        out["mape_pct"] = 100 * statistics.mean(abs(p - m) / m for p, m in pairs)
        out["predicted_iteration_s"] = plan["predicted_iteration_s"]
        if plan.get("ideal_compute_s") is not None:
            # The lower bound: fractional perfect balance + the communication measured here.
            out["ideal_iteration_s"] = plan["ideal_compute_s"] + out["comm_s"] + max(n["data_s"] for n in nodes)
    elif plan.get("predicted_iteration_s") is not None:  # a pipeline plan's, beside the measured one
        out["predicted_iteration_s"] = plan["predicted_iteration_s"]
    return out


def summarize(doc: dict) -> dict:
    warmup = doc["spec"]["warmup"]
    shares = doc["scenario"]["shares"]
    summ = {k: summarize_strategy(k, v, shares, warmup) for k, v in doc["strategies"].items()}
    doc["summary"] = {k: v for k, v in summ.items() if v is not None}
    # the LoRA job computes less per unit (no gradients of the frozen base's weights): its
    # ideal is fitted on its own runs only
    kind_params = doc.get("model", {}).get("kind_parameters")
    for key, names, xs in (("measured_ideal", TP_NAMES, XRONOS), ("measured_ideal_lora", LORA_TP_NAMES, LORA_XRONOS)):
        ideal = measured_ideal(doc["summary"], kind_params, names)
        if ideal is None:
            continue
        doc[key] = ideal
        for x in xs:
            if x in doc["summary"]:
                x_sum = doc["summary"][x]
                extra = x_sum["comm_s"] + max(n["data_s"] for n in x_sum["nodes"])
                x_sum["ideal_measured_s"] = ideal["compute_s"] + extra
                if ideal.get("compute_whole_heads_s") is not None:
                    x_sum["ideal_measured_whole_heads_s"] = ideal["compute_whole_heads_s"] + extra
    doc["ratios"] = ratios(doc["summary"])
    return doc


# -- the measured ideal ----------------------------------------------------------------------------
def measured_ideal(summary: dict, kind_params: dict | None = None, names: tuple[str, ...] = TP_NAMES) -> dict | None:
    """The best compute time any layout could reach, from this cell's *measured* per-node compute
    (not the profile): a lower bound to compare xronos' iteration with (plus its communication).

    Per-kind (when the trainer reports each rank's compute split into attn / mlp / vocab / rest,
    `compute_<kind>_s`): every synchronisation segment of an iteration belongs to one kind (the
    compute before a collective is booked to that collective's kind), so an iteration's compute is
    at least sum over kinds of max over nodes of that kind's compute, plus max over nodes of the rest.
    Each node's kind-k compute is fitted as a_dk + b_dk x from the cell's TP runs (x = its count of
    that kind; a_dk is the replicated work around the segment, which every node runs even at x = 0).
    The rest (head, norms, clipping, the optimizer step) grows with the parameters a node holds, so
    it is fitted as r_d + c_d P (P = parameters held, from the model's parameters per kind). The
    bound is then the sum of the continuous balances of each kind and of the rest, each solved on
    its own (the smallest T with sum_d (T - a_d) / b_d = total, T >= every a_d): minimising each
    term separately can only go below the joint optimum, so it stays a lower bound. The
    "whole heads" variant takes attention in whole units (no engine can split a head), the
    tightest bound an integer layout can reach; the plain one is the continuous relaxation.

    Without per-kind metrics (older results): each node's total compute fitted as a + b w, w = its
    share of the model's partitioned parameters (= units / H for head-tied layouts), one balance.

    Fits: least squares through a node's distinct counts (at least two). Where a node saw one
    count only, or the fit is not physical (a < 0 or b <= 0), its slope follows the other nodes'
    intercept-to-slope ratio (the same kernels at another speed: b = t / (kappa + x), a = kappa b;
    kappa = 0 if no node gave a fit); a node that never held the kind gets the fastest slope seen.
    The memory caps are not applied here (a relaxation: still a lower bound, looser only where a
    cap binds). `names`: the TP strategies whose runs to fit (full fine-tuning's, or the LoRA
    job's). Returns None when none of them ran."""
    runs = _distinct_runs(summary, names)
    if not runs:
        return None
    D = len(runs[0]["nodes"])
    if not all(len(r["nodes"]) == D for r in runs):
        return None
    per_kind = all("compute_by_kind_s" in n and all(k in n for k in KINDS) for r in runs for n in r["nodes"])
    if per_kind:
        totals = {k: sum(n[k] for n in runs[0]["nodes"]) for k in KINDS}
        params = _per_unit_params(kind_params, totals)
        out: dict = {"method": "per-kind", "per_kind_s": {}, "fits": {}}
        for k in KINDS:
            pts = [[(n[k], n["compute_by_kind_s"][k]) for n in (r["nodes"][d] for r in runs)] for d in range(D)]
            fits = _fits(pts)
            out["fits"][k] = fits
            out["per_kind_s"][k] = _balance(fits, totals[k])
            if k == "attn":
                out["attn_whole_units_s"] = _balance_integer(fits, totals[k])
        held = [[(sum(params[k] * n[k] for k in KINDS), n["compute_by_kind_s"]["rest"])
                 for n in (r["nodes"][d] for r in runs)] for d in range(D)]
        fits = _fits(held)
        out["fits"]["rest"] = fits
        out["per_kind_s"]["rest"] = _balance(fits, sum(params[k] * totals[k] for k in KINDS))
        out["compute_s"] = sum(out["per_kind_s"].values())
        out["compute_whole_heads_s"] = out["compute_s"] - out["per_kind_s"]["attn"] + out["attn_whole_units_s"]
        return out
    # Totals only: a node's share of the partitioned parameters (head-tied: units / H).
    H = sum(n["units"] for n in runs[0]["nodes"])
    tied = not all(all(k in n for k in KINDS) for r in runs for n in r["nodes"])
    if tied:
        share = lambda n: n["units"] / H  # noqa: E731
    else:
        totals = {k: sum(n[k] for n in runs[0]["nodes"]) for k in KINDS}
        params = _per_unit_params(kind_params, totals)
        whole = sum(params[k] * totals[k] for k in KINDS)
        share = lambda n: sum(params[k] * n[k] for k in KINDS) / whole  # noqa: E731
    pts = [[(share(n), n["compute_s"]) for n in (r["nodes"][d] for r in runs)] for d in range(D)]
    fits = _fits(pts)
    return {"method": "total", "fits": {"total": fits}, "compute_s": _balance(fits, 1.0)}


def _distinct_runs(summary: dict, names: tuple[str, ...] = TP_NAMES) -> list[dict]:
    """The TP strategies' summaries, one per distinct layout (a reused measurement counts once)."""
    seen, out = set(), []
    for k in names:
        s = summary.get(k)
        if not s or "compute_s" not in s["nodes"][0]:
            continue
        key = tuple((n.get("units"), *(n.get(kk) for kk in KINDS)) for n in s["nodes"])
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def _per_unit_params(kind_params: dict | None, totals: dict[str, int]) -> dict[str, float]:
    """Parameters per unit of each kind (all blocks); without the model's split, equal shares."""
    if kind_params and all(kind_params.get(k) for k in KINDS):
        return {k: kind_params[k] / totals[k] for k in KINDS}
    return {k: 1.0 / totals[k] for k in KINDS}


def _affine(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares a + b x through points at >= 2 distinct x; None if fewer or not physical."""
    xs = {x for x, _ in points}
    if len(xs) < 2:
        return None
    mx = statistics.mean(x for x, _ in points)
    my = statistics.mean(t for _, t in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (t - my) for x, t in points) / sxx
    a = my - b * mx
    return (a, b) if b > 0 and a >= 0 else None


def _fits(points: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Per node (a, b) of t = a + b x (see `measured_ideal` for the fallbacks)."""
    direct = [_affine(p) for p in points]
    ratios = sorted(a / b for a, b in filter(None, direct))
    kappa = ratios[len(ratios) // 2] if ratios else 0.0  # median intercept-to-slope ratio
    fits: list[tuple[float, float] | None] = []
    for p, fit in zip(points, direct):
        if fit is None:
            held = [(x, t) for x, t in p if x > 0]
            if held:
                x, t = statistics.mean(x for x, _ in held), statistics.mean(t for _, t in held)
                b = t / (kappa + x)
                fit = (kappa * b, b)
            else:  # never held this kind: its time is the replicated work; slope from the others
                fit = (statistics.mean(t for _, t in p), None)
        fits.append(fit)
    slopes = [b for _, b in fits if b]
    fastest = min(slopes) if slopes else math.inf
    return [(a, b if b else fastest) for a, b in fits]


def _balance(fits: list[tuple[float, float]], total: float) -> float:
    """Smallest T with sum_d (T - a_d) / b_d >= total and T >= max_d a_d (every node runs its
    intercept, its replicated work, whatever share it takes)."""
    floor = max(a for a, _ in fits)
    inv = sum(1 / b for _, b in fits if math.isfinite(b))
    if total <= 0 or inv == 0:
        return floor
    return max(floor, (total + sum(a / b for a, b in fits if math.isfinite(b))) / inv)


def _balance_integer(fits: list[tuple[float, float]], total: int) -> float:
    """The same in whole units: hand each unit to the node finishing first after taking it (optimal
    for a min-max of increasing costs)."""
    held = [0] * len(fits)
    for _ in range(int(total)):
        d = min(range(len(fits)), key=lambda i: (fits[i][0] + fits[i][1] * (held[i] + 1), i))
        held[d] += 1
    return max(a + b * h for (a, b), h in zip(fits, held))


def ratios(s: dict) -> dict:
    def r(a: str, b: str) -> float | None:
        return s[a]["iteration_s"] / s[b]["iteration_s"] if a in s and b in s else None

    out = {}
    for x in (*XRONOS, *LORA_XRONOS):
        if x not in s:
            continue
        sfx = LORA_SUFFIX if x in LORA_XRONOS else ""  # the LoRA job against the LoRA job only
        out[f"{x}/uniform{sfx}"] = r(x, f"uniform{sfx}")
        if x == "xronos":
            out["xronos/xronos-paper"] = r(x, "xronos-paper")
        out[f"{x}/pp{sfx}"] = r(x, f"pp{sfx}")
        if not sfx:
            out[f"{x}/hf-tp"] = r(x, "hf-tp")
        if s[x].get("ideal_measured_s"):
            out[f"{x}/ideal (measured fit)"] = s[x]["iteration_s"] / s[x]["ideal_measured_s"]
        if s[x].get("ideal_measured_whole_heads_s"):
            out[f"{x}/ideal (measured fit, whole heads)"] = s[x]["iteration_s"] / s[x]["ideal_measured_whole_heads_s"]
        if s[x].get("ideal_iteration_s"):
            out[f"{x}/ideal (profile)"] = s[x]["iteration_s"] / s[x]["ideal_iteration_s"]
            if f"uniform{sfx}" in s:  # share of the ideal gain over uniform that was captured
                u, i = s[f"uniform{sfx}"]["iteration_s"], s[x]["ideal_iteration_s"]
                # Only where there is a gain to capture: on equal devices u - i is run-to-run noise,
                # and a ratio over it means nothing (the homogeneous control read -55 once).
                out[f"{x} gain captured"] = (u - s[x]["iteration_s"]) / (u - i) if u > 1.05 * i else None
    out["uniform/hf-tp"] = r("uniform", "hf-tp")
    return {k: v for k, v in out.items() if v is not None}


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
