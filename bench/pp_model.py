"""Pipeline stages cut out of a transformers sequence-classification model.

The model is a chain of "layers" for the partitioner: [emb, blk_0 .. blk_{B-1}, out]. A stage
owns a contiguous range of it and is built from the checkpoint with only what it owns: a config
with just its blocks (and a one-row vocabulary when it does not own the embedding), then the
owned tensors read from the safetensors file with their block indices shifted. The forward of
each piece calls the very transformers modules (and mask helpers) the full model calls, so the
pipeline computes what `AutoModelForSequenceClassification` computes — tests compare gradients.

A stage may train LoRA adapters on its frozen share of the base instead (`add_lora`): peft's own
LoRA layers, injected in place, the adapters drawn as the TP engine draws them (so both engines
train the same adapters from the same start) and the classification head trained, as peft's
SEQ_CLS task and the TP engine train it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn


@dataclass(frozen=True)
class Adapter:
    hf_class: str
    blocks: str  # dotted path of the block ModuleList
    embed: tuple[str, ...]  # module paths of the embedding layer
    head: tuple[str, ...]  # module paths of the output layer
    layers_key: str  # config key of the block count


ADAPTERS: dict[str, Adapter] = {
    "llama": Adapter("LlamaForSequenceClassification", "model.layers", ("model.embed_tokens",),
                     ("model.norm", "score"), "num_hidden_layers"),
    "gpt2": Adapter("GPT2ForSequenceClassification", "transformer.h",
                    ("transformer.wte", "transformer.wpe"), ("transformer.ln_f", "score"), "n_layer"),
    "roberta": Adapter("RobertaForSequenceClassification", "roberta.encoder.layer",
                       ("roberta.embeddings",), ("classifier",), "num_hidden_layers"),
    "bert": Adapter("BertForSequenceClassification", "bert.encoder.layer",
                    ("bert.embeddings",), ("bert.pooler", "classifier"), "num_hidden_layers"),
    "qwen2": Adapter("Qwen2ForSequenceClassification", "model.layers", ("model.embed_tokens",),
                     ("model.norm", "score"), "num_hidden_layers"),
}
# Families whose decoder runs as LLaMA's does (rotary embeddings from the base model, a causal mask,
# last-token pooling).
LLAMA_LIKE = ("llama", "qwen2")
# peft's adapter name inside a live model's parameter names (`q_proj.lora_A.default.weight`), which
# the saved adapter and the TP engine leave out (`q_proj.lora_A.weight`).
PEFT_ADAPTER = ".default"


# Every dropout probability of the four families' configs (what the engine's `dropout=` overrides).
DROPOUT_KEYS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout", "resid_pdrop",
                "embd_pdrop", "attn_pdrop", "summary_first_dropout", "attention_dropout")


def family_of(config: dict) -> str:
    fam = config.get("model_type")
    if fam not in ADAPTERS:
        raise ValueError(f"pipeline baseline supports model_type {sorted(ADAPTERS)}, got {fam!r}")
    return fam


def num_blocks(config: dict) -> int:
    return int(config[ADAPTERS[family_of(config)].layers_key])


@dataclass(frozen=True)
class StageSpan:
    """Layers [start, stop) of the chain emb, blk_0..blk_{B-1}, out (length B + 2)."""

    start: int
    stop: int
    B: int

    @property
    def owns_embed(self) -> bool:
        return self.start == 0

    @property
    def owns_head(self) -> bool:
        return self.stop == self.B + 2

    @property
    def blocks(self) -> range:
        return range(max(self.start, 1) - 1, min(self.stop, self.B + 1) - 1)


def _get(root: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        root = getattr(root, part)
    return root


class Stage(nn.Module):
    def __init__(self, model_dir: str | Path, span: StageSpan, pad_token_id: int | None,
                 dropout: float | None = None) -> None:
        super().__init__()
        import transformers

        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.family = family_of(config)
        ad = ADAPTERS[self.family]
        self.span = span
        cfg = transformers.AutoConfig.from_pretrained(str(model_dir))
        setattr(cfg, ad.layers_key, len(span.blocks))
        if pad_token_id is not None:
            cfg.pad_token_id = pad_token_id  # the pooling of GPT-2/LLaMA heads looks for it
        if dropout is not None:
            for key in DROPOUT_KEYS:
                if hasattr(cfg, key):
                    setattr(cfg, key, dropout)
        self.full_vocab = cfg.vocab_size
        if not span.owns_embed:
            cfg.vocab_size = (cfg.pad_token_id or 0) + 1  # a stub: never read, costs nothing
        self.config = cfg
        self.model = getattr(transformers, ad.hf_class)(cfg)
        self.owned = self._owned_prefixes(ad)
        self._load(Path(model_dir), ad)
        for name, p in self.model.named_parameters():
            p.requires_grad_(self._is_owned(name))

    # -- which tensors live here --------------------------------------------------------------
    def _owned_prefixes(self, ad: Adapter) -> tuple[str, ...]:
        out: list[str] = [ad.blocks + "."]
        if self.span.owns_embed:
            out += [p + "." for p in ad.embed]
        if self.span.owns_head:
            out += [p + "." for p in ad.head]
        return tuple(out)

    def _is_owned(self, local_name: str) -> bool:
        return local_name.startswith(self.owned)

    def local_name(self, hf_name: str) -> str | None:
        """The local parameter name of a checkpoint tensor, None when another stage owns it."""
        ad = ADAPTERS[self.family]
        m = re.match(re.escape(ad.blocks) + r"\.(\d+)\.(.*)", hf_name)
        if m:
            i = int(m.group(1))
            if i not in self.span.blocks:
                return None
            return f"{ad.blocks}.{i - self.span.blocks.start}.{m.group(2)}"
        return hf_name if self._is_owned(hf_name) and not hf_name.startswith(ad.blocks + ".") else None

    def hf_name(self, local_name: str) -> str:
        """The checkpoint's (or, for an adapter, the TP engine's and peft's saved) tensor name."""
        ad = ADAPTERS[self.family]
        local_name = local_name.replace(f".lora_A{PEFT_ADAPTER}.", ".lora_A.").replace(f".lora_B{PEFT_ADAPTER}.", ".lora_B.")
        m = re.match(re.escape(ad.blocks) + r"\.(\d+)\.(.*)", local_name)
        if m:
            return f"{ad.blocks}.{int(m.group(1)) + self.span.blocks.start}.{m.group(2)}"
        return local_name

    def _load(self, model_dir: Path, ad: Adapter) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"model dir {model_dir} has no *.safetensors")
        params = dict(self.model.named_parameters())
        loaded: set[str] = set()
        with torch.no_grad():
            for f in files:
                with safe_open(str(f), framework="pt") as st:
                    for key in st.keys():
                        # A bare base-model checkpoint (e.g. BertModel) has no "bert." prefix.
                        local = self.local_name(key) or self.local_name(f"{self.model.base_model_prefix}.{key}")
                        if local is not None and local in params:
                            t = st.get_tensor(key)
                            if t.shape != params[local].shape:
                                raise ValueError(f"{f}: {key} has shape {tuple(t.shape)}, "
                                                 f"stage expects {tuple(params[local].shape)}")
                            params[local].copy_(t)
                            loaded.add(local)
        # A checkpoint may omit tied or freshly initialised tensors (a new classification head):
        # those keep the seeded init, exactly as from_pretrained would leave them.
        self.missing = sorted(n for n in params if self._is_owned(n) and n not in loaded)

    def owned_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """What this stage trains (and its optimizer holds)."""
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    @torch.no_grad()
    def add_lora(self, r: int, alpha: float, targets: tuple[str, ...], dropout: float = 0.0) -> list[str]:
        """Train LoRA adapters (rank r, scale alpha / r, on the blocks' `targets` modules) on this
        stage's frozen share of the base, and the classification head where the stage holds it.
        Each adapter starts as the TP engine's does (`loading.fresh_tensor`: A kaiming-uniform,
        seeded by its name; B zeros). Returns the adapted modules' checkpoint names."""
        from peft import LoraConfig, inject_adapter_in_model

        from xronos.node.models.loading import fresh_tensor
        from xronos.node.tp.lora import TRAINED_HEADS

        blocks = _get(self.model, ADAPTERS[self.family].blocks)
        if not len(blocks):  # nothing here to adapt: the stage only freezes what it holds
            adapted = []
        else:
            inject_adapter_in_model(LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                               lora_dropout=dropout, fan_in_fan_out=self.family == "gpt2"),
                                    blocks)
            adapted = []
            for name, p in self.model.named_parameters():
                if f".lora_A{PEFT_ADAPTER}." in name:
                    hf = self.hf_name(name)
                    p.copy_(fresh_tensor(hf, tuple(p.shape), "uniform", p.shape[1] ** -0.5))
                    adapted.append(hf.removesuffix(".lora_A.weight"))
                elif f".lora_B{PEFT_ADAPTER}." in name:
                    p.zero_()
            if not adapted:
                raise ValueError(f"no module of this {self.family} stage is named {sorted(targets)}")
        for name, p in self.model.named_parameters():
            trained = ".lora_" in name or name.split(".", 1)[0] in TRAINED_HEADS
            p.requires_grad_(trained and self._is_owned(name))
        self.lora_modules = sorted(adapted)
        return self.lora_modules

    # -- forward pieces -----------------------------------------------------------------------
    def context(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        """Per-micro-batch inputs every block needs (masks, positions): no parameters involved."""
        from transformers.masking_utils import create_causal_mask

        b, s = input_ids.shape
        like = torch.empty(b, s, self.config.hidden_size)
        pos = torch.arange(s).unsqueeze(0)
        if self.family in (*LLAMA_LIKE, "gpt2"):
            mask = create_causal_mask(config=self.config, inputs_embeds=like,
                                      attention_mask=attention_mask, cache=None, position_ids=pos)
            ctx = {"attention_mask": mask, "position_ids": pos}
            if self.family in LLAMA_LIKE:
                ctx["position_embeddings"] = self.model.model.rotary_emb(like, position_ids=pos)
            return ctx
        base = getattr(self.model, self.model.base_model_prefix)
        mask, _ = base._create_attention_masks(attention_mask=attention_mask, encoder_attention_mask=None,
                                               embedding_output=like, encoder_hidden_states=None, cache=None)
        return {"attention_mask": mask}

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        m = self.model
        if self.family in LLAMA_LIKE:
            return m.model.embed_tokens(input_ids)  # [b, s, h]
        if self.family == "gpt2":
            pos = torch.arange(input_ids.shape[1]).unsqueeze(0)
            return m.transformer.drop(m.transformer.wte(input_ids) + m.transformer.wpe(pos))
        base = getattr(m, m.base_model_prefix)
        return base.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)

    def head(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """[b, s, h] -> [b, num_labels], pooled as the transformers class pools."""
        m = self.model
        if self.family in (*LLAMA_LIKE, "gpt2"):
            norm = m.model.norm if self.family in LLAMA_LIKE else m.transformer.ln_f
            logits = m.score(norm(h))  # [b, s, L]
            pad = self.config.pad_token_id
            if pad is None:
                last = torch.full((h.shape[0],), h.shape[1] - 1)
            else:
                idx = torch.arange(input_ids.shape[-1], dtype=torch.int32)
                last = (idx * (input_ids != pad).to(torch.int32)).argmax(-1)
            return logits[torch.arange(h.shape[0]), last]
        if self.family == "roberta":
            return m.classifier(h)
        return m.classifier(m.dropout(m.bert.pooler(h)))

    def forward(self, x: torch.Tensor, batch: dict) -> torch.Tensor:
        """x: input ids [b, s] on the first stage, else hidden [b, s, h]. Returns hidden states,
        or on the last stage the summed cross-entropy of the micro-batch (a scalar)."""
        ids = batch["input_ids"]
        if self.span.owns_embed:
            x = self.embed(ids, batch.get("token_type_ids"))
        if len(self.span.blocks):
            ctx = self.context(ids, batch["attention_mask"])
            blocks = _get(self.model, ADAPTERS[self.family].blocks)
            for block in blocks:
                out = block(x, **ctx)
                x = out[0] if isinstance(out, tuple) else out
        if self.span.owns_head:
            logits = self.head(x, ids)
            return F.cross_entropy(logits.float(), batch["labels"], reduction="sum")
        return x
