"""Built-in model shapes (ArchSpec fields) by name: the paper's three models and tiny test shapes.

Used by `xronos profile --arch NAME` and the benchmarks to build random-weight models of a known
shape without a checkpoint. Numbers are those of the public Hugging Face configs.
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


def shape(name: str, task: str) -> dict[str, Any]:
    """ArchSpec fields of a built-in shape for `task` (num_labels only for classification)."""
    if name not in SHAPES:
        raise ValueError(f"unknown --arch {name!r} (built-in shapes: {', '.join(sorted(SHAPES))})")
    fields = dict(SHAPES[name])
    if task != "classify":
        fields["num_labels"] = None
    return fields
