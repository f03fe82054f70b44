"""Per-segment measured compute: each rank's iteration split into attention, MLP, vocabulary and
the rest, from the tagged timeline of its collectives (`TPGroup` spans, `metrics.segment_compute`).

The attribution is checked exactly on a virtual clock (hooks on the real model advance it by known
amounts inside each segment, so no wall time is asserted); the tags of a real multi-rank
iteration are checked on its timeline; and a real `xronos run` with a rank holding no MLP columns
books (next to) no MLP compute to it.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
import torch

import runkit
from xronos.cli.main import main
from xronos.node.data.batches import Batch
from xronos.node.rank.metrics import IterationRecord, Rusage, segment_compute, summarize
from xronos.node.models.loading import init_random
from xronos.node.models.registry import family_for
from xronos.node.runconfig import RunConfig
from xronos.node.tp.group import Span, TPGroup
from xronos.node.tp.layout import ShardLayout
from xronos.node.rank.tpengine import train_step
from xronos.protocol.layout import Layout
from xronos.protocol.messages import IterationMetrics


def test_the_gap_before_a_tagged_span_is_that_kinds_compute() -> None:
    spans = [Span("broadcast", "data", 10.0, 0.5),  # 0.0 before it: rest; data itself is not compute
             Span("all_reduce_sum", "vocab", 11.0, 0.1),  # 0.5 of vocabulary compute
             Span("all_reduce_sum", "attn", 12.1, 0.2),  # 1.0 attention
             Span("mark", "mlp", 12.5, 0.0),  # 0.2 MLP
             Span("all_reduce_sum", None, 12.6, 0.1),  # untagged: rest 0.1
             Span("mark", "rest", 13.0, 0.0)]  # 0.3 rest, then 1.0 to the end
    out = segment_compute([Span("barrier", "attn", 9.0, 0.5)] + spans, 10.0, 14.0)  # the stale one is skipped
    assert out == pytest.approx({"attn": 1.0, "mlp": 0.2, "vocab": 0.5, "rest": 1.4})
    busy = sum(s.seconds for s in spans)
    assert sum(out.values()) == pytest.approx(4.0 - busy)  # compute = iteration - time in collectives
    assert segment_compute([], 0.0, 2.0) == {"attn": 0.0, "mlp": 0.0, "vocab": 0.0, "rest": 2.0}


def test_summaries_and_the_wire_carry_the_split() -> None:
    recs = [IterationRecord(step=s, epoch=0, loss=1.0, lr=1e-4, iteration_s=1.0, compute_s=0.6, comm_s=0.3,
                            idle_s=0.1, data_s=0.0, voluntary_ctx_switches=0, involuntary_ctx_switches=0,
                            peak_rss=1, compute_attn_s=0.1 * s, compute_mlp_s=0.2, compute_vocab_s=0.1,
                            compute_rest_s=0.3 - 0.1 * s) for s in range(3)]
    assert IterationRecord.from_row(recs[2].as_row()) == recs[2]
    s = summarize(0, Layout(attn=(2,), mlp=(64,), vocab=(40,)), recs)
    assert (s.compute_attn_s, s.compute_mlp_s, s.compute_rest_s) == pytest.approx((0.15, 0.2, 0.15))
    m = IterationMetrics(job_id="j", plan_version=1, node_id="n", rank=0, step=1, epoch=0, loss=1.0,
                         compute_s=0.6, comm_s=0.3, idle_s=0.1, iteration_s=1.0, voluntary_ctx_switches=0,
                         involuntary_ctx_switches=0, peak_rss=1, compute_attn_s=0.1, compute_mlp_s=0.2,
                         compute_vocab_s=0.1, compute_rest_s=0.2)
    assert m.compute_mlp_s == 0.2
    older = m.model_dump(exclude={"compute_attn_s", "compute_mlp_s", "compute_vocab_s", "compute_rest_s"})
    assert IterationMetrics(**older).compute_attn_s is None  # optional: a node without the split


class Clock:
    """A virtual perf_counter that only hooks advance."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def add(self, seconds: float):
        def hook(*_args, **_kw):
            self.now += seconds
        return hook

    def on_grad(self, seconds: float):
        """A forward hook whose output's gradient advances the clock (inside the backward pass)."""
        def hook(_module, _inputs, out):
            if out.requires_grad:
                out.register_hook(lambda g: self.add(seconds)())
        return hook


def _config(kind: str) -> dict:
    import transformers as tf

    if kind == "gpt2-lm":
        c = tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_inner=64, vocab_size=50, n_positions=16,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        c.architectures = ["GPT2LMHeadModel"]
    else:
        c = tf.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                          vocab_size=50, max_position_embeddings=16, num_labels=2)
        c.architectures = ["BertForSequenceClassification"]
    return c.to_dict()


# Virtual seconds spent inside each segment, per block or once, forward and backward.
ATTN_FWD, ATTN_BWD, MLP_FWD, MLP_BWD, EMB_FWD, EMB_BWD = 10.0, 20.0, 1.0, 2.0, 100.0, 200.0
NORM_FWD, HEAD_FWD, HEAD_BWD, OPT = 1000.0, 3000.0, 4000.0, 5000.0


