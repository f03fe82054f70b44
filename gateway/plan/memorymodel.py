"""A TP rank's predicted memory: Eq. 8-10 per segment kind, and the peak resident set a cgroup caps.

Pure Python over the cost model's folded coefficients (`costmodel.NodeCost`, built by
`costmodel.node_cost`, whose docstring explains the segments and the time fit).

**Memory** (Eq. 8-10, per kind): `M = M_repl + sum_k m_k * s_k + max(M_t,repl, max_k mt_k * s_k)`
with `m_k` the kind's partitioned M_w + M_a at share 1 (block layers times B) and `mt_k` its
largest partitioned temporary buffer at share 1 — Eq. 10's max over layers, never a sum.

**Peak memory.** What the kernel counts (and a cgroup caps) is the rank's resident set, which
holds more than Eq. 8's tensors; `predict_memory` predicts that peak:

    peak = R + M - min(A, G) + max(L, H)    L = max(L_repl, max_k l_k * s_k)

`R` = the profile's `runtime_bytes`, the process without any model once warm (Python, torch,
its kernels and thread pools; measured, not assumed); `l_k` = the kind's largest single
parameter at share 1 — loading reads each parameter's slice into a buffer and copies it in, and
under the training ranks' allocator setting (freed blocks stay in the heap) that buffer stays
resident. `H` = the heap's free holes during training (`heap_slack`): under the same setting
the heap keeps every block it spread to, and blocks of mixed sizes leave free gaps they do not
fit. The profile measures them on the trainer's own iteration (`node/measure/heapprobe.py`: the heap's
span minus its in-use peak, settled) with one block at full width and at its smallest width, and
with four blocks at the smallest width (the smallest width's two depths the medians of three
fresh processes, profiler version 9: one draw's growth was off by half); `H` counts the one-block
holes plus (B - 1) times what a further block added (each block is one more round of the same
allocations: 236, 291, 352 MiB at 1, 2, 3 blocks of a qwen2.5-1.5b LoRA rank at seq 256; the
probes' medians at 1, 4, 6 blocks of the grid's RoBERTa-base shape 38, 74, 104 MiB, and its ranks
at 6 blocks held 102-116 MiB free at the end of their steps: bench/results/mem-peak-v9.md, where
a cap at the probed depth was tried and left out), and goes between the two widths by the
rank's transient bytes
`W(s) = sum over layers of (M_a + M_t + gradients) * s_kind` (1 for a replicated layer; the
vocabulary's layers left out), one block each: linear between them, flat below the smallest.
Loading's buffer and training's holes are the same free space — training's blocks fill the
loading buffer's gap where they fit — hence the max, not a sum: a GPT-2-medium rank's heap held
49 MiB free at the end of its steps, with L = 49 and H = 51 MiB predicted.
`A` and `G` are the rank's saved activations and its gradients (the M_a and the gradient part of
M_w above, summed at its shares): Eq. 9 counts both, but they are not resident together — backward
frees each block's saved activations as it makes that block's gradients, so the live set runs from
all of A (backward's start) to all of G (its end, the step) and its peak is the larger, the
smaller never being added. Measured on the trainer's iteration (`node/measure/heapprobe.py`, in use at its
peak, 1/4/6 blocks at the smallest profiled width): each further block added exactly its M_w, 48.2
MiB per GPT-2-medium block (M_w 48.1, M_a 7.0) and 27.1 per RoBERTa-base block at seq 64 (M_w 27.1,
M_a 10.5, larger than its gradients: the embedding's and the head's gradients make G the larger
in total); bench/results/mem-peak-v10.md.
Measured on real `xronos run` ranks (`python -m xronos.bench.mem_peak`), this is within
a few percent of VmHWM; the optimizer state is allocated at build (`node/rank/optstate.py`) and the
clipping pass is chunked (`node/rank/gradnorm.py`), without which neither term would hold.
Rank 0, the owner (`NodeCost.owner`, set by the planner for the first node), also holds the data
stack (`owner_bytes`, measured by the profile) and gathers the export at the end
(`owner_peak`): its peak is the higher of the two.
"""

from __future__ import annotations

from xronos.gateway.plan.costmodel import HOLE_KINDS, KINDS, NodeCost, Shares, check_shares, tied


def predict_memory(node: NodeCost, shares: Shares) -> float:
    """The rank's peak resident set, in bytes: M_total (Eq. 8) = M_w + M_a (Eq. 9, per kind) +
    M_t (Eq. 10's max), less what never coexists (the smaller of the activations and the
    gradients), plus the process without its model and loading's largest buffer (see the module
    docstring, "Peak memory")."""
    check_shares(shares)
    temp = max([node.temp_repl] + [node.kind(k).temp_slope * shares[k] for k in KINDS])
    load = max([node.load_repl] + [node.kind(k).load_slope * shares[k] for k in KINDS])
    model = node.mem_repl + sum(node.kind(k).mem_slope * shares[k] for k in KINDS)
    train = node.mem_runtime + model - not_coexisting(node, shares) + temp + max(load, heap_slack(node, shares))
    return owner_peak(node, model, train, shares) if node.owner else train


