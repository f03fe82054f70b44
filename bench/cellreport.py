"""The Markdown of a benchmark cell (`results.write` puts it beside the cell's JSON): the scenario,
the network, the CPU emulation and the memory caps, then per strategy its iteration time, idle
ratios, layout and why a strategy was not timed, the ratios, the ideal bounds and the peak memory
per node. Reads a result document only; the summaries it shows are `results.py`'s.
"""

from __future__ import annotations

from xronos.protocol.layout import KINDS


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def network(doc: dict) -> str:
    """How the cell's ranks were connected; results from before the network emulator ran on loopback."""
    from xronos.bench.netem import describe

    return doc["environment"].get("network") or describe(doc["spec"].get("bandwidth_mbit"))


def cpu_emulation(env: dict) -> str:
    """How the devices' CPU shares were made (`xronos.node.emulate.confinement`); results from before the
    mode existed were all CFS quotas."""
    from xronos.node.emulate.pacer import PACE_CORE_LOAD

    mode = env.get("cpu_emulation", "quota")
    if mode == "virtual":
        return (f"**virtual clock** (each rank's compute bursts at its device's speed, estimator "
                f"`{env.get('estimator') or 'med'}`; collectives resolved from virtual arrivals over the "
                "modelled link; wall seconds kept beside)")
    return ("**wall clock**, CPU shares paced, one pinned core per rank, all scaled by one factor so no core carries "
            f"over {PACE_CORE_LOAD:g} (each run's `dilation`)" if mode == "pace"
            else "**wall clock**, CPU shares as CFS quotas")


def memory_note(doc: dict) -> str:
    """How the cell's memory caps were set (the scale and its basis)."""
    sc, m = doc["scenario"], doc["model"]
    if not any(sc["memory_caps"]):
        return "none (this cell compares speed only)"
    scale = sc.get("mem_scale")
    if scale is None:  # results from before issue 11: RAM x a fixed scale
        return "device RAM x the fixed --mem-scale of that time"
    reserve = sc.get("runtime_reserve", 0) / 2**30
    basis = sc.get("mem_scale_basis", "")
    kept = (f": {m['parameters'] / 1e6:.1f} of {m['full_parameters'] / 1e6:.1f} M"
            if "full_parameters" in m and basis.startswith("parameters") else "")
    return (f"{reserve:.2f} GiB runtime + **{scale:.3f}** x (device RAM - {reserve:.2f} GiB), scale = "
            f"{basis}{kept}; a plan over a cap is shown infeasible, not run")


def layout_text(node_list: list[dict]) -> str:
    if all(k in n for n in node_list for k in KINDS):
        return "; ".join(f"{k} " + "/".join(str(n[k]) for n in node_list) for k in KINDS)
    return "units " + "/".join(str(n["units"]) for n in node_list)


def _why(entry: dict) -> str:
    for key, label in (("infeasible", "INFEASIBLE"), ("not_run", "not run"), ("failed", "FAILED")):
        if key in entry:
            return f"{label}: {entry[key].splitlines()[0][:200]}"
    return "?"


