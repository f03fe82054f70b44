"""Benchmark workloads: the paper's model shapes with random weights, a word-level tokenizer, and a
synthetic labelled dataset — all written to disk once and read by every strategy alike.

Shapes (paper Table III): RoBERTa-Base (encoder, 12 blocks), GPT-2-Medium (decoder, 24 blocks),
MobileLLaMA-1.4B (decoder, 24 blocks); and TinyLlama-1.1B (decoder, 22 blocks, grouped-query attention:
32 query heads over 4 KV heads, so 4 attention units), the numbers of its public Hugging Face config
(TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T). `blocks` keeps fewer transformer blocks at
the full layer shape (hidden size, heads, MLP width, vocabulary) so a run fits this machine; every
table states it, and `realistic_blocks` is the grid's depth rule. Dropout is 0 so that every
strategy computes the same function (no random streams to align).

`kind_parameters` splits a shape's parameters by segment kind (attention units, MLP columns,
vocabulary rows, replicated), which the memory scale (`kept_fraction`) and the measured ideal's
optimizer model (`bench/results.py`) use.
"""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

SHAPES: dict[str, dict] = {
    "roberta-base": dict(
        model_type="roberta", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
        intermediate_size=3072, vocab_size=50265, max_position_embeddings=514, type_vocab_size=1,
        layer_norm_eps=1e-5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0, pad_token_id=0),
    "gpt2-medium": dict(
        model_type="gpt2", n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, n_positions=1024,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0, pad_token_id=0),
    "mobilellama-1.4b": dict(
        model_type="llama", hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=16, intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_dropout=0.0, pad_token_id=0),
    "tinyllama-1.1b": dict(
        model_type="llama", hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, attention_dropout=0.0,
        pad_token_id=0),
    # The small open models fine-tuned on a few boxes today (issue 17, the LoRA cell), the published
    # configs (Qwen/Qwen2.5-0.5B, Qwen/Qwen2.5-1.5B, meta-llama/Llama-3.2-1B, HuggingFaceTB/SmolLM2-360M) as
    # node/models/shapes.py holds them (tests/bench/test_workloads.py checks they agree).
    "qwen2.5-0.5b": dict(
        model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_dropout=0.0,
        pad_token_id=0),
    "qwen2.5-1.5b": dict(
        model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, max_position_embeddings=131072,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_dropout=0.0,
        pad_token_id=0),
    "llama-3.2-1b": dict(
        model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, attention_dropout=0.0,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192), pad_token_id=0),
    "smollm2-360m": dict(
        model_type="llama", hidden_size=960, num_hidden_layers=32, num_attention_heads=15,
        num_key_value_heads=5, intermediate_size=2560, vocab_size=49152, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, attention_dropout=0.0,
        pad_token_id=0),
}
PAPER_BLOCKS = {"roberta-base": 12, "gpt2-medium": 24, "mobilellama-1.4b": 24, "tinyllama-1.1b": 22,
                "qwen2.5-0.5b": 24, "qwen2.5-1.5b": 28, "llama-3.2-1b": 16, "smollm2-360m": 32}
MIN_BLOCKS = 6  # the grid's depth rule: at least this many blocks, or a quarter of the model
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def get_shape(name: str) -> dict:
    try:
        return dict(SHAPES[name])
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(SHAPES)}") from None


def layers_key(config: dict) -> str:
    return "n_layer" if config["model_type"] == "gpt2" else "num_hidden_layers"


def shape_config(name: str, blocks: int | None) -> dict:
    """The config dict of `name` with `blocks` transformer blocks (None = the paper's count)."""
    cfg = get_shape(name)
    full = cfg[layers_key(cfg)]
    if blocks is not None:
        if isinstance(blocks, bool) or not isinstance(blocks, int) or not 1 <= blocks <= full:
            raise ValueError(f"--blocks must be an integer in [1, {full}] for {name}, got {blocks!r}")
        cfg[layers_key(cfg)] = blocks
    return cfg


def realistic_blocks(name: str) -> int:
    """The grid's depth: at least `MIN_BLOCKS` transformer blocks or a quarter of the model,
    whichever is more (never more than the model has). One block lets the vocabulary dominate and
    leaves a pipeline nothing to pipeline."""
    full = get_shape(name)[layers_key(get_shape(name))]
    return min(full, max(MIN_BLOCKS, math.ceil(full / 4)))


