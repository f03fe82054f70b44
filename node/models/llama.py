"""The LLaMA-style decoders, tensor-parallel, pre-RMSNorm: LLaMA (Llama 2/3.x, TinyLlama, SmolLM2,
MobileLLaMA), Qwen2/Qwen2.5 and Qwen3 — one module, the differences are config-driven switches
(`Variant`): Qwen2 always biases q/k/v and never o_proj; Qwen3 normalises every query and key head
with an RMSNorm over head_dim before RoPE and defaults head_dim to 128; only LLaMA honours mlp_bias.
Causal LM and sequence classification for each (`*ForCausalLM`, `*ForSequenceClassification`).

Grouped-query attention: an attention unit u = KV head u together with the n_rep = heads / kv_heads
query heads that read it, so there are num_key_value_heads of them; MLP columns of gate_proj/up_proj
(rows of down_proj) and vocabulary rows are cut on their own ranges (`layout.range(kind)`).
Module names mirror transformers', so local parameter names are the HF names.

RoPE: types default, linear, dynamic and llama3, with inverse frequencies computed by the same
expressions as `transformers.modeling_rope_utils` (bit-identical; `RoPE`). cos/sin are computed per
forward (no buffers: the model is built on the meta device and materialized with `to_empty`).

Qwen3's q/k norm weights are replicated (one [head_dim] vector shared by every head) but used on
this rank's heads only, so each rank's gradient of them is a partial sum over its heads: they enter
the attention region together with its input (`copy_to_tp_with`), whose backward all-reduces their
gradient in the same all-reduce as the input's (no extra collective) — every rank then holds the
full gradient, bit-identical, as a replicated parameter must (clipping counts replicated gradients
once; transformers' own TP plan calls this "replicated_with_grad_allreduce").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from xronos.node.tp.group import TPGroup
from xronos.node.tp.layers import (ColumnParallelLinear, InRegion, RowParallelLinear, Split,
                                   VocabParallelEmbedding)
from xronos.node.tp.layout import ShardLayout
from xronos.node.tp.lora import enter_region
from xronos.node.tp.overlap import Stage

from .common import (Dropout, chunked, DropoutStreams, Family, Head, TPModel, attend, attention_mask_bool, cfg_get,
                     cfg_require, gelu_fn, init_std, last_token_pool, lm_head_logits, num_labels)


@dataclass(frozen=True)
class Variant:
    """What tells the LLaMA-style decoders apart; everything else is shared."""

    family: str  # Xronos' family name (ArchSpec.family)
    model_type: str  # config.json's model_type
    prefix: str  # transformers' class prefix: LlamaForCausalLM, Qwen2ForCausalLM, ...
    qkv_bias: bool  # q/k/v always biased, o_proj never (Qwen2), whatever attention_bias says
    qk_norm: bool  # per-head RMSNorm of queries and keys before RoPE (Qwen3)
    mlp_bias: bool  # config's mlp_bias is honoured (LLaMA; the Qwen MLPs have no biases)
    head_dim: int | None  # head_dim when config.json lacks it (None: hidden // heads; Qwen3Config: 128)
    sliding: bool  # the config may ask for sliding-window layers (Qwen), which are refused

    @property
    def architectures(self) -> tuple[str, ...]:
        return tuple(self.prefix + s for s in ("ForCausalLM", "Model", "ForSequenceClassification"))

    @property
    def hf_classes(self) -> dict[str, str]:
        return {"causal-lm": self.prefix + "ForCausalLM", "classify": self.prefix + "ForSequenceClassification"}


LLAMA = Variant("llama", "llama", "Llama", qkv_bias=False, qk_norm=False, mlp_bias=True, head_dim=None,
                sliding=False)
QWEN2 = Variant("qwen2", "qwen2", "Qwen2", qkv_bias=True, qk_norm=False, mlp_bias=False, head_dim=None,
                sliding=True)
QWEN3 = Variant("qwen3", "qwen3", "Qwen3", qkv_bias=False, qk_norm=True, mlp_bias=False, head_dim=128,
                sliding=True)

ROPE_TYPES = ("default", "dynamic", "linear", "llama3")


def _number(params: dict[str, Any], key: str, kind: str) -> float | int:
    v = params.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"RoPE type {kind!r} needs a positive number {key!r} in rope_scaling / "
                         f"rope_parameters, got {v!r}")
    return v


@dataclass(frozen=True)
class RoPE:
    """Rotary embedding of one config: its type and the numbers its inverse frequencies need.

    Every expression below is transformers' own (`modeling_rope_utils`, `LlamaRotaryEmbedding`),
    with the same operand types, so the frequencies are bit-identical, not just close.
    """

    kind: str  # one of ROPE_TYPES
    theta: float | int
    dim: int  # head_dim: every channel rotates (partial_rotary_factor 1)
    max_positions: int  # max_position_embeddings (dynamic rescales beyond it)
    factor: float | int = 1
    low_freq_factor: float | int = 1
    high_freq_factor: float | int = 4
    original_max_positions: int = 0  # llama3's pre-training context

    @classmethod
    def from_config(cls, c: dict[str, Any], head_dim: int, max_positions: int) -> RoPE:
        # transformers: rope_scaling (config.json of transformers 4.x) wins over rope_parameters (5.x);
        # the theta inside it over the top-level rope_theta; 10000 when neither is given.
        raw = c.get("rope_scaling") or c.get("rope_parameters") or {}
        if not isinstance(raw, dict):
            raise ValueError(f"rope_scaling / rope_parameters must be an object, got {raw!r:.80}")
        params = dict(raw)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ValueError(f"RoPE type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        if any(isinstance(v, dict) for v in params.values()):
            raise ValueError("per-layer-type RoPE parameters (nested rope_parameters) are not supported")
        partial = params.get("partial_rotary_factor", c.get("partial_rotary_factor"))
        if partial is not None and partial != 1:
            raise ValueError(f"partial_rotary_factor {partial!r} is not supported (only 1: every channel rotates)")
        theta = params.get("rope_theta", c.get("rope_theta", 10000.0))
        rope = dict(kind=kind, theta=_number({"rope_theta": theta}, "rope_theta", kind), dim=head_dim,
                    max_positions=max_positions)
        if head_dim % 2 or (kind == "dynamic" and head_dim <= 2):
            raise ValueError(f"head_dim {head_dim} does not suit RoPE type {kind!r} (needs an even head_dim"
                             + (" > 2)" if kind == "dynamic" else ")"))
        if kind != "default":
            rope["factor"] = _number(params, "factor", kind)
        if kind == "llama3":
            rope["low_freq_factor"] = _number(params, "low_freq_factor", kind)
            rope["high_freq_factor"] = _number(params, "high_freq_factor", kind)
            if rope["high_freq_factor"] == rope["low_freq_factor"]:
                raise ValueError("RoPE type 'llama3' needs high_freq_factor != low_freq_factor")
            # A top-level original_max_position_embeddings wins (transformers' standardize_rope_params).
            top = c.get("original_max_position_embeddings")
            orig = top if top is not None else params.get("original_max_position_embeddings", max_positions)
            key = "original_max_position_embeddings"
            rope["original_max_positions"] = _number({key: orig}, key, kind)
        return cls(**rope)

    def inv_freq(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """[dim/2] inverse frequencies for a forward over positions 0..seq_len-1."""
        base, dim = self.theta, self.dim
        if self.kind == "default":  # LlamaRotaryEmbedding.compute_default_rope_parameters
            return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
        if self.kind == "linear":  # _compute_linear_scaling_rope_parameters
            inv_freq = 1.0 / (base ** exponents)
            inv_freq /= self.factor
            return inv_freq
        if self.kind == "dynamic":
            # _compute_dynamic_ntk_parameters as LlamaRotaryEmbedding uses it: at init (seq_len =
            # max_position_embeddings, Python floats) for a forward within max_position_embeddings, and
            # recomputed by dynamic_rope_update from the forward's seq_len (a 0-dim int64 tensor, so
            # the base is computed in float32 tensors) beyond it.
            factor, n = self.factor, self.max_positions
            if seq_len > n:
                s = torch.maximum(torch.tensor(seq_len, dtype=torch.int64, device=device),
                                  torch.tensor(n, dtype=torch.int64, device=device))
            else:
                s = n
            base = base * ((factor * s / n) - (factor - 1)) ** (dim / (dim - 2))
            return 1.0 / (base ** exponents)
        # llama3: _compute_llama3_parameters
        inv_freq = 1.0 / (base ** exponents)
        factor, low, high = self.factor, self.low_freq_factor, self.high_freq_factor
        old_context_len = self.original_max_positions
        low_freq_wavelen = old_context_len / low
        high_freq_wavelen = old_context_len / high
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low) / (high - low)
        smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)

    def cos_sin(self, S: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [S, dim] for positions 0..S-1 (attention_scaling is 1 for all four types)."""
        freqs = torch.arange(S, device=device).float()[:, None] * self.inv_freq(S, device)  # [S, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [S, dim]
        return emb.cos(), emb.sin()


