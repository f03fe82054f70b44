"""PNG plots in the paper's style (Figs. 6, 8, 9, 10), rendered to bytes (written atomically elsewhere).

Iteration bars carry the spread: an error bar of one standard deviation over the measured steps.
A strategy that was not timed gets a marker instead of a bar ("x" infeasible, "–" not run or failed).
"""

from __future__ import annotations

import io

COLORS = {"xronos": "#1f77b4", "xronos-paper": "#6baed6", "xronos-optimal": "#9ecae1", "uniform": "#d62728",
          "pp": "#2ca02c", "hf-tp": "#9467bd", "xronos-lora": "#08519c", "uniform-lora": "#fb6a4a",
          "pp-lora": "#74c476"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


def iteration_bars(cells: list[dict], title: str) -> bytes:
    """Fig. 6: iteration time (mean ± sd over the measured steps), bars grouped by cell (scenario /
    model / blocks / seq), one bar per strategy; an untimed strategy is marked at the axis."""
    plt = _plt()
    strategies = [s for s in COLORS if any(s in c["summary"] or s in c.get("strategies", {}) for c in cells)]
    fig, ax = plt.subplots(figsize=(max(4, 1.8 * len(cells) + 1), 3.4))
    width = 0.8 / max(1, len(strategies))
    for j, s in enumerate(strategies):
        timed = [(i, c["summary"][s]) for i, c in enumerate(cells) if s in c["summary"]]
        xs = [i + j * width for i, _ in timed]
        ys = [v["iteration_s"] for _, v in timed]
        err = [v.get("iteration_s_stdev", 0.0) for _, v in timed]
        ax.bar(xs, ys, width, yerr=err, capsize=2, error_kw={"elinewidth": 0.8}, label=s, color=COLORS[s])
        for i, c in enumerate(cells):
            e = c.get("strategies", {}).get(s)
            if e is not None and s not in c["summary"]:
                ax.plot(i + j * width, 0, marker="x" if "infeasible" in e else "_", color=COLORS[s], ms=7, mew=1.5,
                        clip_on=False)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))])
    ax.set_xticklabels([f"{c['scenario']['name']}\n{c['model']['name']}\n{c['model']['blocks']} blocks, "
                        f"seq {c['spec']['seq_len']}" for c in cells], fontsize=7)
    ax.set_ylabel("Iteration time (s), ± sd")
    untimed = any(s not in c["summary"] and "infeasible" in c.get("strategies", {}).get(s, {})
                  for c in cells for s in strategies)
    ax.set_title(title + (" (x: infeasible under the memory caps)" if untimed else ""), fontsize=9)
    ax.legend(fontsize=7)
    return _png(fig)


def idle_bars(doc: dict) -> bytes:
    """Fig. 4/8: idle-time ratio per node and strategy (± sd over the measured steps)."""
    plt = _plt()
    names = [d["name"] for d in doc["scenario"]["devices"]]
    strategies = [s for s in COLORS if s in doc["summary"]]
    fig, ax = plt.subplots(figsize=(1.2 * len(names) + 2, 3.2))
    width = 0.8 / max(1, len(strategies))
    for j, s in enumerate(strategies):
        by_dev = {n["device"]: n for n in doc["summary"][s]["nodes"]}
        xs = [i + j * width for i in range(len(names)) if i in by_dev]
        ys = [100 * by_dev[i]["idle_ratio"] for i in range(len(names)) if i in by_dev]
        err = [100 * by_dev[i].get("idle_ratio_stdev", 0.0) for i in range(len(names)) if i in by_dev]
        ax.bar(xs, ys, width, yerr=err, capsize=2, error_kw={"elinewidth": 0.8}, label=s, color=COLORS[s])
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))])
    ax.set_xticklabels([f"{n}-{i}" for i, n in enumerate(names)], fontsize=7, rotation=15)
    ax.set_ylabel("Idle time fraction (%), ± sd")
    ax.set_title(doc["spec"]["cell_name"], fontsize=9)
    ax.legend(fontsize=7)
    return _png(fig)


def predicted_scatter(points: list[tuple[str, float, float]], title: str) -> bytes:
    """Fig. 9: predicted vs measured per-node compute time, with the y = x diagonal."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(3.6, 3.4))
    for label in sorted({p[0] for p in points}):
        xs = [m for lab, _, m in points if lab == label]
        ys = [p for lab, p, _ in points if lab == label]
        ax.scatter(xs, ys, s=14, label=label)
    hi = max([max(p, m) for _, p, m in points] + [1e-3]) * 1.1
    ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="ideal (y = x)")
    ax.set_xlim(0, hi), ax.set_ylim(0, hi)
    ax.set_xlabel("Measured compute time (s)")
    ax.set_ylabel("Predicted compute time (s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6)
    return _png(fig)


def accuracy_curves(curves: dict[str, list[tuple[float, float]]], target: float, title: str) -> bytes:
    """Fig. 10: accuracy over elapsed training time per strategy, with the target line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(4.6, 3.2))
    for s, pts in curves.items():
        ax.plot([t for t, _ in pts], [a for _, a in pts], marker="o", ms=3, label=s, color=COLORS.get(s))
    ax.axhline(target, color="k", ls=":", lw=0.8, label=f"target {target:.0%}")
    ax.set_xlabel("Elapsed training time (s)")
    ax.set_ylabel("Accuracy")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return _png(fig)


def cell_plots(doc: dict) -> dict[str, bytes]:
    out = {}
    if doc["summary"]:
        out["iteration"] = iteration_bars([doc], doc["spec"]["cell_name"])
        out["idle"] = idle_bars(doc)
    pts = [(s, p, m) for s, v in doc["summary"].items() if not v.get("same_layout_as")
           for p, m in v.get("predicted_vs_measured", [])]
    if pts:
        out["predicted"] = predicted_scatter(pts, doc["spec"]["cell_name"])
    return out
