"""GGUF export of a fine-tuned causal LM, for llama.cpp and Ollama (`export_gguf`: f32, f16, q8_0).

The file is written with the `gguf` library (llama.cpp's own gguf-py): its GGUFWriter, its tensor
name maps (`TensorNameMap`: Hugging Face name -> GGUF name per architecture) and its quants module
for Q8_0. What each family needs follows llama.cpp's convert_hf_to_gguf.py:

- LLaMA: llama.cpp's `llama` graph rotates adjacent pairs, Hugging Face rotates halves, so the rows
  of q_proj and k_proj are permuted per head (`_permute`; k with the KV heads under GQA). Llama 3's
  scaled RoPE becomes a `rope_freqs` tensor of per-frequency factors, linear scaling a factor.
- Qwen2/2.5 (q/k/v biases) and Qwen3 (q/k RMS norms, a head_dim of its own): llama.cpp rotates
  halves there too, so the weights go as they are; key/value lengths are written when head_dim is
  not hidden / heads.
- GPT-2: Conv1D weights are [in, out] and are transposed; the LM head is the token embedding.
- A tied LM head is written once, as the token embedding (llama.cpp falls back to it).

Tensor types as convert_hf_to_gguf: 1-D tensors (norms, biases), norms and GPT-2's position
embedding stay f32; with q8_0 a matrix whose rows are not a multiple of Q8_0's 32-value block is
written f16. The tokenizer, special tokens and chat template come from `ggufvocab`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .exportfiles import gguf_file_name

GGUF_TYPES = ("f32", "f16", "q8_0")
# Xronos family name -> llama.cpp architecture (the families llama.cpp runs as language models).
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2"}
GPT2_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
ROPE_TYPES = ("default", "linear", "llama3")  # Hugging Face rope_type values this export carries


def gguf_refusal(config: dict[str, Any], task: str) -> str | None:
    """Why a GGUF export of this model and task cannot be made (None: it can). Pure: the family
    from config.json's architectures, the task, and the RoPE scaling."""
    from .registry import family_for

    family = family_for(config).name
    archs = ", ".join(map(str, config.get("architectures") or []))
    if family not in GGUF_ARCHS:
        return (f"export_gguf: the {family} family ({archs}) is not a language model llama.cpp runs; "
                f"GGUF export is for causal LMs of the {', '.join(GGUF_ARCHS)} families")
    if task != "causal-lm":
        return (f"export_gguf: task {task!r} of the {family} family makes a classifier, which llama.cpp "
                "does not run; GGUF export is for task 'causal-lm'")
    rope = _rope(config)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in ROPE_TYPES:
        return f"export_gguf: rope_type {kind!r} of this {family} model is not exported (exported: {', '.join(ROPE_TYPES)})"
    return None


def check_gguf(model_dir: str | Path, config: dict[str, Any], task: str) -> None:
    """ValueError naming the problem when `export_gguf` cannot be honoured for this checkpoint: the
    family and task (`gguf_refusal`) and its tokenizer (`ggufvocab.tokenizer_refusal`)."""
    from .ggufvocab import tokenizer_refusal

    problem = gguf_refusal(config, task) or tokenizer_refusal(Path(model_dir))
    if problem:
        raise ValueError(problem)


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 keeps RoPE under rope_parameters (theta included), 4.x under rope_scaling."""
    return dict(config.get("rope_parameters") or config.get("rope_scaling") or {})


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face's half-rotation row order -> llama.cpp's adjacent pairs, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(rope: dict[str, Any], head_dim: int, theta: float) -> np.ndarray:
    """Llama 3's per-frequency RoPE factors, as convert_hf_to_gguf writes them (`rope_freqs`)."""
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _hparams(w: Any, family: str, config: dict[str, Any]) -> None:
    import gguf

    if family == "gpt2":
        hidden = config["n_embd"]
        w.add_context_length(config.get("n_ctx") or config["n_positions"])
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(config.get("n_inner") or 4 * hidden)
        w.add_block_count(config["n_layer"])
        w.add_head_count(config["n_head"])
        w.add_layer_norm_eps(config.get("layer_norm_epsilon", 1e-5))
        return
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    rope = _rope(config)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(config.get("num_key_value_heads") or heads)
    w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    w.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    w.add_rope_dimension_count(head_dim)
    if head_dim != hidden // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if family == "llama":
        w.add_vocab_size(config["vocab_size"])
    if (rope.get("rope_type") or rope.get("type")) == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))


