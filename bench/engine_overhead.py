"""Engine overhead: the TP engine at N=1 vs plain transformers, and a rank's memory at ratio p.

    .venv/bin/python -m xronos.bench.engine_overhead [--threads 1] [--steps 6] [--step-layers 4]
        [--rss-layers 8] [--skip-step] [--skip-rss] [--json FILE]

1. Step time. The same checkpoint (random weights, GPT-2-small shape with --step-layers blocks) is
   trained by the engine (world of one) and by `transformers` in the same process, same batch,
   same thread count; one step of each alternately (forward, backward, AdamW step), so load on the
   machine hits both alike. Reported: median wall and CPU (process_time) step time of each and
   their ratios (target <= 1.10; on a shared machine the CPU-time ratio is the steadier one), for
   classification and language modelling, with dropout 0 and with the config's 0.1.
2. Peak RSS. A GPT-2-medium-shaped checkpoint (hidden 1024, 16 heads, vocab 50257, but only
   --rss-layers of the 24 blocks, to fit a shared machine) is loaded by two real ranks (Gloo) with
   splits 0/16, 4/12, 8/8, so p in {0, 1/4, 1/2, 3/4, 1}. Each rank reports its peak RSS above its
   own baseline (after imports and rendezvous) once its shard is loaded, and again after one
   training step; the prediction is p x partitioned + replicated bytes (x4 after a step: weights,
   gradients, two AdamW moments; activations not included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RSS_SPLITS = ((0, 16), (4, 12), (8, 8))


def _hf_config(arch: str, layers: int, task: str, dropout: float):
    from transformers import AutoConfig

    from xronos.node.models.registry import config_from_arch
    from xronos.node.models.shapes import shape

    fields = shape(arch, task)
    fields["num_layers"] = layers
    config = config_from_arch(fields)
    model_type = config.pop("model_type")
    config.update(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, pad_token_id=50256)
    return AutoConfig.for_model(model_type, **config)


def _save_checkpoint(out: Path, arch: str, layers: int, task: str, dropout: float) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(0)
    cls = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
    cls.from_config(_hf_config(arch, layers, task, dropout)).save_pretrained(str(out))


def _engine_model(model_dir: Path, task: str, units: tuple[int, ...], rank: int, group):
    from xronos.node.models.loading import SafetensorsSource, materialize
    from xronos.node.models.registry import family_for
    from xronos.node.tp.layout import ShardLayout
    from xronos.node.rank.validate import read_config

    config = read_config(model_dir)
    family = family_for(config)
    model = family.build(config, task, ShardLayout.tied(units, family.sizes(config), rank), group)
    return materialize(model, SafetensorsSource(model_dir))


def step_comparison(task: str, dropout: float, layers: int, batch: int, seq: int, steps: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from xronos.node.tp.group import TPGroup

    with tempfile.TemporaryDirectory() as tmp:
        _save_checkpoint(Path(tmp), "gpt2-small", layers, task, dropout)
        cls = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
        hf = cls.from_pretrained(tmp, use_safetensors=True)
        eng = _engine_model(Path(tmp), task, (12,), 0, TPGroup.single())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50256, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[0, seq // 2:] = 0  # some padding, as real batches have
    labels = torch.randint(0, 2, (batch,), generator=g) if task == "classify" else ids.masked_fill(mask == 0, -100)

    def hf_step(opt) -> float:
        loss = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def eng_step(opt) -> float:
        loss = eng(ids, mask, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    hf.train()
    eng.train()
    opts = {"hf": torch.optim.AdamW(hf.parameters(), lr=1e-5), "eng": torch.optim.AdamW(eng.parameters(), lr=1e-5)}
    wall: dict[str, list[float]] = {"hf": [], "eng": []}
    cpu: dict[str, list[float]] = {"hf": [], "eng": []}
    first_loss = {}
    for i in range(steps + 1):  # step 0 warms up both
        for name, fn in (("hf", hf_step), ("eng", eng_step)):
            t0, c0 = time.perf_counter(), time.process_time()
            loss = fn(opts[name])
            if i == 0:
                first_loss[name] = loss
            else:
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    med = {k: statistics.median(v) for k, v in wall.items()}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    return dict(task=task, dropout=dropout, layers=layers, batch=batch, seq=seq, steps=steps,
                hf_median_s=med["hf"], engine_median_s=med["eng"], ratio=med["eng"] / med["hf"],
                hf_median_cpu_s=cmed["hf"], engine_median_cpu_s=cmed["eng"],
                cpu_ratio=cmed["eng"] / cmed["hf"],
                first_loss_hf=first_loss["hf"], first_loss_engine=first_loss["eng"])


def _status() -> dict[str, int]:
    """VmRSS/VmHWM/RssAnon/RssFile of this process, bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def rss_child(cfg_path: str) -> None:
    """One rank of the RSS measurement (run as a subprocess)."""
    import torch

    from xronos.node.models import loading, registry  # noqa: F401 - imported before the baseline
    from xronos.node.tp.group import TPGroup

    cfg = json.loads(Path(cfg_path).read_text())
    torch.set_num_threads(cfg["threads"])
    rank, units = cfg["rank"], tuple(cfg["units"])
    group = TPGroup.join(rank, len(units), "127.0.0.1", cfg["port"], timeout_s=600)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: peaks from here on
    base = _status()
    model = _engine_model(Path(cfg["model_dir"]), "causal-lm", units, rank, group)
    specs = model.tensor_specs()
    local_part = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if specs[n].dim is not None)
    local_rep = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if specs[n].dim is None)
    loaded = _status()
    ids = torch.randint(0, 50256, (1, 64), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model(ids, torch.ones_like(ids), ids).backward()
    opt.step()
    stepped = _status()
    Path(cfg["out"]).write_text(json.dumps(dict(rank=rank, units=units, base=base, loaded=loaded,
                                                stepped=stepped, local_partitioned=local_part,
                                                local_replicated=local_rep)))
    group.leave()


def rss_measurement(layers: int, threads: int) -> dict:
    from xronos.node.rank.local import free_port
    from xronos.node.rank.spawn import rank_env
    from xronos.node.models.registry import family_for
    from xronos.node.tp.group import TPGroup
    from xronos.node.tp.layout import ShardLayout
    from xronos.node.rank.validate import read_config

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "gpt2-medium-shaped"
        _save_checkpoint(model_dir, "gpt2-medium", layers, "causal-lm", 0.0)
        config = read_config(model_dir)
        family = family_for(config)
        specs = family.build(config, "causal-lm", ShardLayout.single(family.sizes(config)), TPGroup.single()).tensor_specs()
        full_part = sum(4 * _numel(s.full_shape) for s in specs.values() if s.dim is not None)
        full_rep = sum(4 * _numel(s.full_shape) for s in specs.values() if s.dim is None)
        for units in RSS_SPLITS:
            port, procs, outs = free_port(), [], []
            for rank in range(len(units)):
                cfg, out = Path(tmp) / f"c{rank}.json", Path(tmp) / f"o{rank}.json"
                cfg.write_text(json.dumps(dict(rank=rank, units=units, port=port, model_dir=str(model_dir),
                                               threads=threads, out=str(out))))
                procs.append(subprocess.Popen([sys.executable, "-m", "xronos.bench.engine_overhead",
                                               "--rss-child", str(cfg)], env=rank_env(threads)))
                outs.append(out)
            if any(p.wait() != 0 for p in procs):
                raise RuntimeError(f"an RSS measurement rank failed for split {units}")
            for out in outs:
                r = json.loads(out.read_text())
                p = r["units"][r["rank"]] / 16
                predicted = p * full_part + full_rep
                rows.append(dict(
                    p=p, split=list(units), rank=r["rank"],
                    loaded_peak_above_base=r["loaded"]["VmHWM"] - r["base"]["VmRSS"],
                    loaded_anon_above_base=r["loaded"]["RssAnon"] - r["base"]["RssAnon"],
                    loaded_file_rss=r["loaded"]["RssFile"] - r["base"]["RssFile"],
                    predicted_weights=predicted,
                    local_bytes=r["local_partitioned"] + r["local_replicated"],
                    step_peak_above_base=r["stepped"]["VmHWM"] - r["base"]["VmRSS"],
                    predicted_train_state=4 * predicted,
                    base_rss=r["base"]["VmRSS"],
                ))
    return dict(layers=layers, full_partitioned_bytes=full_part, replicated_bytes=full_rep,
                rows=sorted(rows, key=lambda r: r["p"]))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _mib(b: float) -> str:
    return f"{b / 2**20:8.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per side (after 1 warm-up)")
    ap.add_argument("--step-layers", type=int, default=4, help="GPT-2-small blocks in the step comparison")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rss-layers", type=int, default=8, help="GPT-2-medium blocks (of 24) in the RSS part")
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--rss-child", metavar="CFG", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rss_child:
        rss_child(args.rss_child)
        return 0
    import torch

    torch.set_num_threads(args.threads)
    result: dict = {"threads": args.threads, "torch": torch.__version__}
    if not args.skip_step:
        result["step"] = []
        print(f"step time, engine (N=1) vs transformers: GPT-2-small shape, {args.step_layers} blocks, "
              f"batch {args.batch} x seq {args.seq}, {args.threads} thread(s), median of {args.steps}")
        print(f"{'task':>10} {'dropout':>7} {'hf s':>8} {'engine s':>8} {'ratio':>6} {'hf cpu s':>8} "
              f"{'eng cpu s':>9} {'cpu ratio':>9} {'loss hf/engine':>18}")
        for task in ("classify", "causal-lm"):
            for dropout in (0.0, 0.1):
                r = step_comparison(task, dropout, args.step_layers, args.batch, args.seq, args.steps)
                result["step"].append(r)
                print(f"{task:>10} {dropout:>7} {r['hf_median_s']:>8.3f} {r['engine_median_s']:>8.3f} "
                      f"{r['ratio']:>6.3f} {r['hf_median_cpu_s']:>8.3f} {r['engine_median_cpu_s']:>9.3f} "
                      f"{r['cpu_ratio']:>9.3f} {r['first_loss_hf']:>9.4f}/{r['first_loss_engine']:.4f}", flush=True)
    if not args.skip_rss:
        rss = rss_measurement(args.rss_layers, args.threads)
        result["rss"] = rss
        print(f"\npeak RSS of a rank at ratio p: GPT-2-medium shape with {rss['layers']} of 24 blocks; "
              f"partitioned {_mib(rss['full_partitioned_bytes']).strip()} MiB, replicated "
              f"{_mib(rss['replicated_bytes']).strip()} MiB (fp32)")
        print(f"{'p':>5} {'split':>7} {'loaded MiB':>10} {'(anon':>8} {'file)':>8} {'p*F+R':>8} "
              f"{'step MiB':>9} {'4(p*F+R)':>9} {'base':>8}")
        for r in rss["rows"]:
            print(f"{r['p']:>5.2f} {'/'.join(map(str, r['split'])):>7} {_mib(r['loaded_peak_above_base']):>10} "
                  f"{_mib(r['loaded_anon_above_base'])} {_mib(r['loaded_file_rss'])} {_mib(r['predicted_weights'])} "
                  f"{_mib(r['step_peak_above_base']):>9} {_mib(r['predicted_train_state']):>9} {_mib(r['base_rss'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
