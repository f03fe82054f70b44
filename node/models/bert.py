"""BERT and RoBERTa (…ForSequenceClassification), tensor-parallel, post-LayerNorm encoders.

Per-segment layout: a rank holds its range of attention heads (their query/key/value columns and
rows of the attention output), its own range of MLP columns and of vocabulary rows, each cut on
its own (`layout.range(kind)`). Word embeddings are vocab-parallel;
position and token-type embeddings, layer norms and the classification head are replicated.
RoBERTa differs in three places: position ids count non-pad tokens from padding_idx + 1, its head
is dense+tanh+out_proj on <s> (no pooler), and its tensors live under `roberta.`.
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

from .common import (Dropout, DropoutStreams, chunked, Family, Head, TPModel, attend, attention_mask_bool, cfg_get,
                     cfg_require, gelu_fn, init_std, num_labels)


class EncoderDims:
    def __init__(self, c: dict[str, Any], dropout: float | None, roberta: bool) -> None:
        self.hidden = int(cfg_require(c, "hidden_size"))
        self.n_layer = int(cfg_require(c, "num_hidden_layers"))
        self.n_head = int(cfg_require(c, "num_attention_heads"))
        self.inter = int(cfg_require(c, "intermediate_size"))
        self.vocab = int(cfg_require(c, "vocab_size"))
        self.n_pos = int(cfg_require(c, "max_position_embeddings"))
        self.n_types = int(cfg_get(c, "type_vocab_size", default=2))
        self.eps = float(cfg_get(c, "layer_norm_eps", default=1e-12))
        self.act = gelu_fn(cfg_get(c, "hidden_act", default="gelu"))
        self.pad = cfg_get(c, "pad_token_id", default=1 if roberta else 0)
        if self.hidden % self.n_head:
            raise ValueError(f"hidden_size {self.hidden} is not a multiple of num_attention_heads {self.n_head}")
        if c.get("is_decoder") or c.get("add_cross_attention"):
            raise ValueError("BERT/RoBERTa as a decoder (is_decoder / add_cross_attention) is not supported")
        if cfg_get(c, "position_embedding_type", default="absolute") != "absolute":
            raise ValueError(f"position_embedding_type {c['position_embedding_type']!r} is not supported "
                             "(only 'absolute')")
        self.head_dim = self.hidden // self.n_head
        p = lambda key, default: float(dropout if dropout is not None else cfg_get(c, key, default=default))
        self.hidden_p, self.attn_p = p("hidden_dropout_prob", 0.1), p("attention_probs_dropout_prob", 0.1)
        self.cls_p = p("classifier_dropout", self.hidden_p)


class SelfAttention(nn.Module):
    def __init__(self, d: EncoderDims, layout: ShardLayout, group: TPGroup, streams: DropoutStreams) -> None:
        super().__init__()
        heads = layout.range("attn")
        self.group, self.n_local, self.head_dim = group, heads[1] - heads[0], d.head_dim
        cols = Split.of(heads, d.n_head, unit=d.head_dim)
        self.query = ColumnParallelLinear(d.hidden, cols)
        self.key = ColumnParallelLinear(d.hidden, cols)
        self.value = ColumnParallelLinear(d.hidden, cols)
        self.out = RowParallelLinear(cols, d.hidden, group, kind="attn")
        self.attn_dropout = Dropout(d.attn_p, streams, partitioned=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.out(self.mix(x, mask))  # [B, S, hidden]

    def mix(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The attention of this rank's heads: out's input [B, S, h*hd]."""
        B, S, _ = x.shape  # x [B, S, hidden], replicated
        lins = (self.query, self.key, self.value)
        x, _, adapters = enter_region(x, self.group, "attn", lins)  # adapters: their LoRA A's, if adapted
        q, k, v = (lin(x, a).view(B, S, self.n_local, self.head_dim).transpose(1, 2)
                   for lin, a in zip(lins, adapters))  # [B, h, S, hd]
        return attend(q, k, v, mask, self.head_dim ** -0.5, self.attn_dropout, causal=False)  # [B, S, h*hd]


