"""The vLLM V1 engine path: ``MooncakeStoreConnector(KVConnectorBase_V1)``.

Importing this package does not import vLLM; ``MooncakeStoreConnector`` is loaded
on first access (``mooncake_vllm.v1.connector`` needs vLLM).
"""

from __future__ import annotations

from typing import Any

__all__ = ["MooncakeStoreConnector"]


def __getattr__(name: str) -> Any:
    if name == "MooncakeStoreConnector":
        from mooncake_vllm.v1.connector import MooncakeStoreConnector

        return MooncakeStoreConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
