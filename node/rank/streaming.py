"""Weights stay with their owner: rank 0 streams every other rank its own slices over Gloo.

A non-owner rank has neither the model files nor the full model: it builds its shard on the meta
device from the config the owner broadcasts (`share_json`), then fills it through a
`StreamingSource`, whose `read(spec)` asks the owner for exactly that spec's segments. The owner
answers each rank in turn (`serve_shards`) from its own source — the base checkpoint at a fresh
start, the last consolidated checkpoint on resume — with slice reads, so no process ever holds
more than one rank's part of a partitioned tensor.

Wire format (tensors only, no pickle): request = int64[1] length + uint8 JSON of the spec
(length -1 = this rank is done); answer = int64[2] (status, dtype code) then, for status OK, the
tensor; for status MISSING nothing (the rank initialises it as a base checkpoint would); for
status ERROR an int64 length and the UTF-8 message.

Every length and spec a peer sends is checked before anything is allocated for it: a request is
at most `MAX_REQUEST_BYTES` of JSON describing segments inside a tensor of at most `MAX_ELEMENTS`
elements, an error text at most `MAX_TEXT_BYTES`, a shared JSON value at most `MAX_JSON_BYTES`;
the owner then serves only slices of tensors its own checkpoint holds in exactly that shape.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import torch

from xronos.node.models.loading import MissingTensorError, ShardSource, materialize
from xronos.node.models.specs import TensorSpec
from xronos.node.tp.group import TPGroup

OWNER = 0
OK, MISSING, ERROR = 0, 1, 2
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.uint8, torch.bool, torch.int8, torch.int16)
DONE = -1
MAX_REQUEST_BYTES = 64 * 1024
MAX_TEXT_BYTES = 64 * 1024
MAX_JSON_BYTES = 16 * 1024 * 1024
MAX_ELEMENTS = 2**40
MAX_DIMS = 8
MAX_SEGMENTS = 1024


def _send_bytes(group: TPGroup, data: bytes, dst: int) -> None:
    group.send(torch.tensor([len(data)], dtype=torch.int64), dst)
    group.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst)


def _checked_length(length: int, limit: int, what: str, peer: int) -> int:
    if not 0 <= length <= limit:
        raise ValueError(f"rank {peer} announced {what} of {length} bytes (allowed 0..{limit}): refused")
    return length


def _recv_bytes(group: TPGroup, src: int, length: int | None = None, limit: int = MAX_TEXT_BYTES) -> bytes:
    if length is None:
        length = int(group.recv(torch.empty(1, dtype=torch.int64), src))
    _checked_length(length, limit, "a message", src)
    return bytes(group.recv(torch.empty(length, dtype=torch.uint8), src).numpy()) if length else b""


def share_json(group: TPGroup, value: Any | None) -> Any:
    """Broadcast a JSON-able value from the owner (others pass None) and return it everywhere."""
    if group.world_size == 1:
        return value
    data = json.dumps(value).encode() if group.rank == OWNER else b""
    size = group.broadcast(torch.tensor([len(data)], dtype=torch.int64), OWNER)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if group.rank == OWNER \
        else torch.empty(_checked_length(int(size), MAX_JSON_BYTES, "a JSON value", OWNER), dtype=torch.uint8)
    group.broadcast(buf, OWNER)
    return value if group.rank == OWNER else json.loads(bytes(buf.numpy()))


def _spec_json(spec: TensorSpec) -> bytes:
    return json.dumps({"hf_name": spec.hf_name, "dim": spec.dim, "segments": spec.segments,
                       "full_shape": spec.full_shape}).encode()


def _int(x: Any, lo: int, hi: int, what: str) -> int:
    if type(x) is not int or not lo <= x <= hi:
        raise ValueError(f"{what}: expected an integer in [{lo}, {hi}], got {str(x)[:40]!r}")
    return x


def _spec_from_json(data: bytes) -> TensorSpec:
    """A peer's request, checked field by field (ValueError naming the field otherwise)."""
    try:
        d = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"shard request: not JSON: {exc}") from None
    if not isinstance(d, dict) or set(d) != {"hf_name", "dim", "segments", "full_shape"}:
        raise ValueError("shard request: expected an object with hf_name, dim, segments, full_shape")
    name, dim, segs, shape = d["hf_name"], d["dim"], d["segments"], d["full_shape"]
    if not isinstance(name, str) or not 0 < len(name) <= 1024:
        raise ValueError("shard request: hf_name must be a string of 1..1024 characters")
    if not isinstance(shape, list) or not 0 <= len(shape) <= MAX_DIMS:
        raise ValueError(f"shard request: full_shape must be a list of at most {MAX_DIMS} sizes")
    full = tuple(_int(x, 0, MAX_ELEMENTS, "shard request: full_shape") for x in shape)
    if math.prod(full) > MAX_ELEMENTS:
        raise ValueError(f"shard request: full_shape {list(full)} has more than {MAX_ELEMENTS} elements")
    if dim is not None:
        dim = _int(dim, 0, max(len(full) - 1, 0), "shard request: dim")
    if not isinstance(segs, list) or len(segs) > MAX_SEGMENTS or (dim is None and segs):
        raise ValueError("shard request: segments must be a short list (empty for a replicated tensor)")
    segments = []
    for seg in segs:
        if not isinstance(seg, list) or len(seg) != 2:
            raise ValueError("shard request: each segment is [start, stop]")
        a = _int(seg[0], 0, full[dim], "shard request: segment start")
        b = _int(seg[1], a, full[dim], "shard request: segment stop")
        segments.append((a, b))
    return TensorSpec(name, dim, tuple(segments), full)


