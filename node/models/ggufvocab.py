"""The tokenizer of a GGUF export: byte-level BPE vocabularies as llama.cpp reads them.

llama.cpp re-implements each tokenizer it knows, chosen by `tokenizer.ggml.pre`: the regex that
splits text before BPE. convert_hf_to_gguf.py recognises a published tokenizer by hashing its
output on a test text; a fine-tuned copy of a published model has the same tokenizer, but a
tokenizer made for a small test model would hash to nothing. So the pre-tokenizer is recognised
here from tokenizer.json itself: its Split regex (or GPT-2's built-in one) against the ones
llama.cpp implements. A tokenizer this does not recognise is refused before training
(`tokenizer_refusal`), never exported to a file that llama.cpp would tokenize differently.

Token list and types as convert_hf_to_gguf's get_vocab_base: ids past the tokenizer up to the
model's vocab_size are `[PAD<id>]` (unused), added special tokens are control tokens, other added
tokens user-defined; merges, special token ids and the chat template through gguf's SpecialVocab.
Whether BOS/EOS are added is read from what the tokenizer does on a probe text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# tokenizer.json Split regex -> llama.cpp pre-tokenizer name (llama-vocab.cpp).
SPLIT_REGEXES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",  # Llama 3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",  # Qwen2, 2.5, 3
}
GPT2_PRE = "gpt-2"  # ByteLevel with its own regex: GPT-2's
SMOLLM_PRE = "smollm"  # single digits first, then GPT-2's (SmolLM, SmolLM2)
MAX_TOKENIZER_BYTES = 64 << 20
PROBE = "probe"


def _read_tokenizer_json(model_dir: Path) -> dict[str, Any] | str:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return (f"export_gguf: {model_dir} has no tokenizer.json (a fast tokenizer); the GGUF file's "
                "vocabulary is made from it")
    if path.stat().st_size > MAX_TOKENIZER_BYTES:
        return f"export_gguf: {path} is over {MAX_TOKENIZER_BYTES >> 20} MiB"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        return f"export_gguf: {path} is not valid JSON: {exc}"
    return data if isinstance(data, dict) else f"export_gguf: {path} is not a JSON object"


def pre_tokenizer_name(tok: dict[str, Any]) -> str | None:
    """llama.cpp's name for this byte-level BPE tokenizer's pre-tokenizer, or None."""
    pre = tok.get("pre_tokenizer") or {}
    if not isinstance(pre, dict):
        return None
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
        return None
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    splits = [s for s in steps if s.get("type") == "Split"]
    if len(steps) == 2 and steps[0].get("type") == "Digits" and steps[0].get("individual_digits") \
            and byte_level == steps[1:] and byte_level[0].get("use_regex", True) \
            and not byte_level[0].get("add_prefix_space"):
        return SMOLLM_PRE
    if len(byte_level) != 1 or len(steps) != len(byte_level) + len(splits) or byte_level[0].get("add_prefix_space"):
        return None
    if not splits:
        return GPT2_PRE if byte_level[0].get("use_regex", True) else None
    if len(splits) != 1 or byte_level[0].get("use_regex", True) or splits[0].get("invert") \
            or splits[0].get("behavior") != "Isolated":
        return None
    return SPLIT_REGEXES.get((splits[0].get("pattern") or {}).get("Regex"))


def tokenizer_refusal(model_dir: Path) -> str | None:
    """Why this directory's tokenizer cannot go into a GGUF file (None: it can)."""
    tok = _read_tokenizer_json(model_dir)
    if isinstance(tok, str):
        return tok
    model = tok.get("model") if isinstance(tok.get("model"), dict) else {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        return (f"export_gguf: the tokenizer in {model_dir} is a {model.get('type')} "
                f"{'(SentencePiece-style, byte fallback) ' if model.get('byte_fallback') else ''}model; "
                "GGUF export carries byte-level BPE tokenizers (GPT-2's, SmolLM's, Llama 3's, Qwen's)")
    if pre_tokenizer_name(tok) is None:
        return (f"export_gguf: the tokenizer in {model_dir} splits text with a pre-tokenizer llama.cpp is not "
                "known to share (known: GPT-2's byte-level regex, SmolLM's digits and GPT-2's, Llama 3's and "
                "Qwen2's Split regexes); "
                "its GGUF file would tokenize differently")
    return None


def _token_types(tok: dict[str, Any], vocab_size: int) -> tuple[list[str], list[int]]:
    import gguf
    from tokenizers import Tokenizer

    T = gguf.TokenType
    reverse = {i: t for t, i in Tokenizer.from_str(json.dumps(tok)).get_vocab(with_added_tokens=True).items()}
    added = {a["id"]: a for a in tok.get("added_tokens") or []}
    if reverse and max(reverse) >= vocab_size:
        raise ValueError(f"export_gguf: the tokenizer has id {max(reverse)}, past the model's vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(T.UNUSED)
        elif i in added:
            tokens.append(reverse[i])
            types.append(T.CONTROL if added[i].get("special") else T.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(T.NORMAL)
    return tokens, types


def add_vocab(w: Any, model_dir: Path, vocab_size: int, family: str) -> None:
    """The tokenizer's metadata into GGUFWriter `w`: model, pre-tokenizer, tokens, types, merges,
    special ids, add-BOS/EOS, chat template."""
    import gguf
    from tokenizers import Tokenizer

    problem = tokenizer_refusal(model_dir)
    if problem:
        raise ValueError(problem)
    tok = _read_tokenizer_json(model_dir)
    assert isinstance(tok, dict)
    tokens, types = _token_types(tok, vocab_size)
    w.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    w.add_tokenizer_pre(pre_tokenizer_name(tok))
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)
    ids = Tokenizer.from_str(json.dumps(tok)).encode(PROBE, add_special_tokens=True).ids
    plain = Tokenizer.from_str(json.dumps(tok)).encode(PROBE, add_special_tokens=False).ids
    bos, eos = special.special_token_ids.get("bos"), special.special_token_ids.get("eos")
    add_bos = len(ids) > len(plain) and bos is not None and ids[0] == bos
    add_eos = len(ids) > len(plain) and eos is not None and ids[-1] == eos
    special.add_special_token = {"bos": add_bos, "eos": add_eos}
    special.add_to_gguf(w, quiet=True)
