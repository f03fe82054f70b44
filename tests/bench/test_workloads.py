"""The benchmark's checkpoints and `xronos profile --arch` describe the same models (the paper's and the LoRA cell's).

The bench keeps its own config dicts (dropout 0 so every strategy computes one function, its own
pad id and tokenizer); the layer shapes must still be the ones `node/models/shapes.py` names."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from xronos.bench.workloads import PAPER_BLOCKS, SHAPES, shape_config
from xronos.node.models.registry import arch_spec
from xronos.node.models.shapes import shape

# The position table is the checkpoint's own business (RoBERTa offsets positions by its pad id), and
# the bench only classifies, where no LM head exists to tie to the embedding.
_FREE = {"max_positions", "tie_word_embeddings"}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_bench_shape_matches_the_built_in_shape(name: str) -> None:
    cfg = shape_config(name, None)
    # The config.json the bench's checkpoint gets (write_checkpoint saves a SequenceClassification model).
    written = AutoConfig.for_model(**cfg).to_dict()
    written["architectures"] = [{"gpt2": "GPT2", "roberta": "Roberta", "llama": "Llama", "qwen2": "Qwen2"}[cfg["model_type"]]
                                + "ForSequenceClassification"]
    ours = arch_spec(written, "classify")
    built_in = shape(name, "classify")
    assert {k: v for k, v in ours.items() if k not in _FREE} == {k: v for k, v in built_in.items() if k not in _FREE}
    assert ours["num_layers"] == PAPER_BLOCKS[name]


def test_a_bench_checkpoint_tokenizes_as_the_product_loads_it_for_every_family(tmp_path):
    """transformers loads a qwen2 checkpoint's tokenizer as Qwen2's own class whatever the files
    say, which turned the bench's word-level vocabulary into no ids at all (and one past the
    embedding): such a checkpoint gets a byte-level tokenizer instead."""
    from xronos.bench.workloads import write_checkpoint
    from xronos.node.data.batches import check_vocabulary, load_tokenizer

    tiny = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
    for model_type in ("qwen2", "llama"):
        d = write_checkpoint(tmp_path / model_type, dict(tiny, model_type=model_type))
        tok = load_tokenizer(d)
        assert tok("w5 w7 w300")["input_ids"], model_type
        check_vocabulary(tok, json.loads((d / "config.json").read_text()), d)