def markdown(doc: dict) -> str:
    sp, sc, m, env = doc["spec"], doc["scenario"], doc["model"], doc["environment"]
    devs = ", ".join(f"{d['name']} ({d['speed']:g}x → {s:g} core"
                     + (f", {c / 2**30:.2f} GiB" if c else "") + ")"
                     for d, s, c in zip(sc["devices"], sc["shares"], sc["memory_caps"]))
    lines = [
        f"### {sp['cell_name']}", "",
        f"- Scenario **{sc['name']}**: {devs}",
        f"- Memory caps: {memory_note(doc)}",
        f"- Network: **{network(doc)}**",
        f"- Model: **{m['name']} shape with {m['blocks']} of {m['paper_blocks']} transformer blocks** "
        f"(full layer width, {m.get('weights', 'random weights')}, {m['parameters'] / 1e6:.1f} M parameters), fp32, batch "
        f"{sp['batch_size']}, sequence length {sp['seq_len']}, AdamW lr {sp['lr']}, classification",
        f"- {sp['iters']} iterations per strategy, first {sp['warmup']} excluded (warm-up); ±sd over the "
        f"measured steps; pp: {sp['micro_batches']} micro-batches, 1F1B",
        f"- Machine: {env['cpu_model']}, {env['cores']} cores, torch {env['torch']}, cgroup v{env['cgroup_version']}, "
        f"{cpu_emulation(env)}, load average {env['loadavg_start'][0]:.2f} → {env['loadavg_end'][0]:.2f} (shared machine)", "",
        "| strategy | iteration s | ±sd | max idle | idle per node | comm s | ctx sw/iter | peak RSS MiB per node | layout | MAPE |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in doc["strategies"].items():
        s = doc["summary"].get(name)
        if s is None:
            layout = ""
            if (entry.get("plan") or {}).get("layout"):
                layout = layout_text([{k: entry["plan"]["layout"][k][r] for k in KINDS}
                                      for r in range(len(entry["plan"]["layout"]["attn"]))])
            lines.append(f"| {name} | {_why(entry)} |||||||| {layout} | |")
            continue
        idle = " / ".join(_pct(n["idle_ratio"]) for n in s["nodes"])
        rss = " / ".join(f"{n['peak_rss'] / 2**20:.0f}" for n in s["nodes"])
        if "units" in s["nodes"][0]:
            layout = layout_text(s["nodes"])
            if entry.get("planner_strategy") and entry["planner_strategy"] != _native(name):
                layout += f" (planner `{entry['planner_strategy']}`: `{_native(name)}` not available)"
            if s.get("same_layout_as"):
                layout += f" (same layout as {s['same_layout_as']}: measured once)"
        elif "span" in s["nodes"][0]:
            layout = "stages " + " ".join(f"d{n['device']}:{n['span'][0]}-{n['span'][1]}" for n in s["nodes"])
            out = entry["raw"].get("idle_devices") or []
            layout += f" (sits out: {', '.join(f'd{d}' for d in out)})" if out else ""
        else:
            layout = "even"
        mape = f"{s['mape_pct']:.1f}%" if "mape_pct" in s else "–"
        lines.append(f"| {name} | {s['iteration_s']:.3f} | {s['iteration_s_stdev']:.3f} | {_pct(s['max_idle_ratio'])} | "
                     f"{idle} | {s['comm_s']:.3f} | {s['ctx_switches_per_iter']:.0f} | {rss} | {layout} | {mape} |")
    lines += memory_lines(doc)
    if doc["ratios"]:
        lines += ["", "Ratios (iteration time; < 1 means the first is faster): " + ", ".join(
            f"**{k}** {v:.3f}" for k, v in doc["ratios"].items())]
    for key, job in (("measured_ideal", ""), ("measured_ideal_lora", " of the LoRA job")):
        ideal = doc.get(key)
        if ideal and ideal.get("method") == "per-kind":
            parts = ", ".join(f"{k} {v:.3f}" for k, v in ideal["per_kind_s"].items())
            lines += ["", f"Measured-fit ideal compute{job} (per kind, `{key}`): {parts} s = "
                      f"{ideal['compute_s']:.3f} s; with whole attention units {ideal['compute_whole_heads_s']:.3f} s"]
        elif ideal:
            lines += ["", f"Measured-fit ideal compute{job} (node totals; no per-kind metrics): {ideal['compute_s']:.3f} s"]
    lines += ["", f"Ideal ratio to uniform from the device speeds alone (N·min s / Σs): "
              f"{sc['ideal_ratio_to_uniform_from_speeds']:.3f}"]
    return "\n".join(lines) + "\n"


def _native(name: str) -> str:
    from xronos.bench.strategies import TP_STRATEGIES

    return TP_STRATEGIES.get(name, name)


def memory_lines(doc: dict) -> list[str]:
    """Per TP strategy that ran: each node's predicted peak (the plan's), measured whole-life peak
    resident set, the cgroup's cap, its peak charge and OOM kills (strategies.run_tp's `memory`)."""
    rows = []
    for name, entry in doc["strategies"].items():
        mem = (entry.get("raw") or {}).get("memory")
        plan_rows = (entry.get("plan") or {}).get("rows")
        if not mem or not plan_rows or entry.get("same_layout_as"):
            continue
        for r, (m, pr) in enumerate(zip(mem, plan_rows)):
            k = m.get("kernel") or {}
            peak = m.get("peak_rss_bytes")
            err = f"{100 * (pr['predicted_memory'] - peak) / peak:+.1f}%" if peak else "–"
            mib = (lambda v: f"{v / 2**20:.0f}" if v else "–")
            rows.append(f"| {name} | {r} | {mib(pr['predicted_memory'])} | {mib(peak)} | {err} | "
                        f"{mib(k.get('limit'))} | {mib(k.get('peak'))} | {k.get('oom_kills', '–')} |")
    if not rows:
        return []
    return ["", "Peak memory per node (predicted: the plan's; measured: the rank's resident high-water mark over the whole run, "
            "which exports nothing here; cgroup: the cap the kernel enforced and its peak charge, page cache included):", "",
            "| strategy | rank | predicted MiB | measured MiB | error | cgroup cap MiB | cgroup peak MiB | OOM kills |",
            "|---|---|---|---|---|---|---|---|", *rows]
