"""Transfer Engine metadata: backends, the embedded HTTP server, the redis bridge, gc.

* :mod:`.backends` / :mod:`.etcd`: ``get/put/delete/list`` against etcd, redis,
  Mooncake's HTTP protocol or memory; :func:`backend_for` parses a
  ``metadata_server`` string. P2PHANDSHAKE needs no server (and has nothing to
  list or clean).
* :mod:`.server`: ``python -m mooncake_vllm.metadata.server`` / ``mooncake-vllm metadata serve``.
* :mod:`.bridge`: :func:`resolve_metadata_url` rewrites ``redis://`` for
  Mooncake builds without the redis plugin.
* :mod:`.gc`: find and remove entries whose owner is gone.

Names are imported lazily so ``import mooncake_vllm.metadata`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "MetadataBackend",
    "backend_for",
    "bridge_redis_url",
    "collect_garbage",
    "mooncake_supports_redis",
    "resolve_metadata_url",
]

_WHERE = {
    "MetadataBackend": "backends",
    "backend_for": "backends",
    "bridge_redis_url": "bridge",
    "mooncake_supports_redis": "bridge",
    "resolve_metadata_url": "bridge",
    "collect_garbage": "gc",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
