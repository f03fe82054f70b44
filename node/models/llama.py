"""LLaMA (LlamaForCausalLM, LlamaForSequenceClassification), tensor-parallel, pre-RMSNorm decoder.

Grouped-query attention: an attention unit u = KV head u together with the n_rep = heads / kv_heads
query heads that read it, so there are num_key_value_heads of them; MLP columns of gate_proj/up_proj
(rows of down_proj) and vocabulary rows are cut on their own ranges (`layout.range(kind)`).
Module names mirror transformers', so local parameter names are the HF names.
RoPE: the default type only; cos/sin are computed per forward (no buffers: the model is built
on the meta device and materialized with `to_empty`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from xronos.node.tp.group import TPGroup
from xronos.node.tp.layers import ColumnParallelLinear, RowParallelLinear, Split, VocabParallelEmbedding
from xronos.node.tp.layout import ShardLayout
from xronos.node.tp.mappings import copy_to_tp

from .common import (Dropout, DropoutStreams, Family, Head, TPModel, attend, attention_mask_bool, cfg_get,
                     cfg_require, gelu_fn, init_std, last_token_pool, lm_head_logits, num_labels)


def rope_theta(c: dict[str, Any]) -> float:
    """rope_theta of the default RoPE; any other rope type is refused."""
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    for p in (params, scaling):
        kind = p.get("rope_type", p.get("type", "default"))
        if kind != "default":
            raise ValueError(f"RoPE type {kind!r} is not supported (only 'default')")
    return float(params.get("rope_theta", c.get("rope_theta", 10000.0)))


class LlamaDims:
    def __init__(self, c: dict[str, Any], dropout: float | None) -> None:
        self.hidden = int(cfg_require(c, "hidden_size"))
        self.n_layer = int(cfg_require(c, "num_hidden_layers"))
        self.n_head = int(cfg_require(c, "num_attention_heads"))
        self.n_kv = int(cfg_get(c, "num_key_value_heads", default=self.n_head))
        self.inter = int(cfg_require(c, "intermediate_size"))
        self.vocab = int(cfg_require(c, "vocab_size"))
        self.n_pos = int(cfg_require(c, "max_position_embeddings"))
        self.head_dim = int(cfg_get(c, "head_dim", default=self.hidden // self.n_head))
        self.eps = float(cfg_get(c, "rms_norm_eps", default=1e-6))
        self.act = gelu_fn(cfg_get(c, "hidden_act", default="silu"))
        self.attn_bias = bool(cfg_get(c, "attention_bias", default=False))
        self.mlp_bias = bool(cfg_get(c, "mlp_bias", default=False))
        self.tied = bool(cfg_get(c, "tie_word_embeddings", default=False))
        self.theta = rope_theta(c)
        self.pad = c.get("pad_token_id")
        self.attn_p = float(dropout if dropout is not None else cfg_get(c, "attention_dropout", default=0.0))
        if self.n_head % self.n_kv:
            raise ValueError(f"num_attention_heads {self.n_head} is not a multiple of "
                             f"num_key_value_heads {self.n_kv}")
        self.n_rep = self.n_head // self.n_kv


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim], statistics in fp32 like HF
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope(S: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
    freqs = torch.arange(S, device=device).float()[:, None] * inv_freq  # [S, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [S, hd]
    return emb.cos(), emb.sin()


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
        self.q_proj = ColumnParallelLinear(d.hidden, q, bias=d.attn_bias)
        self.k_proj = ColumnParallelLinear(d.hidden, kv, bias=d.attn_bias)
        self.v_proj = ColumnParallelLinear(d.hidden, kv, bias=d.attn_bias)
        self.o_proj = RowParallelLinear(q, d.hidden, group, bias=d.attn_bias, kind="attn")
        self.attn_dropout = Dropout(d.attn_p, streams, partitioned=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape  # [B, S, hidden], replicated
        hd = self.d.head_dim
        x = copy_to_tp(x, self.group, "attn")
        q = self.q_proj(x).view(B, S, self.n_q, hd).transpose(1, 2)  # [B, n_rep*kv, S, hd]
        k = self.k_proj(x).view(B, S, self.n_kv, hd).transpose(1, 2)  # [B, kv, S, hd]
        v = self.v_proj(x).view(B, S, self.n_kv, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = attend(q, k, v, mask, hd ** -0.5, self.attn_dropout, causal=True)  # [B, S, n_q*hd]
        return self.o_proj(y)  # [B, S, hidden]


class MLP(nn.Module):
    def __init__(self, d: LlamaDims, layout: ShardLayout, group: TPGroup) -> None:
        super().__init__()
        cols = Split.of(layout.range("mlp"), d.inter)
        self.group, self.act = group, d.act
        self.gate_proj = ColumnParallelLinear(d.hidden, cols, bias=d.mlp_bias)
        self.up_proj = ColumnParallelLinear(d.hidden, cols, bias=d.mlp_bias)
        self.down_proj = RowParallelLinear(cols, d.hidden, group, bias=d.mlp_bias, kind="mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, hidden]
        x = copy_to_tp(x, self.group, "mlp")
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


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


class Llama(TPModel):
    hf_classes = {"causal-lm": "LlamaForCausalLM", "classify": "LlamaForSequenceClassification"}

    def __init__(self, config: dict[str, Any], task: str, layout: ShardLayout, group: TPGroup, *,
                 dropout: float | None = None) -> None:
        super().__init__(config, task, layout, group)
        d = self.d = LlamaDims(config, dropout)
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
        if S > self.d.n_pos:
            raise ValueError(f"sequence length {S} exceeds max_position_embeddings {self.d.n_pos}")
        x = self.model.embed_tokens(input_ids)  # [B, S, hidden]
        cos, sin = rope(S, self.d.head_dim, self.d.theta, x.device)  # [S, hd]
        mask = attention_mask_bool(attention_mask, causal=True)  # [B, 1, S, S]
        for layer in self.model.layers:
            x = layer(x, mask, cos, sin)
        return self.model.norm(x)

    def classify_head(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.score(last_token_pool(h, input_ids, self.d.pad))  # [B, num_labels]

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.d.tied else self.lm_head.weight
        return lm_head_logits(h, weight, self.group)  # [B, S, V_local]


class LlamaFamily(Family):
    name = "llama"
    architectures = ("LlamaForCausalLM", "LlamaModel", "LlamaForSequenceClassification")
    model_cls = Llama

    def num_units(self, config: dict[str, Any]) -> int:
        return int(cfg_get(config, "num_key_value_heads", default=cfg_require(config, "num_attention_heads")))

    def max_positions(self, config: dict[str, Any]) -> int:
        return int(cfg_require(config, "max_position_embeddings"))

    def arch_spec(self, config: dict[str, Any], task: str) -> dict[str, Any]:
        self.hf_class(task)
        d = LlamaDims(config, None)
        return dict(family="llama", hidden_size=d.hidden, num_layers=d.n_layer, num_heads=d.n_head,
                    num_kv_heads=d.n_kv, intermediate_size=d.inter, vocab_size=d.vocab, max_positions=d.n_pos,
                    num_labels=num_labels(config) if task == "classify" else None, tie_word_embeddings=d.tied)

    def config_from_arch(self, arch: dict[str, Any]) -> dict[str, Any]:
        config = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=arch["hidden_size"],
                      num_hidden_layers=arch["num_layers"], num_attention_heads=arch["num_heads"],
                      num_key_value_heads=arch["num_kv_heads"], intermediate_size=arch["intermediate_size"],
                      vocab_size=arch["vocab_size"], max_position_embeddings=arch["max_positions"],
                      tie_word_embeddings=arch.get("tie_word_embeddings", False), hidden_act="silu",
                      rms_norm_eps=1e-6, pad_token_id=0)
        if arch.get("num_labels") is not None:
            config["num_labels"] = arch["num_labels"]
        return config
