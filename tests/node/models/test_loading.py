"""Loading, registry and export in one process (no collectives are issued while loading)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from ckpts import make_batch, make_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

from xronos.node.models.export import gather_full, save_hf_dir
from xronos.node.models.loading import MissingTensorError, SafetensorsSource, init_random, materialize
from xronos.node.models.registry import arch_spec, config_from_arch, family_for
from xronos.node.tp.group import TPGroup
from xronos.node.tp.layout import ShardLayout


def single(config: dict) -> ShardLayout:
    return ShardLayout.single(family_for(config).sizes(config))


def build(config: dict, task: str, units: tuple[int, ...], rank: int, **kw):
    group = TPGroup.single() if len(units) == 1 else TPGroup.alone(len(units), rank)  # build and load only
    family = family_for(config)
    return family.build(config, task, ShardLayout.tied(units, family.sizes(config), rank), group, **kw)


def config_of(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())


class CountingHandle:
    """Wraps a safe_open handle: records every element read and refuses whole-tensor reads."""

    def __init__(self, handle, log: list) -> None:
        self.handle, self.log = handle, log

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, name):
        raise AssertionError(f"whole-tensor read of {name}")

    def get_slice(self, name):
        sl, log = self.handle.get_slice(name), self.log

        class Slice:
            def get_shape(self):
                return sl.get_shape()

            def __getitem__(self, idx):
                t = sl[idx]
                log.append((name, t.numel()))
                return t

        return Slice()


@pytest.fixture(scope="module")
def gpt2_lm(tmp_path_factory):
    return make_checkpoint("gpt2-lm", tmp_path_factory.mktemp("ck") / "gpt2-lm")


def test_a_rank_reads_only_its_slices(gpt2_lm):
    config = config_of(gpt2_lm)
    model = build(config, "causal-lm", (1, 2, 1), rank=1)
    source = SafetensorsSource(gpt2_lm)
    log: list = []
    opened = source._open
    source._open = lambda fname: CountingHandle(opened(fname), log)
    materialize(model, source)
    specs = model.tensor_specs()
    read: dict[str, int] = {}
    for name, n in log:
        read[name] = read.get(name, 0) + n
    for local, spec in specs.items():
        assert read[spec.hf_name] == model.get_parameter(local).numel(), spec.hf_name
    partitioned = [s for s in specs.values() if s.dim is not None]
    assert source.full_reads == len(specs) - len(partitioned)
    local_elems = sum(p.numel() for p in model.parameters())
    full_elems = sum(math.prod(s.full_shape) for s in specs.values())
    assert sum(read.values()) == local_elems < full_elems
    # and the slices are the right ones
    with safe_open(str(gpt2_lm / "model.safetensors"), "pt") as f:
        for local, spec in specs.items():
            assert torch.equal(model.get_parameter(local), spec.take(f.get_tensor(spec.hf_name))), local


def maps_of(path) -> int:
    import gc

    gc.collect()  # an earlier test's tensors may still hold a map of the same file
    real = str(path.resolve())
    with open("/proc/self/maps") as f:
        return sum(line.rstrip("\n").endswith(real) for line in f)


def test_loading_leaves_no_map_of_the_checkpoint_resident(gpt2_lm):
    """safetensors reads through a map of the whole file, and every page a column slice touches
    counts in the rank's resident set while the map lives: a source that kept its files mapped made
    a GPT-2-medium rank resident in the whole checkpoint's blocks at its build (mem-peak-v10.md)."""
    model = build(config_of(gpt2_lm), "causal-lm", (1, 2, 1), rank=1)
    before = maps_of(gpt2_lm / "model.safetensors")
    source = SafetensorsSource(gpt2_lm)
    assert maps_of(gpt2_lm / "model.safetensors") == before
    materialize(model, source)
    assert maps_of(gpt2_lm / "model.safetensors") == before  # the source is alive; its reads are over
    assert source.slice_reads > 0


