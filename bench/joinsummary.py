"""What `bench/join.py` reports, pure: records in, figures out. From the ranks' `IterationMetrics`
and the job's `JobState` events of the join run and the static run: the iteration time before and
after the join, the gateway's predictions, the restart and the steps redone, the break-even, the
static run over the same steps; then the Markdown of it all.
"""

from __future__ import annotations

import re
import statistics


OWNER, PEER, NEWCOMER = "n0", "n1", "n2"  # the run's three nodes (n2 joins)
SKIP = 2  # iterations after a (re)start left out of a median: the start's own transient
JOINS = re.compile(r"(?:node|nodes) .* joins: plan v(\d+) -> v(\d+), predicted ([\d.e+-]+) -> ([\d.e+-]+) "
                   r"s/iteration; resuming from step (\d+)")
TAKEN = re.compile(r"taken for plan v\d+ at the checkpoint of step (\d+): predicted ([\d.e+-]+) -> ([\d.e+-]+) "
                   r"s/iteration .*against a restart's ~([\d.]+) s \(([^)]*)\)")
NOT_TAKEN = re.compile(r"not taken: (.*)")


def slowest(metrics: list[dict]) -> dict[tuple[int, int], dict]:
    """Per (plan version, step): the slowest rank's iteration time, the ranks seen and the last
    arrival time. `metrics`: {"t", "plan_version", "rank", "step", "iteration_s"} records."""
    out: dict[tuple[int, int], dict] = {}
    for x in metrics:
        key = (x["plan_version"], x["step"])
        cur = out.setdefault(key, {"iteration_s": 0.0, "ranks": set(), "t": x["t"]})
        cur["iteration_s"] = max(cur["iteration_s"], x["iteration_s"])
        cur["ranks"].add(x["rank"])
        cur["t"] = max(cur["t"], x["t"])
    return out


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _steps(per: dict[tuple[int, int], dict], version: int) -> list[int]:
    return sorted(s for v, s in per if v == version)


def find_join(events: list[str]) -> dict | None:
    """The join from the job's events: versions, the prediction and the resume step (None: no join)."""
    for e in events:
        hit = JOINS.search(e)
        if hit:
            return {"old_version": int(hit[1]), "new_version": int(hit[2]), "predicted_before_s": float(hit[3]),
                    "predicted_after_s": float(hit[4]), "resume_step": int(hit[5])}
    return None


def decision(events: list[str]) -> dict:
    """The gateway's decision on the newcomer: taken (with its restart estimate) or why not."""
    for e in events:
        hit = TAKEN.search(e)
        if hit:
            return {"taken": True, "at_checkpoint": int(hit[1]), "gateway_restart_estimate_s": float(hit[4]),
                    "restart_estimate_source": hit[5], "text": e}
    for e in events:
        hit = NOT_TAKEN.search(e)
        if hit:
            return {"taken": False, "why": hit[1], "text": e}
    return {"taken": None, "why": "no decision in the job's events", "text": None}


