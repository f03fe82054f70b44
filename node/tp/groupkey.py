"""Only a job's own ranks train together: right after joining, every rank proves that it holds
the world's key, before the facts, a weight slice or a batch go out.

torch's TCPStore (the rendezvous) accepts whoever connects to its port, on every interface, and
Gloo trusts whatever arrives: a host that joined a job's world as rank r would be streamed rank
r's weight slices and every batch's token ids, and could send back poisoned gradients. The key is
32 random bytes per world — the gateway's per plan version (in each `Assignment`, which only the
node's own MQTT user may read), `spawn_ranks`' per local run — and the proof is a challenge:
every rank contributes a fresh nonce, then sends HMAC-SHA256(key, all nonces || its rank), and
every rank checks every other's. A rank whose answer is wrong is named and the world stops. A
stranger can still stop a job (by joining first, or by never answering): a denial of service,
not a leak.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets

KEY_RE = re.compile(r"^[0-9a-f]{64}$")  # 32 bytes, lower-case hex


class GroupAuthError(RuntimeError):
    """A rank of this world did not prove it holds the world's key."""


def new_key() -> str:
    return secrets.token_hex(32)


def answer(key: bytes, nonces: bytes, rank: int) -> bytes:
    """Rank `rank`'s proof for this round's nonces (every rank's, in rank order)."""
    return hmac.new(key, nonces + rank.to_bytes(4, "big"), hashlib.sha256).digest()


def _bytes(t) -> bytes:
    return t.numpy().tobytes()


def _tensor(b: bytes):
    import torch  # here: the launcher makes keys without loading torch

    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def prove(group, key_hex: str) -> None:
    """Every rank of `group` (a `TPGroup` just joined) shows it holds `key_hex`; raises
    GroupAuthError naming the ranks that did not. Two untimed all-gathers of 32 bytes."""
    if not KEY_RE.match(key_hex):
        raise ValueError("group key: 64 lower-case hex digits expected")
    if group.world_size == 1 or group.alone:
        return
    key = bytes.fromhex(key_hex)
    nonces = b"".join(_bytes(t) for t in group.all_gather(_tensor(os.urandom(32)), timed=False))
    if len(nonces) != 32 * group.world_size:
        raise GroupAuthError(f"the group's nonces are {len(nonces)} bytes, expected {32 * group.world_size}")
    tags = group.all_gather(_tensor(answer(key, nonces, group.rank)), timed=False)
    wrong = [r for r, t in enumerate(tags) if not hmac.compare_digest(_bytes(t), answer(key, nonces, r))]
    if wrong:
        raise GroupAuthError(
            f"rank{'s' if len(wrong) > 1 else ''} {', '.join(map(str, wrong))} of this world did not prove "
            f"the job's key: a process that is not one of the job's ranks joined the rendezvous "
            f"(a host on the network, or a stale rank of another plan); stopping before any data moves")
