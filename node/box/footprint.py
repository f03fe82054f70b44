"""What a profile or a training rank will ask of this box, predicted from the model's shape before
anything is started: the node refuses work that cannot fit (`node/box/limits.py` caps what it starts).

Pure arithmetic over an `ArchSpec`; no torch, no I/O. It is a prediction from the shape, not the
gateway's cost model (which needs a profile: the profile is what is being checked here). For a
rank it counts what surely is allocated, so that a refusal is never a false alarm; a profile's
batch-dependent bytes are scaled by what one measured (`profile_estimate`). What it leaves out
(allocator holes, kernels' scratch) is what the child's hard limit is there for.

    peak = runtime + weights x (4 bytes, + 12 of gradients and AdamW moments unless frozen)
           + saved activations (4 bytes x batch x seq x per-token widths, per block)
           + the output logits and their gradient (causal LM: batch x seq x vocabulary rows x 8 bytes)

Per token and block the saved activations are the block's input and its norms' (4 h), Q, K, V and
the attention output (2 h + 2 kv), the attention scores and probabilities (2 x heads x seq: the
explicit path attention takes under dropout) and the MLP's up/activation (2 f, gated families 3 f). A rank holds its shares of
each kind (attention heads, MLP columns, vocabulary rows); the replicated parts in full.
"""

from __future__ import annotations

from dataclasses import dataclass

from xronos.protocol.messages import ArchSpec

MiB = 1 << 20
RUNTIME_BYTES = 256 * MiB  # python + torch + its kernels, right after the imports (node/measure/memprobe.runtime_rss)
GATED = ("llama", "qwen2", "qwen3")  # MLP with a gate projection: three matrices, not two
ABSOLUTE_POSITIONS = ("gpt2", "bert", "roberta")  # a learned position embedding


@dataclass(frozen=True)
class Footprint:
    """Predicted bytes by part; `total` is what is checked against the box."""

    runtime: int
    states: int  # weights, and unless frozen their gradients and AdamW's two moments
    activations: int
    logits: int

    @property
    def total(self) -> int:
        return self.runtime + self.states + self.activations + self.logits

    def describe(self) -> str:
        return (f"{self.total / MiB:,.0f} MiB (weights and optimizer {self.states / MiB:,.0f}, activations "
                f"{self.activations / MiB:,.0f}, output logits {self.logits / MiB:,.0f}, runtime "
                f"{self.runtime / MiB:,.0f})")


def _block_params(arch: ArchSpec, attn: float, mlp: float) -> float:
    h, f = arch.hidden_size, arch.intermediate_size
    kv = arch.num_kv_heads * (h // arch.num_heads)
    attention = (h * (h + 2 * kv) + h * h) * attn
    return attention + (3 if arch.family in GATED else 2) * h * f * mlp + 4 * h


def _block_acts_per_token(arch: ArchSpec, seq: int, attn: float, mlp: float, scores: bool) -> float:
    h, f = arch.hidden_size, arch.intermediate_size
    kv = arch.num_kv_heads * (h // arch.num_heads)
    attention = (2 * h + 2 * kv + (2 * arch.num_heads * seq if scores else 0)) * attn
    return 4 * h + attention + (3 if arch.family in GATED else 2) * f * mlp


def estimate(arch: ArchSpec, task: str, batch: int, seq: int, *, blocks: int | None = None, attn: float = 1.0,
             mlp: float = 1.0, vocab: float = 1.0, lora: bool = False, scores: bool = True) -> Footprint:
    """The peak of a process training `blocks` (None: all) blocks of `arch` holding these shares of
    each kind, at `batch` x `seq` (see the module docstring). `scores` False: attention without
    dropout, which runs fused (torch's scaled_dot_product_attention, node/models/common.attend) and
    keeps no seq x seq matrices."""
    for name, share in (("attn", attn), ("mlp", mlp), ("vocab", vocab)):
        if not 0 <= share <= 1:
            raise ValueError(f"{name} share must be in [0, 1], got {share}")
    n_blocks = arch.num_layers if blocks is None else blocks
    h, V = arch.hidden_size, arch.vocab_size
    params = n_blocks * _block_params(arch, attn, mlp) + V * h * vocab
    if arch.family in ABSOLUTE_POSITIONS:
        params += arch.max_positions * h
    if task == "causal-lm" and not arch.tie_word_embeddings:
        params += V * h * vocab
    if task == "classify":
        params += h * h + h * (arch.num_labels or 2)
    tokens = batch * seq
    acts = n_blocks * tokens * _block_acts_per_token(arch, seq, attn, mlp, scores) + 2 * tokens * h
    logits = 2 * tokens * V * vocab if task == "causal-lm" else 0
    return Footprint(runtime=RUNTIME_BYTES, states=int(params * (4 if lora else 16)), activations=int(4 * acts),
                     logits=int(4 * logits))


PROFILE_TRANSIENT = 3  # a profile's batch-dependent bytes over one iteration's (see profile_estimate)


def profile_estimate(arch: ArchSpec, task: str, batch: int, seq: int, lora: bool) -> Footprint:
    """A profile's child: the one-block profiling set at full width (its widest run), its activations
    and logits `PROFILE_TRANSIENT` times over. The child keeps the freed blocks of its three widths'
    runs in its heap (the ranks' allocator setting, node/measure/allocator.py), times under torch's memory
    profiler, and its heap probes run beside it: a 64-wide GPT-2 shape (vocabulary 1000) at batch
    256 x seq 128 peaked at 1,870 MiB (the child and its probe, resident), 1,614 above the runtime,
    where one iteration's activations and logits are 523 MiB (3.1x; load ~8 on 2 cores). The weights'
    states are counted once: they are exact, and a model's weights do not pile up like this."""
    one = estimate(arch, task, batch, seq, blocks=1, lora=lora)
    return Footprint(runtime=one.runtime, states=one.states, activations=PROFILE_TRANSIENT * one.activations,
                     logits=PROFILE_TRANSIENT * one.logits)
