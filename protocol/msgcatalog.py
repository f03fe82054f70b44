"""What an owner node holds in its `allowed_dirs`, for Home Assistant's job form: the model
directories (a config.json with safetensors weights) and the data files the data loader reads.
Re-exported by `xronos.protocol.messages`.

The node scans (`xronos.node.agent.catalog`) and publishes a `NodeCatalog` retained on
`node/<id>/catalog`: at start, when its files change (a rescan every minute) and when asked by a
`CatalogRequest` (Home Assistant's Refresh files button, through the gateway). The gateway offers
these paths as the options of its Model and Data selects, and checks a form's paths against them
(a forged select value is refused before anything is submitted); the owner's inspection confines
the paths again (`confine_path`), as for any submitted job.

Every list is bounded, and so is every path: a path is a Home Assistant select option, whose
state is at most 255 characters.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, Field

from .msgtypes import Id, Message, NonNegInt, PathText, Timestamp, valid_text

MAX_CATALOG_ENTRIES = 64  # per kind: a select with more options is no longer a menu
CATALOG_PATH_MAX = 255  # Home Assistant's state length limit (a select's state is its option)
MAX_ALLOWED_DIRS = 16


def _catalog_path(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"must be an absolute path, got {value[:60]!r}")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError("a path may not contain control characters")
    return value


CatalogPath = Annotated[str, Field(min_length=2, max_length=CATALOG_PATH_MAX), BeforeValidator(valid_text),
                        AfterValidator(_catalog_path)]


class NodeCatalog(Message):
    """A node's model directories and data files (absolute paths, sorted), retained."""

    node_id: Id
    allowed_dirs: Annotated[list[PathText], Field(min_length=1, max_length=MAX_ALLOWED_DIRS)]
    models: Annotated[list[CatalogPath], Field(max_length=MAX_CATALOG_ENTRIES)]
    data: Annotated[list[CatalogPath], Field(max_length=MAX_CATALOG_ENTRIES)]
    # Found but not listed: beyond the caps, a path over 255 characters, or a scan cut short.
    left_out: NonNegInt = 0
    scanned_at: Timestamp


class CatalogRequest(Message):
    """Gateway → node: scan the allowed directories now and publish the NodeCatalog."""

    request_id: Id