# Parameter names (as transformers' sequence-classification models spell them) by the segment kind
# that shards them; the rest (norms, positions, biases after a row-parallel layer, heads) is replicated.
_KIND_PATTERNS: dict[str, tuple[str, ...]] = {
    "vocab": (r"\.word_embeddings\.weight$", r"\.wte\.weight$", r"\.embed_tokens\.weight$"),
    "attn": (r"\.attention\.self\.", r"\.attention\.output\.dense\.weight$", r"\.attn\.c_attn\.",
             r"\.attn\.c_proj\.weight$", r"\.self_attn\.[qkvo]_proj\."),
    "mlp": (r"\.intermediate\.dense\.", r"\.layer\.\d+\.output\.dense\.weight$", r"\.mlp\.c_fc\.",
            r"\.mlp\.c_proj\.weight$", r"\.mlp\.(gate|up|down)_proj\."),
}


def kind_parameters(config: dict, num_labels: int = 2) -> dict[str, int]:
    """Parameters of the classification model by segment kind: {"attn", "mlp", "vocab",
    "replicated"} (they sum to the model's parameter count; counted on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    cfg = AutoConfig.for_model(config["model_type"], num_labels=num_labels,
                               **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(cfg)
    out = dict.fromkeys(("attn", "mlp", "vocab", "replicated"), 0)
    for name, p in model.named_parameters():
        kind = next((k for k, pats in _KIND_PATTERNS.items() if any(re.search(x, name) for x in pats)),
                    "replicated")
        out[kind] += p.numel()
    return out


def parameter_count(config: dict) -> int:
    return sum(kind_parameters(config).values())


def lora_parameters(config: dict, r: int, targets: tuple[str, ...], num_labels: int = 2) -> tuple[int, int]:
    """(frozen, trained) parameters of the classification model under LoRA of rank `r` on the
    modules named `targets` (peft's names) in its blocks: A [r, in] and B [out, r] per adapted
    layer (r x (in + out), whatever the weight's orientation: GPT-2's Conv1D too), plus the
    classification head, which is trained as peft's SEQ_CLS trains it; the rest is frozen."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from xronos.node.tp.lora import TRAINED_HEADS

    cfg = AutoConfig.for_model(config["model_type"], num_labels=num_labels,
                               **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(cfg)
    adapters = head = 0
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if name.rsplit(".", 1)[-1] in targets and w is not None and w.dim() == 2 and re.search(r"\.\d+\.", name):
            adapters += r * sum(w.shape)
        if name in TRAINED_HEADS:
            head += sum(p.numel() for p in m.parameters())
    total = sum(p.numel() for p in model.parameters())
    return total - head, adapters + head


def kept_fraction(name: str, blocks: int | None) -> float:
    """Parameters of the cell's model (`blocks` kept) / parameters of the full model: the scale of
    the emulated memory caps, so that a cell binds memory exactly when the full model would on the
    real devices (`Scenario.memory_caps`)."""
    return parameter_count(shape_config(name, blocks)) / parameter_count(shape_config(name, None))


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer over "w4 .. w{V-1}" (ids = the word number), pad id 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]", model_max_length=1 << 20)
    fast.save_pretrained(str(out_dir))


def write_checkpoint(out_dir: Path, config: dict, *, num_labels: int = 2, seed: int = 0) -> Path:
    """A random-weight sequence-classification checkpoint (safetensors) plus its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    cfg = AutoConfig.for_model(config["model_type"], num_labels=num_labels, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(cfg)
    model.save_pretrained(str(out_dir))
    write_tokenizer(out_dir, cfg.vocab_size)
    if not _tokenizes(out_dir, cfg.vocab_size):
        # transformers loads some families' tokenizers as their own class whatever the files say
        # (Qwen2's rebuilds a byte-level BPE: the word-level vocabulary tokenized "w5 w7" to nothing
        # and gained an <|endoftext|> past the embedding); a byte-level one it keeps.
        write_byte_tokenizer(out_dir)
    return out_dir


def _tokenizes(model_dir: Path, vocab_size: int) -> bool:
    """Whether the product's loader reads the directory's tokenizer as written: ids for a sample,
    every id within the embedding."""
    from xronos.node.data.batches import load_tokenizer

    tok = load_tokenizer(model_dir)
    return bool(tok("w5 w7")["input_ids"]) and len(tok) <= vocab_size


def write_byte_tokenizer(out_dir: Path) -> None:
    """A byte-level BPE without merges: every byte one token (ids < 261), EOS <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", eos_token="<|endoftext|>", model_max_length=1 << 20)
    fast.save_pretrained(str(out_dir))


def write_dataset(path: Path, rows: int, seq_len: int, vocab_size: int, *, seed: int = 0) -> Path:
    """JSONL of random word sequences that fill `seq_len` tokens, with random binary labels."""
    rng = random.Random(seed)
    words = max(1, seq_len)
    with open(path, "w") as f:
        for _ in range(rows):
            text = " ".join(f"w{rng.randrange(len(SPECIAL), vocab_size)}" for _ in range(words))
            f.write(json.dumps({"text": text, "label": rng.randrange(2)}) + "\n")
    return path
