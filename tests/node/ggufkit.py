"""Test kit for the GGUF export: tiny chat models whose tokenizers llama.cpp can run, and the
comparison of llama.cpp's logits with transformers'.

llama.cpp re-implements byte-level BPE, so these tokenizers are real ones: a BPE trained here
offline (the `tokenizers` library, a few hundred tokens over runkit's words) behind the same
pre-tokenizer as the published family's (Llama 3's and Qwen2's Split regexes, GPT-2's byte-level
regex), with the family's special tokens and chat template. The models are a few hundred KiB,
their widths multiples of 32 so that Q8_0 (32-value blocks) quantises every matrix.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import runkit

LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# Meta's Llama 3 Instruct template (BOS on the first message, contents trimmed).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Qwen2.5 Instruct's template without its tool-calling branches: ChatML with a default system prompt.
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\n' }}{%- endif %}{%- for message in messages %}{%- if (message.role == 'user') or "
    "(message.role == 'system' and not loop.first) or (message.role == 'assistant') %}{{- '<|im_start|>' + "
    "message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")

SPECIALS = {
    "llama": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "qwen3": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "gpt2": ["<|endoftext|>"],
    "smollm": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],  # SmolLM2: a LLaMA with GPT-2-like BPE
}
PROMPTS = ["the cat sat on the mat", "a big red dog ran under the old tree", "quiet river stone light",
           "happy bird fish sky sea", "the small blue box is cold and dark"]
# Their beginnings: the next word is one the models learnt (`_memorise`), predicted with a margin.
NEXT = [" ".join(p.split()[:-1]) for p in PROMPTS]


def corpus() -> list[str]:
    words = runkit.WORDS + ["system", "user", "assistant", "You", "are", "Qwen", "created", "by", "Alibaba",
                            "Cloud", "helpful", "words", "here"]
    return runkit.texts(300, 7) + [" ".join(words), "\n".join(words)]


def make_bpe_tokenizer(out: Path, family: str, chat: bool = True):
    """A trained byte-level BPE with the family's pre-tokenizer, special tokens and chat template,
    saved in `out` as transformers saves it. Returns the transformers tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIALS[family]
    tk = Tokenizer(models.BPE())
    if family == "gpt2":
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif family == "smollm":
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        split = LLAMA3_SPLIT if family == "llama" else QWEN2_SPLIT
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(corpus(), trainer)
    kw: dict = {}
    if family == "llama":
        tk.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
            special_tokens=[("<|begin_of_text|>", 0)])
        kw = dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>" if chat else "<|end_of_text|>",
                  chat_template=LLAMA3_TEMPLATE if chat else None)
    elif family in ("qwen2", "qwen3", "smollm"):
        kw = dict(eos_token="<|im_end|>" if chat else "<|endoftext|>", pad_token="<|endoftext|>",
                  chat_template=(QWEN25_TEMPLATE if family == "qwen2" else runkit.CHAT_TEMPLATE) if chat else None)
    else:
        kw = dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, **{k: v for k, v in kw.items() if v is not None})
    tok.save_pretrained(str(out))
    return tok


def make_chat_model(out: Path, family: str, chat: bool = True, seed: int = 0, gqa: bool = True,
                    pretrain: bool = True) -> Path:
    """A tiny random causal LM of `family` (hidden 64, 2 blocks, MLP 128; 4 heads, 2 KV heads with
    `gqa`; Qwen3 with head_dim 32 != 64 / 4; "smollm": a LLaMA with tied embeddings and SmolLM2's
    tokenizer) with `make_bpe_tokenizer`'s tokenizer, in `out`.
    The vocabulary is padded to a multiple of 32 with rows no token uses, as published models do."""
    import transformers as tf

    out.mkdir(parents=True, exist_ok=True)
    tok = make_bpe_tokenizer(out, family, chat)
    V = -(-len(tok) // 32) * 32
    kv = 2 if gqa else 4
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    common = dict(vocab_size=V, initializer_range=0.1, **{k: v for k, v in ids.items() if v is not None})
    if family == "gpt2":
        cfg = tf.GPT2Config(n_positions=128, n_embd=64, n_layer=2, n_head=4, n_inner=128, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, **common)
    elif family in ("llama", "smollm"):  # SmolLM2 ties its embeddings
        cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=kv, max_position_embeddings=128,
                             tie_word_embeddings=family == "smollm",
                             rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, **common)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=kv, max_position_embeddings=128, tie_word_embeddings=True, **common)
    else:
        cfg = tf.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=kv, head_dim=32, max_position_embeddings=128,
                             tie_word_embeddings=True, **common)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    if family == "qwen2":  # Qwen2's q/k/v biases start at zero: give them values the export must carry
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    if pretrain:
        _memorise(model, tok)
    model.save_pretrained(str(out))
    return out


def _memorise(model, tok, steps: int = 40) -> None:
    """A few AdamW steps on PROMPTS, so that the model predicts their words with a clear margin as
    a trained model does (a random one's next-token logits are nearly tied, and any rounding, Q8_0's
    included, flips their order)."""
    batch = tok(PROMPTS, padding=True, return_tensors="pt") if tok.pad_token else None
    if batch is None:
        tok.pad_token = tok.eos_token
        batch = tok(PROMPTS, padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        model(**batch, labels=labels).loss.backward()
        opt.step()
    model.eval()


def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    """transformers' logits [S, V] (float32) for the token ids."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def llama_cpp(gguf_path: Path):
    """llama.cpp's model (llama-cpp-python), every position's logits kept. Its KV cache in f32
    (llama.cpp's default is f16, which alone moves these logits by ~5e-4 of their scale)."""
    from llama_cpp import GGML_TYPE_F32, Llama

    return Llama(model_path=str(gguf_path), n_ctx=128, logits_all=True, n_threads=1, verbose=False, seed=0,
                 type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, flash_attn=False)


def llama_logits(llm, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits [S, V] for the token ids."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)
