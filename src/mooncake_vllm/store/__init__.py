"""The Mooncake store client, in rooms of its own.

=================  ==========================================================
``codes``          Mooncake's return codes by name; ``call`` (exceptions as values)
``connect``        preflight and a setup that fails fast
``timebox``        bounded worker pools with deadlines for every call
``breaker``        the circuit breaker as an immutable policy
``health``         breaker state, its background probe, rate-limited warnings
``slots``          registered staging memory in block-sized slots
``mover``          torch gather/scatter between KV cache and slots (host or CUDA)
``paths``          per-layout save capture and load verification
``transport``      the store handles ("lanes"), their time boxes, health and stats
``fetch``          staged loads: pipelined gets into slots, host verification
``direct``         zero-copy background loads into the KV blocks, verified there
``probe``          timed throw-away loads at start: the claim policy's first samples
``puts``           puts of a captured save, striped over the lanes
``client``         :class:`StoreClient`, the one client both engines use
``bridge``         redis:// metadata for wheels without redis
``namespaces``     register a key namespace in the pool; clear one
``misses``         misses caused by an error, counted by cause, logged with the fix
``holders``        a hung holder suspended (probed per holder), not the whole pool
=================  ==========================================================
"""

from mooncake_vllm.store.client import StoreClient
from mooncake_vllm.store.connect import CLIENT_ENV_DEFAULTS, pick_local_hostname
from mooncake_vllm.store.paths import SaveTicket, StagingSizes
from mooncake_vllm.store.slots import page_aligned_buffer

__all__ = ["CLIENT_ENV_DEFAULTS", "SaveTicket", "StagingSizes", "StoreClient",
           "page_aligned_buffer", "pick_local_hostname"]
