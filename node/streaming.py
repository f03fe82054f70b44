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
"""

from __future__ import annotations

import json
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


def _send_bytes(group: TPGroup, data: bytes, dst: int) -> None:
    group.send(torch.tensor([len(data)], dtype=torch.int64), dst)
    group.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst)


def _recv_bytes(group: TPGroup, src: int, length: int | None = None) -> bytes:
    if length is None:
        length = int(group.recv(torch.empty(1, dtype=torch.int64), src))
    return bytes(group.recv(torch.empty(length, dtype=torch.uint8), src).numpy()) if length else b""


def share_json(group: TPGroup, value: Any | None) -> Any:
    """Broadcast a JSON-able value from the owner (others pass None) and return it everywhere."""
    if group.world_size == 1:
        return value
    data = json.dumps(value).encode() if group.rank == OWNER else b""
    size = group.broadcast(torch.tensor([len(data)], dtype=torch.int64), OWNER)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if group.rank == OWNER \
        else torch.empty(int(size), dtype=torch.uint8)
    group.broadcast(buf, OWNER)
    return value if group.rank == OWNER else json.loads(bytes(buf.numpy()))


def _spec_json(spec: TensorSpec) -> bytes:
    return json.dumps({"hf_name": spec.hf_name, "dim": spec.dim, "segments": spec.segments,
                       "full_shape": spec.full_shape}).encode()


def _spec_from_json(data: bytes) -> TensorSpec:
    d = json.loads(data)
    return TensorSpec(d["hf_name"], d["dim"], tuple(tuple(s) for s in d["segments"]), tuple(d["full_shape"]))


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
            raise ValueError(f"owner could not read {spec.hf_name}: {_recv_bytes(self.group, OWNER).decode()}")
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
            spec = _spec_from_json(_recv_bytes(group, rank, length))
            try:
                t = source.read(spec).contiguous()
            except MissingTensorError:
                group.send(torch.tensor([MISSING, 0], dtype=torch.int64), rank)
                continue
            except (ValueError, KeyError, OSError) as exc:
                group.send(torch.tensor([ERROR, 0], dtype=torch.int64), rank)
                _send_bytes(group, str(exc).encode(), rank)
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
