"""The LLaMA-style variants' own parts, in one process: RoPE scaling (llama3, linear, dynamic)
bit-identical to transformers', the Qwen switches, refusals naming what is supported, the built-in
shapes of today's small open models, and the profiler's regions with Qwen3's q/k norms.
(Forward, gradients, AdamW and exports against transformers: test_equivalence.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from xronos.node.models.llama import LLAMA, QWEN2, QWEN3, LlamaDims, RoPE
from xronos.node.models.registry import arch_spec, family_for
from xronos.node.models.shapes import shape, shape_config
from xronos.node.tp.group import TPGroup
from xronos.node.tp.layout import ShardLayout


def _hf_rope(config, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, hd] of a fresh transformers LlamaRotaryEmbedding over positions 0..S-1."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(S)[None])
    return cos[0], sin[0]


def _ours(config) -> RoPE:
    """Our RoPE from the config.json transformers writes for `config`."""
    return LlamaDims(json.loads(config.to_json_string()), None).rope


ROPES = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "linear": dict(rope_type="linear", factor=4.0, rope_theta=10000.0),
    "dynamic": dict(rope_type="dynamic", factor=3.0, rope_theta=10000.0),
    # Wavelengths of 16 channels at theta 1e4 span 6 to 2e4: both sides of 32/4 and 32/1, and between.
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32, rope_theta=10000.0),
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_is_bit_identical_to_transformers(kind):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=24,
                         rope_parameters=dict(ROPES[kind]))
    rope = _ours(config)
    assert rope.kind == kind
    # Dynamic NTK rescales beyond max_position_embeddings (24): lengths on both sides of it.
    for S in (5, 24, 25, 40) if kind == "dynamic" else (5, 24):
        cos, sin = rope.cos_sin(S, torch.device("cpu"))
        hf_cos, hf_sin = _hf_rope(config, S)
        assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin), (kind, S)
    if kind == "dynamic":  # the long branch really differs from the short one
        short = rope.inv_freq(24, torch.device("cpu"))
        assert not torch.equal(rope.inv_freq(40, torch.device("cpu")), short)
    if kind in ("linear", "llama3"):  # and the scaling really scales
        plain = _ours(LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                                  max_position_embeddings=24)).inv_freq(5, torch.device("cpu"))
        assert not torch.equal(rope.inv_freq(5, torch.device("cpu")), plain)


def test_transformers_4_config_json_of_llama_3_2_reads_the_same():
    """config.json as the Hub holds it (rope_scaling + top-level rope_theta, transformers 4.x) and
    the built-in llama-3.2-1b shape: the frequencies transformers computes for them."""
    from transformers import AutoConfig

    hub = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
           "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
           "intermediate_size": 8192, "vocab_size": 128256, "max_position_embeddings": 131072,
           "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True,
           "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    for c in (hub, shape_config("llama-3.2-1b", "causal-lm")):
        rope = LlamaDims(c, None).rope
        assert (rope.kind, rope.theta, rope.factor, rope.original_max_positions) == ("llama3", 500000.0, 32.0, 8192)
        hf = AutoConfig.for_model(**{k: v for k, v in c.items() if k != "model_type"}, model_type="llama")
        cos, sin = rope.cos_sin(16, torch.device("cpu"))
        hf_cos, hf_sin = _hf_rope(hf, 16)
        assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)


def test_qwen_switches_follow_transformers_defaults():
    from transformers import Qwen3Config

    base = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=40, vocab_size=50, max_position_embeddings=16)
    # Qwen3Config's head_dim defaults to 128, not hidden / heads.
    assert LlamaDims(base, None, QWEN3).head_dim == Qwen3Config(**base).head_dim == 128
    assert LlamaDims(base, None, QWEN2).head_dim == LlamaDims(base, None, LLAMA).head_dim == 8
    # Qwen2: q/k/v biased, o_proj not, whatever attention_bias says; no MLP bias ever.
    q2 = LlamaDims(dict(base, attention_bias=False, mlp_bias=True), None, QWEN2)
    assert (q2.qkv_bias, q2.o_bias, q2.mlp_bias, q2.qk_norm) == (True, False, False, False)
    q3 = LlamaDims(dict(base, attention_bias=True), None, QWEN3)
    assert (q3.qkv_bias, q3.o_bias, q3.mlp_bias, q3.qk_norm) == (True, True, False, True)
    ll = LlamaDims(dict(base, attention_bias=True, mlp_bias=True), None, LLAMA)
    assert (ll.qkv_bias, ll.o_bias, ll.mlp_bias, ll.qk_norm) == (True, True, True, False)


@pytest.mark.parametrize("change,message", [
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     "RoPE type 'yarn' is not supported (supported: default, dynamic, linear, llama3)"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "RoPE type 'longrope' is not supported"),
    (dict(rope_scaling={"type": "linear"}), "RoPE type 'linear' needs a positive number 'factor'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}),
     "RoPE type 'llama3' needs a positive number 'low_freq_factor'"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5 is not supported"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default"}}), "per-layer-type RoPE"),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True), "sliding-window attention"),
    (dict(architectures=["Qwen3ForCausalLM"], layer_types=["sliding_attention"]), "sliding-window attention"),
])
def test_unsupported_configs_are_refused_naming_the_problem(change, message):
    config = dict(architectures=["LlamaForCausalLM"], hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=40, vocab_size=50, max_position_embeddings=16,
                  head_dim=8)
    config.update(change)
    with pytest.raises(ValueError) as e:
        family_for(config).sizes(config)  # what validate and the job check call first
    assert message in str(e.value)


def test_unknown_architecture_lists_the_new_families():
    with pytest.raises(ValueError) as e:
        family_for({"architectures": ["MistralForCausalLM"]})
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification", "Qwen3ForCausalLM",
                 "Qwen3ForSequenceClassification"):
        assert arch in str(e.value)


# Published totals (model cards): Qwen2.5-1.5B 1.54B (1.31B without embeddings), Llama-3.2-1B
# 1.23B, SmolLM2-360M 362M — all with tied embeddings (counted once).
PUBLISHED = {"qwen2.5-1.5b": (1.54e9, "qwen2"), "llama-3.2-1b": (1.23e9, "llama"), "smollm2-360m": (3.62e8, "llama")}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_builtin_shapes_of_todays_small_models(name):
    total, family = PUBLISHED[name]
    config = shape_config(name, "causal-lm")
    fam = family_for(config)
    assert fam.name == family and arch_spec(config, "causal-lm") == shape(name, "causal-lm")
    model = fam.build(config, "causal-lm", ShardLayout.single(fam.sizes(config)), TPGroup.single())  # meta
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - total) / total < 0.01, n
    if name == "qwen2.5-1.5b":
        assert abs(n - config["vocab_size"] * config["hidden_size"] - 1.31e9) / 1.31e9 < 0.01
        assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's q/k/v biases
    assert "lm_head" not in dict(model.named_children())  # tied


def test_qwen3_profiles_with_its_norms_in_the_attention_region():
    from xronos.node.measure import profiler as prof
    from xronos.node.measure.timeline import find_regions

    arch = dict(family="qwen3", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                vocab_size=64, max_positions=32, num_labels=None, tie_word_embeddings=True)
    config = prof.config_for(arch=arch)
    fam = family_for(config)
    model = fam.build(config, "causal-lm", ShardLayout.single(fam.sizes(config)), TPGroup.single())
    specs = model.tensor_specs()
    assert specs["model.layers.0.self_attn.q_norm.weight"].dim is None  # replicated
    part = {id(p) for n, p in model.named_parameters() if specs[n].dim is not None}
    assert set(find_regions(model.model.layers[0], part)) == {"self_attn", "mlp"}
    torch.set_num_threads(1)
    report = prof.profile(config, "causal-lm", 2, 8, threads=1, iters=1, warmup=0)
    layers = {lay.name: lay for lay in report.layers}
    assert layers["blk.self_attn"].partitioned and layers["blk.self_attn"].segment == "attn"  # as for LLaMA
    assert report.arch.family == "qwen3"
