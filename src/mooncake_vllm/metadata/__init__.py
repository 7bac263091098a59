"""Transfer Engine metadata: backends, the embedded HTTP server, gc.

* :mod:`.backends` / :mod:`.etcd`: ``get/put/delete/list`` against etcd, redis,
  Mooncake's HTTP protocol or memory; :func:`backend_for` parses a
  ``metadata_server`` string. P2PHANDSHAKE needs no server (and has nothing to
  list or clean).
* :mod:`.server`: ``python -m mooncake_vllm.metadata.server`` / ``mooncake-vllm metadata serve``.
* :mod:`.gc`: find and remove entries whose owner is gone.

Names are imported lazily so ``import mooncake_vllm.metadata`` stays cheap. The
redis bridge (``redis://`` for Mooncake builds without the redis plugin) is the
runtime's: :mod:`mooncake_vllm.store.bridge`.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "MetadataBackend",
    "backend_for",
    "collect_garbage",
]

_WHERE = {
    "MetadataBackend": "backends",
    "backend_for": "backends",
    "collect_garbage": "gc",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