def _tensors(family: str, config: dict[str, Any], state: Mapping[str, Any]):
    """(GGUF name, float32 array) of every tensor llama.cpp reads, in the state's order."""
    import gguf
    import torch

    arch = gguf.MODEL_ARCH[GGUF_ARCHS[family].upper()]
    n_layer = config["n_layer"] if family == "gpt2" else config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch, n_layer)
    heads = config.get("num_attention_heads") or config.get("n_head")
    kv_heads = config.get("num_key_value_heads") or heads
    for hf_name, t in state.items():
        if family == "gpt2" and hf_name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # the causal mask buffers of old checkpoints
        if family == "gpt2" and hf_name == "lm_head.weight":
            continue  # tied to wte: llama.cpp reads the embedding
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"export_gguf: no GGUF name for tensor {hf_name} of the {family} family")
        data = t.detach().to(torch.float32).cpu().numpy()
        if family == "gpt2" and hf_name.endswith(GPT2_CONV1D):
            data = np.ascontiguousarray(data.T)
        elif family == "llama" and hf_name.endswith("self_attn.q_proj.weight"):
            data = _permute(data, heads)
        elif family == "llama" and hf_name.endswith("self_attn.k_proj.weight"):
            data = _permute(data, kv_heads)
        yield name, data
    rope = _rope(config)
    if family == "llama" and (rope.get("rope_type") or rope.get("type")) == "llama3":
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", _llama3_rope_factors(rope, head_dim, theta)


def _encode(name: str, data: np.ndarray, out_type: str):
    """(array, raw dtype) as written: f32 for 1-D tensors, norms and position embeddings."""
    import gguf

    Q = gguf.GGMLQuantizationType
    keep_f32 = data.ndim <= 1 or name.endswith("_norm.weight") or name.startswith("position_embd") \
        or name.startswith("rope_freqs")
    if out_type == "f32" or keep_f32:
        return data.astype(np.float32), Q.F32
    if out_type == "q8_0" and data.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] == 0:
        return gguf.quants.quantize(data, Q.Q8_0), Q.Q8_0
    return data.astype(np.float16), Q.F16


def write_gguf(path: str | Path, config: dict[str, Any], state: Mapping[str, Any], tokenizer_dir: str | Path,
               out_type: str, name: str = "model") -> Path:
    """Write `state` (full Hugging Face-named tensors of a causal LM of a GGUF_ARCHS family) and the
    tokenizer of `tokenizer_dir` to the GGUF file `path`."""
    import gguf

    from .ggufvocab import add_vocab
    from .registry import family_for

    if out_type not in GGUF_TYPES:
        raise ValueError(f"export_gguf: {out_type!r} is not one of {', '.join(GGUF_TYPES)}")
    problem = gguf_refusal(config, "causal-lm")
    if problem:
        raise ValueError(problem)
    family = family_for(config).name
    # Tensors go to a spooled temp file as they come: the owner holds no second copy of the model.
    w = gguf.GGUFWriter(str(path), GGUF_ARCHS[family], use_temp_file=True)
    w.add_name(name)
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[out_type])
    _hparams(w, family, config)
    vocab_size = config["vocab_size"]
    add_vocab(w, Path(tokenizer_dir), vocab_size, family)
    for gguf_name, data in _tensors(family, config, state):
        encoded, raw = _encode(gguf_name, data, out_type)
        w.add_tensor(gguf_name, encoded, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def save_gguf_export(out_dir: str | Path, config: dict[str, Any], state: Mapping[str, Any], model_dir: str | Path,
                     out_type: str, lora: Any = None) -> Path:
    """`<out_dir>/model-<type>.gguf` and `<out_dir>/Modelfile` (Ollama) from a consolidated state:
    a full fine-tune's weights, or under LoRA (`lora`: its LoraSettings) the base with the adapters
    merged. The tokenizer and chat template are the base checkpoint's (`model_dir`), as the
    Hugging Face export copies them. Written through `staged`, as every export file."""
    from .adapters import merged_state
    from .modelfile import write_modelfile
    from .registry import family_for
    from .stage import staged

    out = Path(out_dir)
    full = merged_state(state, config, lora) if lora is not None else state
    name = gguf_file_name(out_type)
    with staged(out) as stage:
        write_gguf(stage / name, config, full, model_dir, out_type, name=Path(model_dir).name)
        write_modelfile(stage / "Modelfile", name, model_dir, family_for(config).max_positions(config))
    return out / name
