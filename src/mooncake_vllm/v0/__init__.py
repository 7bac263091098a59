"""The V0 engine's ``MooncakeStoreConnector`` (vLLM 0.8.3 - 0.10.0).

Import :mod:`mooncake_vllm.v0.connector` only inside a vLLM V0 process: it
subclasses vLLM's ``KVConnectorBase``. :mod:`mooncake_vllm.v0.batch` holds the
vLLM-independent batch logic.
"""

__all__: list[str] = []