@pytest.mark.parametrize("kind", ["gpt2-lm", "bert-cls"])
def test_each_segment_gets_exactly_its_time_on_a_virtual_clock(kind, monkeypatch) -> None:
    config = _config(kind)
    task = "causal-lm" if kind.endswith("lm") else "classify"
    family = family_for(config)
    group = TPGroup.single(trace=True)  # as `xronos run --nodes 1` joins: boundaries become marks
    model = init_random(family.build(config, task, ShardLayout.single(family.sizes(config)), group), 0)
    model.train()
    clock = Clock()
    if kind == "gpt2-lm":
        blocks, emb, final = model.transformer.h, model.transformer.wte, model.transformer.ln_f
        parts = [(b.attn.c_proj, b.attn.c_attn, b.mlp.c_proj, b.mlp.c_fc) for b in blocks]
    else:
        emb, final = model.word_embeddings, model.layers[-1].mlp_ln
        parts = [(b.attn.out, b.attn.query, b.mlp.down, b.mlp.up) for b in model.layers]
        model.pooler.register_forward_pre_hook(clock.add(HEAD_FWD))  # the replicated head
        model.classifier.register_forward_hook(clock.on_grad(HEAD_BWD))
    for attn_out, attn_in, mlp_out, mlp_in in parts:
        attn_out.register_forward_pre_hook(clock.add(ATTN_FWD))  # before the attention all-reduce
        attn_in.register_forward_hook(clock.on_grad(ATTN_BWD))  # before attention backward
        mlp_out.register_forward_pre_hook(clock.add(MLP_FWD))
        mlp_in.register_forward_hook(clock.on_grad(MLP_BWD))
    emb.register_forward_pre_hook(clock.add(EMB_FWD))
    emb.register_forward_hook(clock.on_grad(EMB_BWD))
    # After the last MLP all-reduce: GPT-2's final norm, BERT's last post-LN (both "rest").
    final.register_forward_hook(clock.add(NORM_FWD))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.register_step_pre_hook(clock.add(OPT))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ids = torch.randint(0, 50, (2, 8))
    labels = ids.clone() if task == "causal-lm" else torch.tensor([0, 1])
    batches = iter([(0, Batch(ids, torch.ones_like(ids), labels))])
    cfg = RunConfig(recipe=dict(model_dir="m", data_path="d", task=task, batch_size=2, seq_len=8, lr=1e-3,
                                max_steps=1, max_grad_norm=1.0, eval_fraction=0.0),
                    layout=Layout.single(family.sizes(config)))
    replicated = {n for n, s in model.tensor_specs().items() if s.dim is None}
    monkeypatch.setattr(time, "perf_counter", clock)
    rec = train_step(model, opt, sched, group, cfg, replicated, batches, 0, Rusage())
    L = len(parts)
    expect = {"attn": L * (ATTN_FWD + ATTN_BWD), "mlp": L * (MLP_FWD + MLP_BWD), "vocab": EMB_FWD + EMB_BWD,
              "rest": NORM_FWD + OPT + (HEAD_FWD + HEAD_BWD if task == "classify" else 0.0)}
    got = {k: getattr(rec, f"compute_{k}_s") for k in expect}
    assert got == pytest.approx(expect), got
    assert rec.compute_s == pytest.approx(sum(expect.values()))
    assert rec.comm_s == 0.0 and rec.iteration_s == pytest.approx(rec.compute_s)


@pytest.mark.slow
def test_a_rank_without_mlp_columns_books_next_to_no_mlp_compute(tmp_path: Path) -> None:
    """`xronos run` on 2 ranks, lopsided in opposite directions per kind: rank 0 holds every head
    and no MLP column, rank 1 no head and all 4096 MLP columns (GEMMs ~100x the replicated
    norm, residual and per-op overheads that are also booked to the MLP segment). Compared on medians with a wide
    margin: a statement about attribution, not about speed."""
    import transformers as tf

    model = tmp_path / "model"
    model.mkdir()
    runkit.make_tokenizer(model, "gpt2")
    V = len(runkit.WORDS) + 2
    cfg = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_inner=4096, vocab_size=V, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1,
                        pad_token_id=1)
    torch.manual_seed(0)
    tf.GPT2LMHeadModel(cfg).save_pretrained(str(model))
    data = runkit.write_rows(tmp_path / "d.csv", [{"text": t} for t in runkit.texts(64)])
    metrics = tmp_path / "m.json"
    layout = Layout(attn=(4, 0), mlp=(0, 4096), vocab=(V, 0))
    argv = runkit.run_argv(model, data, "causal-lm", layout, tmp_path / "out", steps=6, batch_size=8,
                           extra=("--metrics", str(metrics)))
    argv[argv.index("--seq-len") + 1] = "64"
    assert main(argv) == 0
    ranks = json.loads(metrics.read_text())["ranks"]

    def median(r: int, field: str) -> float:
        return statistics.median(i[field] for i in ranks[r]["iterations"][1:])

    assert median(0, "compute_mlp_s") < 0.1 * median(1, "compute_mlp_s")
    for r in ranks:
        for i in r["iterations"]:
            parts = sum(i[f"compute_{k}_s"] for k in ("attn", "mlp", "vocab", "rest"))
            assert parts == pytest.approx(i["compute_s"], rel=1e-6, abs=1e-9)
        assert r["summary"]["compute_mlp_s"] >= 0 and r["summary"]["compute_vocab_s"] >= 0
