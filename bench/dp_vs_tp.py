"""Data parallelism against today's tensor parallelism, per iteration, side by side (issue 36).

    .venv/bin/python -m xronos.bench.dp_vs_tp [--ranks 2] [--blocks 6] [--batch 8] [--seq 64]
        [--iters 8] [--warmup 2] [--lora-r 8] [--rate-mbit 1000] [--out bench/results]

A LoRA fine-tune (r = 8 on peft's default targets for Qwen2, q_proj and v_proj; causal LM) of a
Qwen2.5-0.5B-shaped model (the published config: hidden 896, 14 heads over 2 KV heads, MLP 4864,
vocabulary 151,936, tied; `--blocks` of its 24 blocks kept, random weights), whose frozen base fits
every box. The same rank processes train it both ways at the same global batch, their iterations interleaved
(tp, dp, dp, tp, ...) so that a change of the machine's load falls on both alike:

- `tp`: today's engine, every kind split evenly over the ranks (the ranks are alike here);
- `dp`: `node.dp.DataParallel`, a whole replica per rank in DDP, the batch split evenly
  (`gateway.plan.shares.proportional_shares` of equal speeds).

Both run the trainer's step (Xronos' AdamW, global-norm clipping). The clock is the WALL clock
(DDP's asynchronous bucket all-reduce is not on the virtual clock yet): each iteration is timed on
rank 0 from an untimed barrier to the end of its optimizer step; the table gives the median over
`--iters` after `--warmup`, and the ratio tp / dp. With `--rate-mbit` every rank sits behind its
own rate-limited link (`bench/netem.py`, network namespaces; needs root), as boxes on a switched LAN;
without it the ranks meet over loopback, which flatters TP's per-block all-reduces. The ranks
share this machine's cores (one thread each): say the load beside any figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from xronos.common.ports import free_port

QWEN_05B = dict(family="qwen2", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                intermediate_size=4864, vocab_size=151936, max_positions=32768, num_labels=2,
                tie_word_embeddings=True)
STRATEGIES = ("tp", "dp")


def _config(blocks: int) -> dict:
    from xronos.node.models.registry import config_from_arch

    config = config_from_arch(dict(QWEN_05B, num_layers=blocks))
    config.update(rope_theta=1000000.0, rms_norm_eps=1e-6)
    return config


def _build(strategy: str, job: dict, group):
    """One strategy's model, optimizer and batch on this rank; returns its step (every rank runs
    it) and a report of it."""
    import torch

    from xronos.gateway.plan.shares import proportional_shares
    from xronos.node.data.batches import Batch
    from xronos.node.dp.replica import DataParallel
    from xronos.node.dp.rows import rows_of, target_count
    from xronos.node.models.loading import init_random
    from xronos.node.models.registry import family_for
    from xronos.node.rank.optim import adamw
    from xronos.node.tp.group import TPGroup
    from xronos.node.tp.layout import ShardLayout
    from xronos.node.tp.lora import add_lora
    from xronos.node.rank.tpengine import clip_global_grad_norm
    from xronos.protocol.layout import Layout
    from xronos.protocol.messages import LoraSpec

    config, n, rank = job["config"], job["ranks"], group.rank
    family = family_for(config)
    sizes = family.sizes(config)
    if strategy == "tp":
        def even(total: int) -> tuple[int, ...]:  # Megatron's even split, remainders to the first ranks
            return tuple(total // n + (r < total % n) for r in range(n))

        layout = ShardLayout.of(Layout(attn=even(sizes.attn), mlp=even(sizes.mlp), vocab=even(sizes.vocab)), rank)
        tp = group
    else:
        layout, tp = ShardLayout.single(sizes), TPGroup.single()
    model = family.build(config, "causal-lm", layout, tp, dropout=0.0)
    add_lora(model, family.lora_settings(LoraSpec(r=job["lora_r"], alpha=2.0 * job["lora_r"])))
    init_random(model, seed=0)
    model.train()
    opt = adamw([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    replicated = {name for name, s in model.tensor_specs().items() if s.dim is None}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, config["vocab_size"], (job["batch"], job["seq"]), generator=g)
    batch = Batch(ids, torch.ones_like(ids), ids.clone())
    dp = DataParallel(model, group) if strategy == "dp" else None
    shares = proportional_shares([1.0] * n, job["batch"])
    rows, total = rows_of(batch, shares, rank), target_count(batch, "causal-lm")

    def step() -> None:
        if dp is None:
            model(batch.input_ids, batch.attention_mask, batch.labels).backward()
        else:
            dp.forward_backward(rows, total)
        clip_global_grad_norm(model, replicated, 1.0, tp)
        opt.step()
        opt.zero_grad(set_to_none=True)

    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    report = {"trained_bytes": trained, "rows": shares[rank] if dp is not None else job["batch"],
              "layout": layout.layout().model_dump(mode="json")}
    return step, report, dp


def _train(job: dict, group) -> dict:
    """Both strategies' iterations interleaved (tp, dp, dp, tp, ...): a change of the machine's
    background load falls on both alike."""
    built = {s: _build(s, job, group) for s in STRATEGIES}
    times: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    buckets = []
    for it in range(job["warmup"] + job["iters"]):
        for s in (STRATEGIES if it % 2 == 0 else STRATEGIES[::-1]):
            step, _, dp = built[s]
            group.barrier(timed=False)
            t0 = time.perf_counter()
            step()
            if it >= job["warmup"]:
                times[s].append(time.perf_counter() - t0)
            if dp is not None:
                spans = dp.sync.drain()
                if it >= job["warmup"]:
                    buckets = [(b.nbytes, b.seconds) for b in spans]
            group.drain_timings()
            group.drain_spans()
    return {s: {"iteration_s": times[s], "median_s": statistics.median(times[s]), **built[s][1],
                **({"buckets": buckets} if s == "dp" else {})} for s in STRATEGIES}


def child(job_path: str, rank: int) -> None:
    import torch

    from xronos.node.tp.group import TPGroup

    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(job["threads"])
    group = TPGroup.join(rank, job["ranks"], job["host"], job["port"], timeout_s=600)
    out = _train(job, group)
    if rank == 0:
        Path(job["out"]).write_text(json.dumps(out))
    group.leave()


def run(args: argparse.Namespace) -> dict:
    from contextlib import nullcontext

    with tempfile.TemporaryDirectory() as tmp:
        net_cm = nullcontext(None)
        if args.rate_mbit:
            from xronos.bench.netem import Network

            net_cm = Network(args.ranks, rate_mbit=args.rate_mbit)
        with net_cm as net:
            job = {"config": _config(args.blocks), "ranks": args.ranks, "batch": args.batch, "seq": args.seq,
                   "iters": args.iters, "warmup": args.warmup, "lora_r": args.lora_r, "threads": 1,
                   "host": net.rendezvous_host if net else "127.0.0.1", "port": free_port(),
                   "out": str(Path(tmp) / "out.json")}
            job_path = Path(tmp) / "job.json"
            job_path.write_text(json.dumps(job))
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            procs = []
            for r in range(args.ranks):
                argv = [sys.executable, "-m", "xronos.bench.dp_vs_tp", "--child", str(job_path), str(r)]
                procs.append(subprocess.Popen((net.argv_prefix(r) if net else []) + argv,
                                              env=dict(env, **(net.env(r) if net else {}))))
            codes = [p.wait() for p in procs]
            if any(codes):
                raise SystemExit(f"a rank failed: exit codes {codes}")
            result = json.loads(Path(job["out"]).read_text())
    load = os.getloadavg()
    return {"clock": "wall", "model": "qwen2.5-0.5b shape", "blocks": args.blocks, "ranks": args.ranks,
            "batch": args.batch, "seq": args.seq, "lora_r": args.lora_r, "link": f"{args.rate_mbit} Mbit/s"
            if args.rate_mbit else "loopback", "load_after": load, "results": result,
            "ratio_tp_over_dp": result["tp"]["median_s"] / result["dp"]["median_s"]}


def table(doc: dict) -> str:
    r = doc["results"]
    lines = [f"LoRA r={doc['lora_r']}, {doc['model']} ({doc['blocks']} of 24 blocks), {doc['ranks']} ranks, "
             f"batch {doc['batch']} x seq {doc['seq']}, link {doc['link']}, clock: {doc['clock']}, "
             f"load after {doc['load_after'][0]:.2f}", "",
             "| strategy | median iteration (s) | iterations (s) |", "|---|---|---|"]
    for s in STRATEGIES:
        lines.append(f"| {s} | {r[s]['median_s']:.3f} | {' '.join(f'{t:.3f}' for t in r[s]['iteration_s'])} |")
    lines += ["", f"tp / dp = {doc['ratio_tp_over_dp']:.2f}; DP all-reduces {r['dp']['trained_bytes'] / 2**20:.2f} MiB "
              f"of adapter gradients in {len(r['dp']['buckets'])} bucket(s) per iteration"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(argv[1], int(argv[2]))
        return 0
    ap = argparse.ArgumentParser(prog="python -m xronos.bench.dp_vs_tp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=6)  # the grid's depth rule (workloads.realistic_blocks) for 24 blocks
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--rate-mbit", type=float, default=None, help="each rank behind its own link (netem; root)")
    ap.add_argument("--out", type=Path, default=None, help="write dp-vs-tp.json and .md here")
    args = ap.parse_args(argv)
    doc = run(args)
    text = table(doc)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"dp-vs-tp-{doc['link'].replace(' ', '').replace('/', '')}"
        (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
        (args.out / f"{stem}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