class MLP(nn.Module):
    def __init__(self, d: EncoderDims, layout: ShardLayout, group: TPGroup) -> None:
        super().__init__()
        cols = Split.of(layout.range("mlp"), d.inter)
        self.group, self.act = group, d.act
        self.up = ColumnParallelLinear(d.hidden, cols)
        self.down = RowParallelLinear(cols, d.hidden, group, kind="mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, hidden]
        return self.down(self.inner(x))

    def inner(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, hidden] -> [B, S, inter_local]
        x, _, (a,) = enter_region(x, self.group, "mlp", (self.up,))
        return self.act(self.up(x, a))


class Layer(nn.Module):
    def __init__(self, d: EncoderDims, layout: ShardLayout, group: TPGroup, streams: DropoutStreams) -> None:
        super().__init__()
        self.attn = SelfAttention(d, layout, group, streams)
        self.attn_ln = nn.LayerNorm(d.hidden, eps=d.eps)
        self.mlp = MLP(d, layout, group)
        self.mlp_ln = nn.LayerNorm(d.hidden, eps=d.eps)
        self.drop = Dropout(d.hidden_p, streams)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:  # post-LN
        x = self.attn_ln(x + self.drop(self.attn(x, mask)))
        return self.mlp_ln(x + self.drop(self.mlp(x)))

    def stages(self, masks: list[torch.Tensor | None]) -> list[Stage]:
        """`forward` cut at its two all-reduces, for chunking (`overlap.run_chunked`)."""
        attn, mlp = self.attn, self.mlp
        return [(lambda x, c: attn.out.partial(attn.mix(x, masks[c])),
                 lambda x, r: self.attn_ln(x + self.drop(attn.out.finish(r))), "attn"),
                (lambda x, c: mlp.down.partial(mlp.inner(x)),
                 lambda x, r: self.mlp_ln(x + self.drop(mlp.down.finish(r))), "mlp")]


# Local module names -> HF names: inside layers.{i}. -> inside encoder.layer.{i}., and the rest
# ("<prefix>" = bert. or roberta.).
_LAYER_NAMES = {"attn.query": "attention.self.query", "attn.key": "attention.self.key",
                "attn.value": "attention.self.value", "attn.out": "attention.output.dense",
                "attn_ln": "attention.output.LayerNorm", "mlp.up": "intermediate.dense",
                "mlp.down": "output.dense", "mlp_ln": "output.LayerNorm"}
_TOP_NAMES = {"word_embeddings": "<prefix>embeddings.word_embeddings",
              "position_embeddings": "<prefix>embeddings.position_embeddings",
              "token_type_embeddings": "<prefix>embeddings.token_type_embeddings",
              "emb_ln": "<prefix>embeddings.LayerNorm", "pooler": "<prefix>pooler.dense",
              "classifier": "classifier", "head_dense": "classifier.dense", "head_out": "classifier.out_proj"}


class Encoder(TPModel):
    roberta = False
    # LoRA targets, peft's names: dense is the attention output, intermediate and output dense
    # layers of every block (never the pooler or RoBERTa's head, which are not block layers).
    lora_targets = ("query", "key", "value", "dense")
    lora_default_targets = ("query", "value")  # peft's default for bert / roberta
    prefix = "bert."

    def __init__(self, config: dict[str, Any], task: str, layout: ShardLayout, group: TPGroup, *,
                 dropout: float | None = None) -> None:
        super().__init__(config, task, layout, group)
        d = self.d = EncoderDims(config, dropout, self.roberta)
        self.word_embeddings = VocabParallelEmbedding(d.vocab, d.hidden, layout, group, padding_idx=d.pad)
        self.position_embeddings = nn.Embedding(d.n_pos, d.hidden, padding_idx=d.pad if self.roberta else None)
        self.token_type_embeddings = nn.Embedding(d.n_types, d.hidden)
        self.emb_ln = nn.LayerNorm(d.hidden, eps=d.eps)
        self.emb_drop = Dropout(d.hidden_p, self.streams)
        self.layers = nn.ModuleList(Layer(d, layout, group, self.streams) for _ in range(d.n_layer))
        self.head_drop = Dropout(d.cls_p, self.streams)
        # Task heads: created fresh (like transformers) when a base checkpoint lacks them.
        std = init_std(config)
        if self.roberta:
            self.head_dense = Head(d.hidden, d.hidden, std=std)
            self.head_out = Head(d.hidden, self.num_labels, std=std)
        else:
            self.pooler = Head(d.hidden, d.hidden, std=std)
            self.classifier = Head(d.hidden, self.num_labels, std=std)

    def hf_name(self, local: str) -> str:
        if local.startswith("layers."):
            _, i, rest = local.split(".", 2)
            module, _, param = rest.rpartition(".")
            return f"{self.prefix}encoder.layer.{i}.{_LAYER_NAMES[module]}.{param}"
        module, _, param = local.rpartition(".")
        return f"{_TOP_NAMES[module].replace('<prefix>', self.prefix)}.{param}"

    def _position_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        S = input_ids.shape[1]
        if not self.roberta:
            return torch.arange(S, device=input_ids.device)[None]  # [1, S]
        # fairseq: non-pad tokens count up from padding_idx + 1, pads keep padding_idx.
        not_pad = input_ids.ne(self.d.pad).int()
        return (torch.cumsum(not_pad, dim=1) * not_pad).long() + self.d.pad  # [B, S]

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      token_type_ids: torch.Tensor | None) -> torch.Tensor:
        B, S = input_ids.shape
        pos = self._position_ids(input_ids)
        if int(pos.max()) >= self.d.n_pos:
            raise ValueError(f"sequence length {S} exceeds the model's {self.d.n_pos} position embeddings")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = self.emb_drop(self.emb_ln(x + self.position_embeddings(pos)))  # [B, S, hidden]
        mask = attention_mask_bool(attention_mask, causal=False)  # [B, 1, 1, S]
        if self.group.chunks != 1:  # chunking (`chunked` refuses a bad count)
            return chunked(x, mask, self.layers, self.group)
        for layer in self.layers:
            x = layer(x, mask)
        return x

    def classify_head(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        x = h[:, 0]  # [B, hidden]: [CLS] / <s>
        if self.roberta:
            x = torch.tanh(self.head_dense(self.head_drop(x)))
            return self.head_out(self.head_drop(x))  # [B, num_labels]
        return self.classifier(self.head_drop(torch.tanh(self.pooler(x))))


class Bert(Encoder):
    hf_classes = {"classify": "BertForSequenceClassification"}


class Roberta(Encoder):
    hf_classes = {"classify": "RobertaForSequenceClassification"}
    roberta = True
    prefix = "roberta."


class BertFamily(Family):
    name = "bert"
    architectures = ("BertModel", "BertForSequenceClassification", "BertForMaskedLM", "BertForPreTraining")
    model_cls: type[Encoder] = Bert

    def num_units(self, config: dict[str, Any]) -> int:
        return int(cfg_require(config, "num_attention_heads"))

    def max_positions(self, config: dict[str, Any]) -> int:
        return int(cfg_require(config, "max_position_embeddings"))

    def arch_spec(self, config: dict[str, Any], task: str) -> dict[str, Any]:
        self.hf_class(task)
        d = EncoderDims(config, None, self.model_cls.roberta)
        return dict(family=self.name, hidden_size=d.hidden, num_layers=d.n_layer, num_heads=d.n_head,
                    num_kv_heads=d.n_head, intermediate_size=d.inter, vocab_size=d.vocab,
                    max_positions=self.max_positions(config), num_labels=num_labels(config),
                    tie_word_embeddings=False)

    def config_from_arch(self, arch: dict[str, Any]) -> dict[str, Any]:
        cls = self.model_cls.hf_classes["classify"]
        config = dict(model_type=self.name, architectures=[cls], hidden_size=arch["hidden_size"],
                      num_hidden_layers=arch["num_layers"], num_attention_heads=arch["num_heads"],
                      intermediate_size=arch["intermediate_size"], vocab_size=arch["vocab_size"],
                      max_position_embeddings=arch["max_positions"], type_vocab_size=2, pad_token_id=0,
                      num_labels=arch.get("num_labels") or 2)
        return config


class RobertaFamily(BertFamily):
    name = "roberta"
    architectures = ("RobertaModel", "RobertaForSequenceClassification", "RobertaForMaskedLM")
    model_cls = Roberta

    def max_positions(self, config: dict[str, Any]) -> int:
        # Positions start at padding_idx + 1, so the first pad + 1 rows are never a token's.
        pad = int(cfg_get(config, "pad_token_id", default=1))
        return int(cfg_require(config, "max_position_embeddings")) - pad - 1

    def config_from_arch(self, arch: dict[str, Any]) -> dict[str, Any]:
        config = super().config_from_arch(arch)
        config.update(pad_token_id=1, type_vocab_size=1, max_position_embeddings=arch["max_positions"] + 2)
        return config
