"""What every model family shares: the TPModel base, dropout streams, attention, masks, losses."""

from __future__ import annotations

import contextlib
import zlib
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from xronos.node.tp.group import TPGroup
from xronos.node.tp.layers import Sharded, vocab_parallel_cross_entropy
from xronos.node.tp.layout import ShardLayout
from xronos.node.tp.lora import LORA_PARAMS
from xronos.node.tp.mappings import boundary, copy_to_tp
from xronos.node.tp.overlap import check_chunks, chunked_pass, column_region
from xronos.protocol.layout import Sizes

from .specs import TensorSpec


@contextlib.contextmanager
def _no_meta_init():
    """Skip nn.Embedding's random init while building on the meta device.

    Meta tensors hold no values, so the init is meaningless there — and in torch 2.13
    `normal_` on a meta tensor imports torch._dynamo, which costs every rank seconds at start-up.
    """
    saved = nn.init.normal_
    nn.init.normal_ = lambda tensor, *args, **kwargs: tensor
    try:
        yield
    finally:
        nn.init.normal_ = saved


TASKS = ("classify", "causal-lm")


def cfg_get(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of `keys` present in config.json (HF configs have aliases, e.g. n_embd)."""
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    return default


def cfg_require(config: dict[str, Any], *keys: str) -> Any:
    v = cfg_get(config, *keys)
    if v is None:
        raise ValueError(f"config.json lacks {' / '.join(keys)}")
    return v


def num_labels(config: dict[str, Any]) -> int:
    id2label = config.get("id2label")
    return len(id2label) if id2label else int(config.get("num_labels", 2))


class DropoutStreams:
    """Two random streams: `replicated` (same seed on every rank, so replicated layers drop the same
    elements everywhere) and `local` (distinct per rank, for partitioned activations)."""

    def __init__(self, rank: int, seed: int = 0) -> None:
        self.rank = rank
        self.seed(seed)

    def seed(self, seed: int) -> None:
        self.replicated = torch.Generator(device="cpu").manual_seed(seed)
        self.local = torch.Generator(device="cpu").manual_seed(
            zlib.crc32(f"{seed}:rank{self.rank}".encode()))


def dropout(x: torch.Tensor, p: float, gen: torch.Generator, training: bool) -> torch.Tensor:
    if not training or p == 0.0:
        return x
    keep = torch.empty_like(x).bernoulli_(1.0 - p, generator=gen).div_(1.0 - p)
    return x * keep


class Dropout(nn.Module):
    def __init__(self, p: float, streams: DropoutStreams, *, partitioned: bool = False) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.streams, self.partitioned = p, streams, partitioned

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gen = self.streams.local if self.partitioned else self.streams.replicated
        return dropout(x, self.p, gen, self.training)


def attention_mask_bool(attention_mask: torch.Tensor, causal: bool) -> torch.Tensor | None:
    """[B, S] 1/0 padding mask -> bool [B, 1, S|1, S], True = may attend (as transformers' sdpa);
    None when nothing is padded (then `attend(causal=...)` alone decides, like HF's mask skip)."""
    if bool(attention_mask.all()):
        return None
    keys = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, S]
    if not causal:
        return keys
    S = attention_mask.shape[1]
    tril = torch.ones(S, S, dtype=torch.bool, device=attention_mask.device).tril()
    return keys & tril  # [B, 1, S, S]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           attn_dropout: Dropout, causal: bool) -> torch.Tensor:
    """q [B, h, S, d], k/v [B, h_kv, S, d] (h_kv divides h: GQA), mask bool or None -> [B, S, h*d]."""
    B, h, S, d = q.shape
    if k.shape[1] not in (0, h):
        rep = h // k.shape[1]
        k = k[:, :, None].expand(B, k.shape[1], rep, S, d).reshape(B, h, S, d)
        v = v[:, :, None].expand(B, v.shape[1], rep, S, d).reshape(B, h, S, d)
    if attn_dropout.training and attn_dropout.p > 0.0:
        # Explicit path so the probabilities' dropout draws from this rank's own stream.
        if mask is None and causal:
            mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
        scores = (q @ k.transpose(-1, -2)) * scale  # [B, h, S, S]
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        y = attn_dropout(scores.softmax(dim=-1)) @ v
    else:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                           is_causal=causal and mask is None)
    return y.transpose(1, 2).reshape(B, S, h * d)


class Head(nn.Linear):
    """A task head a base checkpoint may lack: then created as transformers does (weight
    N(0, std), bias 0). Replicated."""

    def __init__(self, in_features: int, out_features: int, *, std: float, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.std = std


def param_spec(hf_name: str, module: nn.Module, name: str, local_shape: tuple[int, ...]) -> TensorSpec:
    """The spec of parameter `name` of `module`, from what the module says of it: its partition
    (`Sharded.shards`) or none (replicated), and a fresh initialisation for a `Head`."""
    dim, segments, full = None, (), list(local_shape)
    if isinstance(module, Sharded) and name in module.shards:
        dim, split = module.shards[name]
        assert local_shape[dim] == split.width, (hf_name, local_shape, split)
        segments, full[dim] = split.segments, split.full
    if name in LORA_PARAMS:  # peft's tensor names; A as peft initialises it (kaiming-uniform, a=sqrt(5)), B zeros
        hf = hf_name + ".weight"
        if name == "lora_A":
            return TensorSpec(hf, dim, segments, tuple(full), "uniform", full[1] ** -0.5)
        return TensorSpec(hf, dim, segments, tuple(full), "zeros", 0.0)
    if isinstance(module, Head):
        return TensorSpec(hf_name, dim, segments, tuple(full), "normal" if name == "weight" else "zeros",
                          module.std if name == "weight" else 0.02)
    return TensorSpec(hf_name, dim, segments, tuple(full))


class TPModel(nn.Module):
    """A model family's tensor-parallel module. Subclasses set up layers (parallel layers are told
    their `Split` of each kind, task heads are `Head`s), name them (`hf_name`) and implement
    `hidden_states` (replicated [B, S, hidden]) and the task heads."""

    hf_classes: dict[str, str] = {}
    lora_targets: tuple[str, ...] = ()  # module names LoRA may target (peft's), none = unsupported
    lora_default_targets: tuple[str, ...] = ()  # the targets when a run names none (peft's defaults)

    def __init__(self, config: dict[str, Any], task: str, layout: ShardLayout, group: TPGroup) -> None:
        super().__init__()
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        if task not in self.hf_classes:
            raise ValueError(f"{type(self).__name__} does not support task {task!r}")
        if group.world_size != layout.world_size or group.rank != layout.rank:
            raise ValueError(f"group (rank {group.rank} of {group.world_size}) does not match layout "
                             f"(rank {layout.rank} of {layout.world_size})")
        self.config, self.task, self.layout, self.group = dict(config), task, layout, group
        self.streams = DropoutStreams(layout.rank)
        if task == "classify":
            self.num_labels = num_labels(config)
            if self.num_labels < 2 or config.get("problem_type") not in (None, "single_label_classification"):
                raise ValueError(f"only single-label classification with >= 2 labels is supported, got "
                                 f"num_labels={self.num_labels}, problem_type={config.get('problem_type')}")

    @property
    def hf_class(self) -> str:
        return self.hf_classes[self.task]

    def hf_name(self, local: str) -> str:
        """The checkpoint's name of a local parameter (identity where module names mirror HF's)."""
        return local

    def tensor_specs(self) -> dict[str, TensorSpec]:
        """local parameter name -> TensorSpec, derived from the modules that hold the tensors (the
        one source of truth of every shard's place and width), in parameter order."""
        specs: dict[str, TensorSpec] = {}
        for prefix, module in self.named_modules():
            for name, p in module.named_parameters(recurse=False):
                local = f"{prefix}.{name}" if prefix else name
                specs[local] = param_spec(self.hf_name(local), module, name, tuple(p.shape))
        return specs

    def seed(self, seed: int) -> None:
        """Reset the dropout streams (call with the same seed on every rank)."""
        self.streams.seed(seed)

    def _inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        return torch.ones_like(input_ids) if attention_mask is None else attention_mask

    # Subclasses: replicated final hidden states [B, S, hidden].
    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      token_type_ids: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """classify: [B, num_labels], replicated. causal-lm: this rank's vocab slice
        [B, S, vocab_stop - vocab_start] (see `vocab_range`)."""
        attention_mask = self._inputs(input_ids, attention_mask)
        h = self.hidden_states(input_ids, attention_mask, token_type_ids)
        # The replicated head's time (and the final norm's) is its own segment, "rest".
        h = boundary(h, self.group, fwd="rest", bwd="rest")
        return self.classify_head(h, input_ids) if self.task == "classify" else self.lm_logits(h)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The loss, exactly as the transformers class computes it (identical on every rank)."""
        if labels is None:
            raise ValueError("forward needs labels; use .logits() for inference")
        logits = self.logits(input_ids, attention_mask, token_type_ids)
        if self.task == "classify":
            return F.cross_entropy(logits, labels.reshape(-1))
        # Causal LM: tokens < n predict n, the last position has no target (HF pads with -100).
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        return vocab_parallel_cross_entropy(logits, targets, self.vocab_range[0], self.group)

    # --- task heads, overridden or configured by subclasses ---
    def classify_head(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def vocab_range(self) -> tuple[int, int]:
        raise NotImplementedError

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def last_token_pool(h: torch.Tensor, input_ids: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """The hidden state at the rightmost non-pad token, as transformers' decoder classifiers pool."""
    B = input_ids.shape[0]
    if pad_token_id is None:
        if B != 1:
            raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined "
                             "(set pad_token_id in config.json)")
        last = torch.full((1,), -1, dtype=torch.long, device=h.device)
    else:
        non_pad = (input_ids != pad_token_id).to(torch.int32)
        idx = torch.arange(input_ids.shape[-1], device=h.device, dtype=torch.int32)
        last = (idx * non_pad).argmax(-1)
    return h[torch.arange(B, device=h.device), last]  # [B, hidden]


def lm_head_logits(h: torch.Tensor, weight: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Vocab-parallel logits: replicated h [B, S, hidden] x local rows [V_local, hidden]. With
    overlap on, the head's weight gradient hides the input gradient's all-reduce (`column_region`)."""
    if group.overlap and group.world_size > 1:
        return column_region(h, group, "vocab", ((weight, None, False),))[2][0]
    return F.linear(copy_to_tp(h, group, "vocab"), weight)  # [B, S, V_local]


def chunked(x: torch.Tensor, mask: torch.Tensor | None, blocks, group: TPGroup) -> torch.Tensor:
    """x [B, S, hidden] through `blocks` (each cut into stages at its all-reduces: `stages(masks)`)
    with the batch rows in `group.chunks` chunks, each chunk's all-reduces travelling while the
    next chunk computes (`overlap.run_chunked`). Row by row the same sums as the blocks' forward.
    Dropout draws its masks chunk by chunk (the same on every rank), so with dropout a chunked run
    is not bit-comparable with an unchunked one."""
    n = check_chunks(group.chunks, x.shape[0])
    masks = [None] * n if mask is None else list(torch.tensor_split(mask, n))
    return chunked_pass([s for b in blocks for s in b.stages(masks)], x, n, group)


def init_std(config: dict[str, Any]) -> float:
    return float(config.get("initializer_range", 0.02))


def gelu_fn(name: str):
    fns = {
        "gelu": F.gelu,
        "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "relu": F.relu,
        "silu": F.silu,
        "swish": F.silu,
        "tanh": torch.tanh,
        "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    }
    if name not in fns:
        raise ValueError(f"unsupported activation function {name!r} (supported: {sorted(fns)})")
    return fns[name]



ARCH_FIELDS = ("family", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
               "vocab_size", "max_positions", "num_labels", "tie_word_embeddings")


class Family:
    """A model family: which HF architectures it reads and how to build its TPModel."""

    name: str = ""
    architectures: tuple[str, ...] = ()
    model_cls: type[TPModel] = TPModel
    fan_in_fan_out = False  # weights stored [in, out] (GPT-2's Conv1D): peft's LoRA flag of that name

    @property
    def lora_targets(self) -> tuple[str, ...]:
        return self.model_cls.lora_targets

    def lora_settings(self, lora: Any):
        """The LoraSettings of a recipe's `lora` (a LoraSpec) on this family (None: full fine-tuning)."""
        from xronos.node.tp.lora import lora_settings

        if lora is None:
            return None
        return lora_settings(self.name, self.model_cls.lora_targets, self.model_cls.lora_default_targets,
                             lora.r, lora.alpha, lora.dropout, lora.targets)

    def num_units(self, config: dict[str, Any]) -> int:
        """Attention units per layer (attention heads; KV heads for GQA)."""
        raise NotImplementedError

    def sizes(self, config: dict[str, Any]) -> Sizes:
        """Totals per segment kind: attention units, MLP columns, vocabulary rows."""
        a = self.arch_spec(config, next(iter(self.model_cls.hf_classes)))
        return Sizes(attn=self.num_units(config), mlp=a["intermediate_size"], vocab=a["vocab_size"])

    def max_positions(self, config: dict[str, Any]) -> int:
        raise NotImplementedError

    def arch_spec(self, config: dict[str, Any], task: str) -> dict[str, Any]:
        """The fields of protocol.messages.ArchSpec for this checkpoint and task."""
        raise NotImplementedError

    def config_from_arch(self, arch: dict[str, Any]) -> dict[str, Any]:
        """A config.json dict of this family's shape (for random-weight profiling and benchmarks)."""
        raise NotImplementedError

    def hf_class(self, task: str) -> str:
        if task not in self.model_cls.hf_classes:
            raise ValueError(f"family {self.name} does not support task {task!r} "
                             f"(supported: {sorted(self.model_cls.hf_classes)})")
        return self.model_cls.hf_classes[task]

    def build(self, config: dict[str, Any], task: str, layout: ShardLayout, group: TPGroup, *,
              dropout: float | None = None) -> TPModel:
        """The model on the meta device (no storage): `materialize` or `init_random` fills it."""
        self.hf_class(task)
        layout.check(self.sizes(config))
        with torch.device("meta"), _no_meta_init():
            model = self.model_cls(config, task, layout, group, dropout=dropout)
        return model