def summarize_join(metrics: list[dict], states: list[dict], events: list[str],
                   profiling: tuple[float, float] | None = None) -> dict:
    """The join run's figures. `states`: {"t", "plan_version"} per JobState received (arrival order);
    `profiling`: the (switch, decision) arrival times — the old plan's steps that ended in between
    ran beside the newcomer's profile and are reported apart, not in the time before the join."""
    per = slowest(metrics)
    first = min((v for v, _ in per), default=1)
    out: dict = {"decision": decision(events), "wall_s": _wall(per)}
    join = find_join(events)
    old_steps = _steps(per, join["old_version"] if join else first)
    old_version = join["old_version"] if join else first

    def beside(s: int) -> bool:
        return profiling is not None and profiling[0] <= per[(old_version, s)]["t"] <= profiling[1]

    out["before_s"] = _median([per[(old_version, s)]["iteration_s"] for s in old_steps[SKIP:] if not beside(s)])
    out["while_profiling_s"] = _median([per[(old_version, s)]["iteration_s"] for s in old_steps[SKIP:] if beside(s)])
    out["profiling_s"] = profiling[1] - profiling[0] if profiling is not None else None
    out["iteration_s"] = {f"v{v}": [[s, per[(v, s)]["iteration_s"]] for s in _steps(per, v)]
                          for v in sorted({v for v, _ in per})}
    if join is None:
        out["joined"] = False
        return out
    new_version, resume = join["new_version"], join["resume_step"]
    new_steps = _steps(per, new_version)
    after = _median([per[(new_version, s)]["iteration_s"] for s in new_steps[SKIP:]])
    out.update(joined=True, **join, after_s=after, after_steps=new_steps[SKIP:],
               ranks_after=len(per[(new_version, new_steps[0])]["ranks"]) if new_steps else None)
    last_old = max(per[(old_version, s)]["t"] for s in old_steps) if old_steps else None
    first_new = per[(new_version, new_steps[0])]["t"] if new_steps else None
    cancel = next((s["t"] for s in states if s["plan_version"] == new_version), None)
    out["redone_steps"] = max(max(old_steps, default=resume) - resume, 0)
    out["restart_s"] = first_new - cancel if first_new is not None and cancel is not None else None
    out["restart_from_last_old_step_s"] = first_new - last_old if first_new is not None and last_old else None
    out.update(break_even(out["before_s"], after, out["restart_s"], out["redone_steps"]))
    return out


def break_even(before: float | None, after: float | None, restart_s: float | None, redone: int) -> dict:
    """The restart's cost (its wall time plus the redone steps at the new speed) over the seconds
    saved per iteration: the iterations after which the join has paid (None: it never does)."""
    if before is None or after is None or restart_s is None:
        return {"saved_per_iteration_s": None, "restart_cost_s": None, "break_even_iterations": None}
    saved = before - after
    cost = restart_s + redone * after
    return {"saved_per_iteration_s": saved, "restart_cost_s": cost,
            "break_even_iterations": cost / saved if saved > 0 else None}


def static_over(metrics: list[dict], steps: list[int]) -> float | None:
    """The static run's median iteration (slowest rank) over `steps` (the join run's measured steps)."""
    per = slowest(metrics)
    version = min((v for v, _ in per), default=1)
    return _median([per[(version, s)]["iteration_s"] for s in steps if (version, s) in per])


def _wall(per: dict[tuple[int, int], dict]) -> float | None:
    ts = [x["t"] for x in per.values()]
    return max(ts) - min(ts) if len(ts) > 1 else None


def results(raw: dict) -> dict:
    """The figures of both runs from their records (`run_one`'s dicts; pure)."""
    res: dict = {}
    if "join" in raw:
        r = raw["join"]
        res["join"] = summarize_join(r["metrics"], r["states"], r["events"],
                                     tuple(r["profiling"]) if r["profiling"] else None)
    if "static" in raw:
        per = slowest(raw["static"]["metrics"])
        res["static"] = {"wall_s": _wall(per), "before_s": summarize_join(raw["static"]["metrics"], [], [])["before_s"],
                         "iteration_s": {f"v{v}": [[s, per[(v, s)]["iteration_s"]] for s in _steps(per, v)]
                                         for v in sorted({v for v, _ in per})}}
    for name in res:  # the live policy's re-plans (the join counts as one): the static run may re-shard too
        res[name]["replans"] = raw[name]["replans"]
    if "join" in res and "static" in res:
        j = res["join"]
        res["static"]["over_join_steps_s"] = static_over(raw["static"]["metrics"], j.get("after_steps", []))
        o = res["static"]["over_join_steps_s"]
        res["after_over_static"] = j["after_s"] / o if j.get("after_s") and o else None
        res["after_over_predicted"] = (j["after_s"] / j["predicted_after_s"]
                                       if j.get("after_s") and j.get("predicted_after_s") else None)
        res["wall_join_over_static"] = j["wall_s"] / res["static"]["wall_s"] \
            if j.get("wall_s") and res["static"].get("wall_s") else None
    return res


def _fmt(x: float | None, f: str = ".3f") -> str:
    return "-" if x is None else format(x, f)