def not_coexisting(node: NodeCost, shares: Shares) -> float:
    """min(A, G): the smaller of the rank's saved activations and its gradients, which Eq. 9
    counts beside the larger but which is never resident with all of it (module docstring)."""
    acts = node.act_repl + sum(node.kind(k).act_slope * shares[k] for k in KINDS)
    grads = node.grad_repl + sum(node.kind(k).grad_slope * shares[k] for k in KINDS)
    return min(acts, grads)


def heap_slack(node: NodeCost, shares: Shares) -> float:
    """The heap's free holes on a rank holding `shares` (see the module docstring), as a function
    of the rank's transient bytes W(s): measured at full width (W(1)) and, with a profile of
    version 8, at its smallest width (W_q); linear between the two and flat below W_q (the holes
    of the smallest width measured: an over- rather than an under-prediction). Without the second
    width: the full width's holes times W(s) / W(1). The holes do not shrink in proportion: a
    qwen2.5-1.5b LoRA block at seq 256 kept 367 MiB at full width and 236 at a rank's shape with
    W(s) / W(1) = 0.44; a MobileLLaMA-1.4B full fine-tune block 83 and 43 at a quarter of every
    kind (W ratio 0.35). The vocabulary's transient bytes (a full fine-tune's dense embedding
    gradient: 200 of the 270 MiB of W(1) on GPT-2-medium) are left out of W: a rank without
    vocabulary rows kept 67 MiB of holes where its peers with half the rows kept 79-87 (2 blocks)."""
    return holes_at_work(node, node.work_repl + sum(node.kind(k).work_slope * shares[k] for k in HOLE_KINDS))


def holes_at_work(node: NodeCost, w: float) -> float:
    """`heap_slack` as a function of the rank's transient bytes W(s) (the planner computes W
    itself, linear in the shares, without building a shares mapping per test)."""
    full = node.work_repl + sum(node.kind(k).work_slope for k in HOLE_KINDS)
    if node.heap_slack <= 0 or full <= 0:
        return 0.0
    if not 0 < node.small_work < full:
        return node.heap_slack * w / full
    if w <= node.small_work:
        return node.small_slack
    return max(node.small_slack, node.small_slack + (node.heap_slack - node.small_slack)
               * (w - node.small_work) / (full - node.small_work))


def owner_peak(node: NodeCost, model: float, train: float, shares: Shares) -> float:
    """Rank 0's peak: its data stack on top of training, or the export, whichever is higher. The
    export gathers the whole model's weights while the rank's own gradients and activations are
    freed (their shares of M_w + M_a: `grad_fraction`, `act_fraction`), and receives each peer's
    slice of a tensor into a buffer before placing it (`node/models/export.gather_full`): the
    largest such buffer is at most the rest of the kind's largest tensor, `l_k * (1 - s_k)` (exact
    with one peer; with more it is an upper bound: the largest peer's slice). Under LoRA without
    the merged model (`export_all` False) only the adapters and a classifier's head are gathered.
    A job's consolidated checkpoint (`checkpoints`) gathers the trained tensors and both their
    AdamW moments: three times the trained bytes, the whole weights in full fine-tuning, the
    adapters and head under LoRA (from `node/rank/checkpoint.py`; not measured yet). A profile that did
    not measure the process (runtime_bytes 0, from before profiler version 6) predicts Eq. 8 for
    the owner too."""
    if node.mem_runtime <= 0:
        return train
    if not (node.exports or node.checkpoints):
        return node.owner_bytes + train
    written = node.weights_full if node.export_all else node.trained_full
    gathered = max(written if node.exports else 0.0,
                   3 * node.trained_full if node.checkpoints else 0.0)  # trained tensors + both moments
    # The rest of the kind's largest tensor shrinks as the rank's own share grows, but the planner
    # needs memory nondecreasing in every share (its binary searches, alone caps, the "cannot even
    # hold the replicated layers" test and the DP's pruning assume it). Where the weights kept grow
    # slower than the buffer shrinks (LoRA with a merged export: a frozen embedding's M_w is its
    # weights alone, scaled by the global 1 - grad - act), hold the buffer at its largest instead.
    kept = 1 - node.grad_fraction - node.act_fraction
    received = max(node.kind(k).load_slope
                   - min(node.kind(k).load_slope, node.kind(k).mem_slope * kept) * shares[k] for k in KINDS)
    if not node.export_all:  # an adapter-only export receives adapters' slices: small
        received = min(received, node.trained_full)
    export = node.mem_runtime + model * (1 - node.grad_fraction - node.act_fraction) + gathered + received
    return node.owner_bytes + max(train, export)


def memory_at(node: NodeCost, p: float) -> float:
    """The paper's M_total(p) (Eq. 8): every kind at share p."""
    return predict_memory(node, tied(p))