class LlamaDims:
    def __init__(self, c: dict[str, Any], dropout: float | None, variant: Variant = LLAMA) -> None:
        self.variant = v = variant
        self.hidden = int(cfg_require(c, "hidden_size"))
        self.n_layer = int(cfg_require(c, "num_hidden_layers"))
        self.n_head = int(cfg_require(c, "num_attention_heads"))
        self.n_kv = int(cfg_get(c, "num_key_value_heads", default=self.n_head))
        self.inter = int(cfg_require(c, "intermediate_size"))
        self.vocab = int(cfg_require(c, "vocab_size"))
        self.n_pos = int(cfg_require(c, "max_position_embeddings"))
        self.head_dim = int(cfg_get(c, "head_dim", default=v.head_dim or self.hidden // self.n_head))
        self.eps = float(cfg_get(c, "rms_norm_eps", default=1e-6))
        self.act = gelu_fn(cfg_get(c, "hidden_act", default="silu"))
        attention_bias = bool(cfg_get(c, "attention_bias", default=False))
        self.qkv_bias = True if v.qkv_bias else attention_bias
        self.o_bias = False if v.qkv_bias else attention_bias
        self.mlp_bias = v.mlp_bias and bool(cfg_get(c, "mlp_bias", default=False))
        self.qk_norm = v.qk_norm
        self.tied = bool(cfg_get(c, "tie_word_embeddings", default=False))
        self.rope = RoPE.from_config(c, self.head_dim, self.n_pos)
        self.pad = c.get("pad_token_id")
        self.attn_p = float(dropout if dropout is not None else cfg_get(c, "attention_dropout", default=0.0))
        if v.sliding:
            types = c.get("layer_types") or []
            if c.get("use_sliding_window") or any(t != "full_attention" for t in types):
                raise ValueError("sliding-window attention (use_sliding_window / layer_types "
                                 "'sliding_attention') is not supported; only full attention is")
        if self.n_head % self.n_kv:
            raise ValueError(f"num_attention_heads {self.n_head} is not a multiple of "
                             f"num_key_value_heads {self.n_kv}")
        self.n_rep = self.n_head // self.n_kv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., dim], statistics in fp32 like HF; weight [dim]."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        return rms_norm(x, self.weight, self.eps)


class HeadRMSNorm(RMSNorm, InRegion):
    """Qwen3's q_norm / k_norm: a replicated [head_dim] weight applied to every local head inside
    the attention region (its gradient is all-reduced with the region's input; see the module
    docstring). Its weight is read by the attention, not through forward()."""


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2  # x [B, h, S, hd]
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, d: LlamaDims, layout: ShardLayout, group: TPGroup, streams: DropoutStreams) -> None:
        super().__init__()
        units = layout.range("attn")  # KV heads, each with its n_rep query heads
        self.group, self.d, self.n_kv = group, d, units[1] - units[0]
        self.n_q = self.n_kv * d.n_rep
        q = Split.of(units, d.n_kv, unit=d.n_rep * d.head_dim)  # rows of q_proj [heads * hd, hidden]
        kv = Split.of(units, d.n_kv, unit=d.head_dim)  # rows of k_proj, v_proj [kv_heads * hd, hidden]
        self.q_proj = ColumnParallelLinear(d.hidden, q, bias=d.qkv_bias)
        self.k_proj = ColumnParallelLinear(d.hidden, kv, bias=d.qkv_bias)
        self.v_proj = ColumnParallelLinear(d.hidden, kv, bias=d.qkv_bias)
        self.o_proj = RowParallelLinear(q, d.hidden, group, bias=d.o_bias, kind="attn")
        if d.qk_norm:
            self.q_norm = HeadRMSNorm(d.head_dim, d.eps)
            self.k_norm = HeadRMSNorm(d.head_dim, d.eps)
        self.attn_dropout = Dropout(d.attn_p, streams, partitioned=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.mix(x, mask, cos, sin))  # [B, S, hidden]

    def mix(self, x: torch.Tensor, mask: torch.Tensor | None, cos: torch.Tensor,
            sin: torch.Tensor) -> torch.Tensor:
        """The attention of this rank's heads: o_proj's input [B, S, n_q*hd]."""
        B, S, _ = x.shape  # [B, S, hidden], replicated
        hd = self.d.head_dim
        # The q/k norm weights [2 hd] (Qwen3) and the LoRA A's of adapted q/k/v enter with x: their
        # partial gradients (this rank's heads) are summed over ranks in x's backward all-reduce.
        norms = torch.cat((self.q_norm.weight, self.k_norm.weight)) if self.d.qk_norm else None
        x, w, (aq, ak, av) = enter_region(x, self.group, "attn", (self.q_proj, self.k_proj, self.v_proj), norms)
        q = self.q_proj(x, aq).view(B, S, self.n_q, hd)  # [B, S, n_rep*kv, hd]
        k = self.k_proj(x, ak).view(B, S, self.n_kv, hd)  # [B, S, kv, hd]
        v = self.v_proj(x, av).view(B, S, self.n_kv, hd).transpose(1, 2)  # [B, kv, S, hd]
        if self.d.qk_norm:  # Qwen3: RMSNorm over head_dim of each head, before RoPE
            q, k = rms_norm(q, w[:hd], self.d.eps), rms_norm(k, w[hd:], self.d.eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, h, S, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return attend(q, k, v, mask, hd ** -0.5, self.attn_dropout, causal=True)  # [B, S, n_q*hd]


class MLP(nn.Module):
    def __init__(self, d: LlamaDims, layout: ShardLayout, group: TPGroup) -> None:
        super().__init__()
        cols = Split.of(layout.range("mlp"), d.inter)
        self.group, self.act = group, d.act
        self.gate_proj = ColumnParallelLinear(d.hidden, cols, bias=d.mlp_bias)
        self.up_proj = ColumnParallelLinear(d.hidden, cols, bias=d.mlp_bias)
        self.down_proj = RowParallelLinear(cols, d.hidden, group, bias=d.mlp_bias, kind="mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, hidden]
        return self.down_proj(self.inner(x))

    def inner(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, hidden] -> [B, S, inter_local]
        x, _, (ag, au) = enter_region(x, self.group, "mlp", (self.gate_proj, self.up_proj))
        return self.act(self.gate_proj(x, ag)) * self.up_proj(x, au)


class DecoderLayer(nn.Module):
    def __init__(self, d: LlamaDims, layout: ShardLayout, group: TPGroup, streams: DropoutStreams) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(d.hidden, d.eps)
        self.self_attn = Attention(d, layout, group, streams)
        self.post_attention_layernorm = RMSNorm(d.hidden, d.eps)
        self.mlp = MLP(d, layout, group)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), mask, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

    def stages(self, masks: list[torch.Tensor | None], cos: torch.Tensor, sin: torch.Tensor) -> list[Stage]:
        """`forward` cut at its two all-reduces, for chunking (`overlap.run_chunked`)."""
        attn, mlp = self.self_attn, self.mlp
        return [(lambda x, c: attn.o_proj.partial(attn.mix(self.input_layernorm(x), masks[c], cos, sin)),
                 lambda x, r: x + attn.o_proj.finish(r), "attn"),
                (lambda x, c: mlp.down_proj.partial(mlp.inner(self.post_attention_layernorm(x))),
                 lambda x, r: x + mlp.down_proj.finish(r), "mlp")]


class _WithRope:
    """A decoder layer's stages with this forward's cos/sin bound (what `chunked` asks of a block)."""

    def __init__(self, layer: DecoderLayer, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.layer, self.cos, self.sin = layer, cos, sin

    def stages(self, masks: list[torch.Tensor | None]) -> list[Stage]:
        return self.layer.stages(masks, self.cos, self.sin)


class Llama(TPModel):
    variant = LLAMA
    hf_classes = LLAMA.hf_classes
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # peft's names
    lora_default_targets = ("q_proj", "v_proj")  # peft's default for llama / qwen2 / qwen3

    def __init__(self, config: dict[str, Any], task: str, layout: ShardLayout, group: TPGroup, *,
                 dropout: float | None = None) -> None:
        super().__init__(config, task, layout, group)
        d = self.d = LlamaDims(config, dropout, self.variant)
        self.model = nn.ModuleDict(dict(
            embed_tokens=VocabParallelEmbedding(d.vocab, d.hidden, layout, group, padding_idx=d.pad),
            layers=nn.ModuleList(DecoderLayer(d, layout, group, self.streams) for _ in range(d.n_layer)),
            norm=RMSNorm(d.hidden, d.eps),
        ))
        if task == "classify":
            self.score = Head(d.hidden, self.num_labels, bias=False, std=init_std(config))
        elif not d.tied:
            self.lm_head = ColumnParallelLinear(d.hidden, Split.of(layout.range("vocab"), d.vocab), bias=False)

    @property
    def vocab_range(self) -> tuple[int, int]:
        emb = self.model.embed_tokens
        return emb.vocab_start, emb.vocab_stop

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      token_type_ids: torch.Tensor | None) -> torch.Tensor:
        B, S = input_ids.shape
        # Dynamic NTK RoPE is made for sequences beyond max_position_embeddings (it rescales);
        # the other types are only defined up to it.
        if S > self.d.n_pos and self.d.rope.kind != "dynamic":
            raise ValueError(f"sequence length {S} exceeds max_position_embeddings {self.d.n_pos}")
        x = self.model.embed_tokens(input_ids)  # [B, S, hidden]
        cos, sin = self.d.rope.cos_sin(S, x.device)  # [S, hd]
        mask = attention_mask_bool(attention_mask, causal=True)  # [B, 1, S, S]
        if self.group.chunks != 1:  # chunking (`chunked` refuses a bad count)
            blocks = [_WithRope(layer, cos, sin) for layer in self.model.layers]
            return self.model.norm(chunked(x, mask, blocks, self.group))
        for layer in self.model.layers:
            x = layer(x, mask, cos, sin)
        return self.model.norm(x)

    def classify_head(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.score(last_token_pool(h, input_ids, self.d.pad))  # [B, num_labels]

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.d.tied else self.lm_head.weight
        return lm_head_logits(h, weight, self.group)  # [B, S, V_local]


class Qwen2(Llama):
    variant = QWEN2
    hf_classes = QWEN2.hf_classes


class Qwen3(Llama):
    variant = QWEN3
    hf_classes = QWEN3.hf_classes


class LlamaFamily(Family):
    name = "llama"
    architectures = LLAMA.architectures
    model_cls: type[Llama] = Llama

    def num_units(self, config: dict[str, Any]) -> int:
        return int(cfg_get(config, "num_key_value_heads", default=cfg_require(config, "num_attention_heads")))

    def max_positions(self, config: dict[str, Any]) -> int:
        return int(cfg_require(config, "max_position_embeddings"))

    def arch_spec(self, config: dict[str, Any], task: str) -> dict[str, Any]:
        self.hf_class(task)
        d = LlamaDims(config, None, self.model_cls.variant)
        return dict(family=self.name, hidden_size=d.hidden, num_layers=d.n_layer, num_heads=d.n_head,
                    num_kv_heads=d.n_kv, intermediate_size=d.inter, vocab_size=d.vocab, max_positions=d.n_pos,
                    num_labels=num_labels(config) if task == "classify" else None, tie_word_embeddings=d.tied)

    def config_from_arch(self, arch: dict[str, Any]) -> dict[str, Any]:
        v = self.model_cls.variant
        config = dict(model_type=v.model_type, architectures=[v.prefix + "ForCausalLM"],
                      hidden_size=arch["hidden_size"], num_hidden_layers=arch["num_layers"],
                      num_attention_heads=arch["num_heads"], num_key_value_heads=arch["num_kv_heads"],
                      intermediate_size=arch["intermediate_size"], vocab_size=arch["vocab_size"],
                      max_position_embeddings=arch["max_positions"],
                      tie_word_embeddings=arch.get("tie_word_embeddings", False), hidden_act="silu",
                      rms_norm_eps=1e-6, pad_token_id=0)
        if v.head_dim is not None:  # ArchSpec has no head_dim: hidden / heads, written out (Qwen3's default is 128)
            config["head_dim"] = arch["hidden_size"] // arch["num_heads"]
        if v.sliding:
            config["use_sliding_window"] = False
        if arch.get("num_labels") is not None:
            config["num_labels"] = arch["num_labels"]
        return config


class Qwen2Family(LlamaFamily):
    name = "qwen2"
    architectures = QWEN2.architectures
    model_cls = Qwen2


class Qwen3Family(LlamaFamily):
    name = "qwen3"
    architectures = QWEN3.architectures
    model_cls = Qwen3
