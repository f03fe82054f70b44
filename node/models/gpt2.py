"""GPT-2 (GPT2LMHeadModel, GPT2ForSequenceClassification), tensor-parallel, nanoGPT style.

Module names mirror transformers', so local parameter names are the HF names. HF's Conv1D keeps
weights as [in, out]; we keep that orientation (`transposed=True`) so every local weight is a plain
slice of the checkpoint tensor. c_attn fuses q|k|v: a rank's local c_attn is its q head columns,
then its k head columns, then its v head columns (3 segments).
Per-segment layout: a rank holds its range of heads (`layout.range("attn")`), of MLP columns
(`"mlp"`) and of vocabulary rows (`"vocab"`), each cut on its own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from xronos.node.tp.group import TPGroup
from xronos.node.tp.layers import ColumnParallelLinear, RowParallelLinear, Split, VocabParallelEmbedding
from xronos.node.tp.layout import ShardLayout
from xronos.node.tp.lora import enter_region
from xronos.node.tp.overlap import Stage

from .common import (Dropout, chunked, DropoutStreams, Family, Head, TPModel, attend, attention_mask_bool, cfg_get,
                     cfg_require, gelu_fn, init_std, last_token_pool, lm_head_logits, num_labels)


class GPT2Dims:
    def __init__(self, c: dict[str, Any], dropout: float | None) -> None:
        self.hidden = int(cfg_require(c, "n_embd", "hidden_size"))
        self.n_layer = int(cfg_require(c, "n_layer", "num_hidden_layers"))
        self.n_head = int(cfg_require(c, "n_head", "num_attention_heads"))
        self.vocab = int(cfg_require(c, "vocab_size"))
        self.n_pos = int(cfg_require(c, "n_positions", "max_position_embeddings"))
        self.n_inner = int(cfg_get(c, "n_inner", default=4 * self.hidden))
        self.eps = float(cfg_get(c, "layer_norm_epsilon", default=1e-5))
        self.act = gelu_fn(cfg_get(c, "activation_function", default="gelu_new"))
        if self.hidden % self.n_head:
            raise ValueError(f"n_embd {self.hidden} is not a multiple of n_head {self.n_head}")
        if c.get("add_cross_attention"):
            raise ValueError("GPT-2 with cross-attention (add_cross_attention=true) is not supported")
        self.head_dim = self.hidden // self.n_head
        p = lambda key, default: float(dropout if dropout is not None else cfg_get(c, key, default=default))
        self.resid_p, self.embd_p, self.attn_p = p("resid_pdrop", 0.1), p("embd_pdrop", 0.1), p("attn_pdrop", 0.1)
        self.scale_weights = bool(cfg_get(c, "scale_attn_weights", default=True))
        self.scale_by_layer = bool(cfg_get(c, "scale_attn_by_inverse_layer_idx", default=False))
        self.tied = bool(cfg_get(c, "tie_word_embeddings", default=True))
        self.pad_token_id = c.get("pad_token_id")


class Attention(nn.Module):
    def __init__(self, d: GPT2Dims, layout: ShardLayout, group: TPGroup, streams: DropoutStreams,
                 layer_idx: int) -> None:
        super().__init__()
        heads = layout.range("attn")
        self.group, self.head_dim, self.n_local = group, d.head_dim, heads[1] - heads[0]
        self.width = self.n_local * d.head_dim
        # c_attn [hidden, 3 hidden]: this rank's heads' columns of q, of k and of v.
        self.c_attn = ColumnParallelLinear(d.hidden, Split.of(heads, d.n_head, unit=d.head_dim, parts=3),
                                           transposed=True)
        self.c_proj = RowParallelLinear(Split.of(heads, d.n_head, unit=d.head_dim), d.hidden, group,
                                        transposed=True, kind="attn")
        self.attn_dropout = Dropout(d.attn_p, streams, partitioned=True)
        self.resid_dropout = Dropout(d.resid_p, streams)
        self.scale = d.head_dim ** -0.5 if d.scale_weights else 1.0
        if d.scale_by_layer:
            self.scale /= float(layer_idx + 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.resid_dropout(self.c_proj(self.mix(x, mask)))  # [B, S, hidden], summed over ranks

    def mix(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The attention of this rank's heads: c_proj's input [B, S, h*hd]."""
        B, S, _ = x.shape  # x [B, S, hidden], replicated
        x, _, (a,) = enter_region(x, self.group, "attn", (self.c_attn,))  # a: c_attn's LoRA A, if adapted
        q, k, v = self.c_attn(x, a).split([self.width] * 3, dim=2)  # [B, S, h*hd]
        q, k, v = (t.view(B, S, self.n_local, self.head_dim).transpose(1, 2) for t in (q, k, v))  # [B, h, S, hd]
        return attend(q, k, v, mask, self.scale, self.attn_dropout, causal=True)  # [B, S, h*hd]


class MLP(nn.Module):
    def __init__(self, d: GPT2Dims, layout: ShardLayout, group: TPGroup, streams: DropoutStreams) -> None:
        super().__init__()
        cols = Split.of(layout.range("mlp"), d.n_inner)
        self.group, self.act = group, d.act
        self.c_fc = ColumnParallelLinear(d.hidden, cols, transposed=True)
        self.c_proj = RowParallelLinear(cols, d.hidden, group, transposed=True, kind="mlp")
        self.dropout = Dropout(d.resid_p, streams)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, hidden]
        return self.dropout(self.c_proj(self.inner(x)))  # [B, S, hidden]

    def inner(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, hidden] -> [B, S, inner_local]
        x, _, (a,) = enter_region(x, self.group, "mlp", (self.c_fc,))
        return self.act(self.c_fc(x, a))


