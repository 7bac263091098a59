"""A KV connector that does nothing: what vLLM's connector plumbing alone costs a step.

``bench_gpu_interference.py --modes noop`` loads it through ``kv_connector_module_path``
(``noop_connector``: the bench directory is on the reader's path). Every hook returns at
once, so its serving figures against ``none`` are the floor any connector starts from.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

__all__ = ["NoopConnector"]


class NoopConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """Never loads, never saves, claims nothing."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
