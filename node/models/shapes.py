"""Built-in model shapes (ArchSpec fields) by name: the paper's three models, the small open models
people fine-tune today, and tiny test shapes.

Used by `xronos profile --arch NAME` and the benchmarks to build random-weight models of a known
shape without a checkpoint (`shape_config`). Numbers are those of the public Hugging Face configs;
`EXTRA_CONFIG` adds the config.json keys beyond ArchSpec's fields that change what such a model
computes (its RoPE, its norm epsilon).
"""

from __future__ import annotations

from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # The paper's Table III.
    "roberta-base": dict(family="roberta", hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12,
                         intermediate_size=3072, vocab_size=50265, max_positions=514, num_labels=2,
                         tie_word_embeddings=True),
    "gpt2-medium": dict(family="gpt2", hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=16,
                        intermediate_size=4096, vocab_size=50257, max_positions=1024, num_labels=2,
                        tie_word_embeddings=True),
    "mobilellama-1.4b": dict(family="llama", hidden_size=2048, num_layers=24, num_heads=16, num_kv_heads=16,
                             intermediate_size=5632, vocab_size=32000, max_positions=2048, num_labels=2,
                             tie_word_embeddings=False),
    # A GQA LLaMA for the heterogeneous grid cell (4 KV-head groups: coarse attention, fine MLP).
    "tinyllama-1.1b": dict(family="llama", hidden_size=2048, num_layers=22, num_heads=32, num_kv_heads=4,
                           intermediate_size=5632, vocab_size=32000, max_positions=2048, num_labels=2,
                           tie_word_embeddings=False),
    # The small open models fine-tuned on a few boxes today (Qwen/Qwen2.5-0.5B, Qwen/Qwen2.5-1.5B,
    # meta-llama/Llama-3.2-1B, HuggingFaceTB/SmolLM2-360M): GQA, tied embeddings.
    "qwen2.5-0.5b": dict(family="qwen2", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                         intermediate_size=4864, vocab_size=151936, max_positions=32768, num_labels=2,
                         tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(family="qwen2", hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                         intermediate_size=8960, vocab_size=151936, max_positions=131072, num_labels=2,
                         tie_word_embeddings=True),
    "llama-3.2-1b": dict(family="llama", hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                         intermediate_size=8192, vocab_size=128256, max_positions=131072, num_labels=2,
                         tie_word_embeddings=True),
    "smollm2-360m": dict(family="llama", hidden_size=960, num_layers=32, num_heads=15, num_kv_heads=5,
                         intermediate_size=2560, vocab_size=49152, max_positions=8192, num_labels=2,
                         tie_word_embeddings=True),
    # Small shapes for tests and quick local runs.
    "gpt2-small": dict(family="gpt2", hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12,
                       intermediate_size=3072, vocab_size=50257, max_positions=1024, num_labels=2,
                       tie_word_embeddings=True),
    "tiny-gpt2": dict(family="gpt2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                      intermediate_size=256, vocab_size=500, max_positions=128, num_labels=2,
                      tie_word_embeddings=True),
    "tiny-bert": dict(family="bert", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                      intermediate_size=256, vocab_size=500, max_positions=128, num_labels=2,
                      tie_word_embeddings=True),
    "tiny-llama": dict(family="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       intermediate_size=176, vocab_size=500, max_positions=128, num_labels=2,
                       tie_word_embeddings=False),
}

# config.json keys of the published configs beyond ArchSpec's fields (RoPE, norm epsilon).
EXTRA_CONFIG: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen2.5-1.5b": dict(rope_theta=1000000.0, rms_norm_eps=1e-6),
    "llama-3.2-1b": dict(rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "smollm2-360m": dict(rope_theta=100000.0, rms_norm_eps=1e-5),
}


def shape(name: str, task: str) -> dict[str, Any]:
    """ArchSpec fields of a built-in shape for `task` (num_labels only for classification)."""
    if name not in SHAPES:
        raise ValueError(f"unknown --arch {name!r} (built-in shapes: {', '.join(sorted(SHAPES))})")
    fields = dict(SHAPES[name])
    if task != "classify":
        fields["num_labels"] = None
    return fields


def shape_config(name: str, task: str) -> dict[str, Any]:
    """The config.json dict of a built-in shape for `task`: its ArchSpec fields' config plus
    `EXTRA_CONFIG` (random-weight profiling and benchmarks)."""
    from xronos.protocol.messages import ArchSpec

    from .registry import config_from_arch

    fields = shape(name, task)
    ArchSpec(**fields)  # validates
    return {**config_from_arch(fields), **EXTRA_CONFIG.get(name, {})}