class Block(nn.Module):
    def __init__(self, d: GPT2Dims, layout: ShardLayout, group: TPGroup, streams: DropoutStreams,
                 layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d.hidden, eps=d.eps)
        self.attn = Attention(d, layout, group, streams, layer_idx)
        self.ln_2 = nn.LayerNorm(d.hidden, eps=d.eps)
        self.mlp = MLP(d, layout, group, streams)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))

    def stages(self, masks: list[torch.Tensor | None]) -> list[Stage]:
        """`forward` cut at its two all-reduces, for chunking (`overlap.run_chunked`);
        masks[c]: chunk c's attention mask."""
        attn, mlp = self.attn, self.mlp
        return [(lambda x, c: attn.c_proj.partial(attn.mix(self.ln_1(x), masks[c])),
                 lambda x, r: x + attn.resid_dropout(attn.c_proj.finish(r)), "attn"),
                (lambda x, c: mlp.c_proj.partial(mlp.inner(self.ln_2(x))),
                 lambda x, r: x + mlp.dropout(mlp.c_proj.finish(r)), "mlp")]


class GPT2(TPModel):
    hf_classes = {"causal-lm": "GPT2LMHeadModel", "classify": "GPT2ForSequenceClassification"}
    # LoRA targets, peft's names: c_proj is both the attention output and the MLP down projection.
    lora_targets = ("c_attn", "c_proj", "c_fc")
    lora_default_targets = ("c_attn",)  # peft's default for gpt2

    def __init__(self, config: dict[str, Any], task: str, layout: ShardLayout, group: TPGroup, *,
                 dropout: float | None = None) -> None:
        super().__init__(config, task, layout, group)
        d = self.d = GPT2Dims(config, dropout)
        self.transformer = nn.ModuleDict(dict(
            wte=VocabParallelEmbedding(d.vocab, d.hidden, layout, group),
            wpe=nn.Embedding(d.n_pos, d.hidden),
            drop=Dropout(d.embd_p, self.streams),
            h=nn.ModuleList(Block(d, layout, group, self.streams, i) for i in range(d.n_layer)),
            ln_f=nn.LayerNorm(d.hidden, eps=d.eps),
        ))
        if task == "classify":  # a fresh head when the checkpoint is a base/LM model, as in HF
            self.score = Head(d.hidden, self.num_labels, bias=False, std=init_std(config))
        elif not d.tied:
            self.lm_head = ColumnParallelLinear(d.hidden, Split.of(layout.range("vocab"), d.vocab), bias=False)

    @property
    def vocab_range(self) -> tuple[int, int]:
        wte = self.transformer.wte
        return wte.vocab_start, wte.vocab_stop

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      token_type_ids: torch.Tensor | None) -> torch.Tensor:
        B, S = input_ids.shape
        if S > self.d.n_pos:
            raise ValueError(f"sequence length {S} exceeds GPT-2's n_positions {self.d.n_pos}")
        t = self.transformer
        pos = torch.arange(S, device=input_ids.device)
        x = t.wte(input_ids) + t.wpe(pos)  # [B, S, hidden]
        if token_type_ids is not None:  # GPT-2 embeds token types with the word embedding
            x = x + t.wte(token_type_ids)
        x = t.drop(x)
        mask = attention_mask_bool(attention_mask, causal=True)  # [B, 1, S, S]
        if self.group.chunks != 1:  # chunking (`chunked` refuses a bad count)
            return t.ln_f(chunked(x, mask, t.h, self.group))
        for block in t.h:
            x = block(x, mask)
        return t.ln_f(x)  # [B, S, hidden]

    def classify_head(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        # score is linear per position, so pooling first equals HF's score-then-pool.
        return self.score(last_token_pool(h, input_ids, self.d.pad_token_id))  # [B, num_labels]

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.transformer.wte.weight if self.d.tied else self.lm_head.weight
        return lm_head_logits(h, weight, self.group)  # [B, S, V_local]


class GPT2Family(Family):
    name = "gpt2"
    architectures = ("GPT2LMHeadModel", "GPT2Model", "GPT2ForSequenceClassification", "GPT2DoubleHeadsModel")
    model_cls = GPT2
    fan_in_fan_out = True

    def num_units(self, config: dict[str, Any]) -> int:
        return int(cfg_require(config, "n_head", "num_attention_heads"))

    def max_positions(self, config: dict[str, Any]) -> int:
        return int(cfg_require(config, "n_positions", "max_position_embeddings"))

    def arch_spec(self, config: dict[str, Any], task: str) -> dict[str, Any]:
        d = GPT2Dims(config, None)
        return dict(family="gpt2", hidden_size=d.hidden, num_layers=d.n_layer, num_heads=d.n_head,
                    num_kv_heads=d.n_head, intermediate_size=d.n_inner, vocab_size=d.vocab,
                    max_positions=d.n_pos, num_labels=num_labels(config) if task == "classify" else None,
                    tie_word_embeddings=d.tied)

    def config_from_arch(self, arch: dict[str, Any]) -> dict[str, Any]:
        config = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=arch["hidden_size"],
                      n_layer=arch["num_layers"], n_head=arch["num_heads"], n_inner=arch["intermediate_size"],
                      vocab_size=arch["vocab_size"], n_positions=arch["max_positions"],
                      tie_word_embeddings=arch.get("tie_word_embeddings", True),
                      pad_token_id=arch["vocab_size"] - 1)
        if arch.get("num_labels") is not None:
            config["num_labels"] = arch["num_labels"]
        return config