def report(meta: dict, res: dict) -> str:
    j, st = res["join"], res["static"]
    d = j["decision"]
    lines = [f"# A node joins a running job: does it pay? (issue 14)\n",
             f"GPT-2-Medium shapes ({meta['blocks']} blocks, classify), batch {meta['batch_size']} x "
             f"{meta['seq_len']}, {meta['steps']} steps, checkpoint every {meta['checkpoint_interval']}; "
             f"three emulated boxes at {', '.join(f'{s:g}' for s in meta['shares'])} cores (cgroup quotas, "
             f"top weight), {NEWCOMER} switched on at step {meta['switch_at']}; gateway `join_restart_s` unset. "
             f"Load average {meta['loadavg_before'][0]:.1f} before, {meta['loadavg_after'][0]:.1f} after "
             f"(provisional: a shared machine). Machine: {meta['machine']}. Clock: "
             f"{meta.get('clock', 'wall (CFS quotas)')}.\n",
             f"Command: `{meta['command']}`\n",
             f"Decision: {d['text'] or d.get('why')}\n"]
    if not j.get("joined"):
        lines.append(f"**No join happened**: {d.get('why')}. Before: {_fmt(j['before_s'])} s/iteration; "
                     f"wall {_fmt(j['wall_s'], '.1f')} s (static {_fmt(st['wall_s'], '.1f')} s).\n")
        return "\n".join(lines)
    lines += ["| figure | value |", "|---|---|",
              f"| iteration before the join (measured, slowest rank, median; not beside the profile) | "
              f"{_fmt(j['before_s'])} s |",
              f"| iteration while {NEWCOMER} profiled ({_fmt(j['profiling_s'], '.0f')} s from the switch to the "
              f"decision) | {_fmt(j['while_profiling_s'])} s |",
              f"| iteration after the join (measured, from the 3rd step after the restart) | {_fmt(j['after_s'])} s |",
              f"| static run over the same steps (2 ranks throughout) | {_fmt(st['over_join_steps_s'])} s |",
              f"| after / static | {_fmt(res['after_over_static'], '.2f')} |",
              f"| predicted before -> after (the join event) | {_fmt(j['predicted_before_s'])} -> "
              f"{_fmt(j['predicted_after_s'])} s |",
              f"| measured before / predicted before | "
              f"{_fmt(j['before_s'] / j['predicted_before_s'] if j['before_s'] else None, '.2f')} |",
              f"| measured after / predicted after | {_fmt(res['after_over_predicted'], '.2f')} |",
              f"| restart: cancel -> first step of plan v{j['new_version']} | {_fmt(j['restart_s'], '.1f')} s |",
              f"| restart: last step of v{j['old_version']} -> first of v{j['new_version']} | "
              f"{_fmt(j['restart_from_last_old_step_s'], '.1f')} s |",
              f"| the gateway's restart estimate ({d.get('restart_estimate_source', '-')}) | "
              f"{_fmt(d.get('gateway_restart_estimate_s'), '.1f')} s |",
              f"| resumed from step / steps redone | {j['resume_step']} / {j['redone_steps']} |",
              f"| saved per iteration | {_fmt(j['saved_per_iteration_s'])} s |",
              f"| break-even (restart + redone steps) / saved | {_fmt(j['break_even_iterations'], '.1f')} iterations |",
              f"| steps left after the resume | {meta['steps'] - j['resume_step']} |",
              f"| re-plans (live re-shards; the join counts as one): join / static run | {j['replans']} / "
              f"{st['replans']} |",
              f"| wall, first step to last: join / static | {_fmt(j['wall_s'], '.1f')} / {_fmt(st['wall_s'], '.1f')} s "
              f"({_fmt(res['wall_join_over_static'], '.2f')}) |"]
    lines.append("\nIteration times are the ranks' own (`IterationMetrics.iteration_s`): they leave out the owner's "
                 "checkpoint writes every few steps, which both runs pay; the wall times include them. The restart "
                 "from the last step of the old plan also holds the checkpoint it resumed from.")
    return "\n".join(lines) + "\n"