def test_sharded_index_without_prefixes_loads_the_same(gpt2_lm, tmp_path):
    """A base-model checkpoint (GPT2Model names: no `transformer.`) split over two files."""
    with safe_open(str(gpt2_lm / "model.safetensors"), "pt") as f:
        tensors = {k.removeprefix("transformer."): f.get_tensor(k) for k in f.keys()}
    names = sorted(tensors)
    half = {k: tensors[k] for k in names[: len(names) // 2]}
    rest = {k: tensors[k] for k in names[len(names) // 2:]}
    save_file(half, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(rest, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in half}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in rest})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = dict(config_of(gpt2_lm), architectures=["GPT2Model"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    a = materialize(build(config, "causal-lm", (0, 3, 1), 1), SafetensorsSource(tmp_path))
    b = materialize(build(config, "causal-lm", (0, 3, 1), 1), SafetensorsSource(gpt2_lm))
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


def test_fresh_task_head_is_created_identically_on_every_rank(gpt2_lm):
    config = dict(config_of(gpt2_lm), num_labels=3, pad_token_id=0)
    heads = []
    for units, rank in (((1, 3), 0), ((1, 3), 1), ((4,), 0)):
        model = materialize(build(config, "classify", units, rank), SafetensorsSource(gpt2_lm))
        heads.append(model.score.weight.detach())
    assert heads[0].shape == (3, 32) and 0.01 < heads[0].std().item() < 0.04
    assert all(torch.equal(h, heads[0]) for h in heads)


def test_checkpoint_problems_are_named(gpt2_lm, tmp_path):
    config = config_of(gpt2_lm)
    with pytest.raises(ValueError, match="no model.safetensors"):
        SafetensorsSource(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="unreadable"):
        SafetensorsSource(tmp_path)
    with safe_open(str(gpt2_lm / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if "h.1.mlp.c_fc.weight" not in k}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(MissingTensorError, match="transformer.h.1.mlp.c_fc.weight"):
        materialize(build(config, "causal-lm", (4,), 0), SafetensorsSource(tmp_path))
    wider = dict(config, n_inner=200)
    with pytest.raises(ValueError, match="has shape"):
        materialize(build(wider, "causal-lm", (4,), 0), SafetensorsSource(gpt2_lm))


def test_registry_refuses_what_it_cannot_build():
    with pytest.raises(ValueError, match="architectures"):
        family_for({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="T5ForConditionalGeneration"):
        family_for({"architectures": ["T5ForConditionalGeneration"]})
    bert = config_from_arch(dict(family="bert", hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=4,
                                 intermediate_size=40, vocab_size=50, max_positions=16, num_labels=2,
                                 tie_word_embeddings=False))
    with pytest.raises(ValueError, match="causal-lm"):
        family_for(bert).build(bert, "causal-lm", single(bert), TPGroup.single())
    with pytest.raises(ValueError, match="attn: layout \\[3\\] sums to 3, but the model has 4 attention units"):
        family_for(bert).build(bert, "classify", ShardLayout(attn=(3,), mlp=(40,), vocab=(50,), rank=0),
                               TPGroup.single())
    llama = config_from_arch(dict(family="llama", hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                  intermediate_size=40, vocab_size=50, max_positions=16, num_labels=None,
                                  tie_word_embeddings=True))
    assert family_for(llama).num_units(llama) == 2
    scaled = dict(llama, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="RoPE type 'yarn' is not supported \\(supported: default, dynamic, "
                                         "linear, llama3\\)"):
        family_for(scaled).build(scaled, "causal-lm", single(scaled), TPGroup.single())
    with pytest.raises(ValueError, match="Qwen2ForCausalLM.*Qwen3ForSequenceClassification"):
        family_for({"architectures": ["Qwen2MoeForCausalLM"]})
    model = init_random(family_for(llama).build(llama, "causal-lm", single(llama), TPGroup.single()), 0)
    ids = torch.zeros(1, 17, dtype=torch.long)
    with pytest.raises(ValueError, match="sequence length 17"):
        model(ids, labels=ids)


ARCHS = [
    dict(family="gpt2", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=72,
         vocab_size=60, max_positions=24, tie_word_embeddings=True),
    dict(family="bert", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=40,
         vocab_size=60, max_positions=24, tie_word_embeddings=False),
    dict(family="roberta", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=40,
         vocab_size=60, max_positions=24, tie_word_embeddings=False),
    dict(family="llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=40,
         vocab_size=60, max_positions=24, tie_word_embeddings=False),
    dict(family="qwen2", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=40,
         vocab_size=60, max_positions=24, tie_word_embeddings=True),
    dict(family="qwen3", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=40,
         vocab_size=60, max_positions=24, tie_word_embeddings=True),
]


@pytest.mark.parametrize("arch,task", [(a, t) for a in ARCHS for t in ("classify", "causal-lm")
                                       if t == "classify" or a["family"] in ("gpt2", "llama", "qwen2", "qwen3")],
                         ids=lambda x: x["family"] if isinstance(x, dict) else x)
def test_random_model_from_arch_exports_a_directory_transformers_loads(arch, task, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    arch = dict(arch, num_labels=3 if task == "classify" else None)
    config = config_from_arch(arch)
    family = family_for(config)
    assert arch_spec(config, task) == arch
    H = family.num_units(config)
    model = init_random(family.build(config, task, single(config), TPGroup.single()), seed=3)
    # Replicated tensors of a random model agree across ranks of any layout.
    other = init_random(build(config, task, (1, H - 1), 1), seed=3)
    specs = model.tensor_specs()
    for name, p in other.named_parameters():
        if specs[name].dim is None:
            assert torch.equal(p, model.get_parameter(name)), name
    state = gather_full(model, specs, single(config), TPGroup.single())
    save_hf_dir(tmp_path, config, task, state)
    auto = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
    hf = auto.from_pretrained(tmp_path)
    hf.eval()
    model.eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ours = model.logits(ids, mask)
        theirs = hf(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_batches_can_carry_token_types():
    """BERT's token_type_ids reach the model (they change the output)."""
    config = config_from_arch(dict(ARCHS[1], num_labels=2))
    model = init_random(family_for(config).build(config, "classify", single(config), TPGroup.single()), 1)
    b = make_batch("bert-cls")
    model.eval()
    with torch.no_grad():
        with_types = model.logits(b["input_ids"] % 60, b["attention_mask"], b["token_type_ids"])
        without = model.logits(b["input_ids"] % 60, b["attention_mask"])
    assert not torch.allclose(with_types, without)