class StreamingSource:
    """A ShardSource on a non-owner rank: each read is answered by the owner. Call `close()` when
    done so the owner moves on to the next rank."""

    def __init__(self, group: TPGroup) -> None:
        if group.rank == OWNER:
            raise ValueError("the owner reads its own files; StreamingSource is for the other ranks")
        self.group = group
        self.bytes_received = 0

    def read(self, spec: TensorSpec) -> torch.Tensor:
        _send_bytes(self.group, _spec_json(spec), OWNER)
        status, code = self.group.recv(torch.empty(2, dtype=torch.int64), OWNER).tolist()
        if status == MISSING:
            raise MissingTensorError(f"tensor {spec.hf_name} not found on the owner")
        if status == ERROR:
            text = _recv_bytes(self.group, OWNER).decode(errors="replace")
            raise ValueError(f"owner could not read {spec.hf_name}: {text}")
        if status != OK or not 0 <= code < len(DTYPES):
            raise ValueError(f"owner answered {spec.hf_name} with status {status}, dtype code {code}: refused")
        out = torch.empty(spec.local_shape, dtype=DTYPES[code])
        self.bytes_received += out.numel() * out.element_size()
        return self.group.recv(out, OWNER)

    def close(self) -> None:
        self.group.send(torch.tensor([DONE], dtype=torch.int64), OWNER)


def serve_shards(group: TPGroup, source: ShardSource) -> int:
    """Owner: answer every other rank's reads from `source` until it closes. Returns bytes sent."""
    sent = 0
    for rank in range(1, group.world_size):
        while True:
            length = int(group.recv(torch.empty(1, dtype=torch.int64), rank))
            if length == DONE:
                break
            # A bad length desynchronises the stream: refusing it ends the job (the rank is broken).
            request = _recv_bytes(group, rank, _checked_length(length, MAX_REQUEST_BYTES, "a shard request", rank),
                                  limit=MAX_REQUEST_BYTES)
            try:
                spec = _spec_from_json(request)
                t = source.read(spec).contiguous()
                if tuple(t.shape) != spec.local_shape or t.dtype not in DTYPES:
                    raise ValueError(f"{spec.hf_name}: read {list(t.shape)} {t.dtype}, the request implies "
                                     f"{list(spec.local_shape)}")
            except MissingTensorError:
                group.send(torch.tensor([MISSING, 0], dtype=torch.int64), rank)
                continue
            except (ValueError, KeyError, OSError) as exc:
                group.send(torch.tensor([ERROR, 0], dtype=torch.int64), rank)
                _send_bytes(group, str(exc).encode()[:MAX_TEXT_BYTES], rank)
                continue
            group.send(torch.tensor([OK, DTYPES.index(t.dtype)], dtype=torch.int64), rank)
            group.send(t, rank)
            sent += t.numel() * t.element_size()
    return sent


def load_shard(model: torch.nn.Module, group: TPGroup, owner_source: ShardSource | None,
               then: Callable[[ShardSource], None] | None = None) -> None:
    """Fill a meta-device model on every rank: the owner from `owner_source`, the others streamed
    from it. `then(source)` runs on every rank before the owner moves on (e.g. optimizer state)."""
    if group.rank == OWNER:
        assert owner_source is not None, "the owner needs a source"
        materialize(model, owner_source)
        if then is not None:
            then(owner_source)
        serve_shards(group, owner_source)
        return
    source = StreamingSource(group)
    try:
        materialize(model, source)
        if then is not None:
            then(source)
    finally:
        source.close()
