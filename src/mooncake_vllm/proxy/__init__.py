"""``mooncake-vllm proxy``: the XpYd prefill/decode proxy (store-mediated or P2P flow).

Seed-compatible command line::

    ADMIN_API_KEY=... mooncake-vllm proxy --model Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4 \\
        --prefill localhost:8100 localhost:8101 --decode localhost:8200 [::1]:8201 \\
        --port 8000 --scheduling round_robin|least_loaded|prefix [--flow store|p2p] [--target-vllm 0.16.0]

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming or not),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /status``,
``POST /instances/add`` and ``POST /instances/remove`` (``X-API-Key: $ADMIN_API_KEY``,
body ``{"type": "prefill"|"decode", "instance": "host:port"}``; disabled without
``ADMIN_API_KEY``). Removing drains the instance's requests in flight first.
"""

from mooncake_vllm.errors import ProxyError
from mooncake_vllm.proxy.instances import Endpoint, Instance, InstancePool, parse_endpoint
from mooncake_vllm.proxy.scheduling import POLICIES, SchedulingPolicy, make_policy
from mooncake_vllm.proxy.server import ProxyConfig, ProxyServer, config_from_env

__all__ = [
    "POLICIES",
    "Endpoint",
    "Instance",
    "InstancePool",
    "ProxyConfig",
    "ProxyError",
    "ProxyServer",
    "SchedulingPolicy",
    "config_from_env",
    "make_policy",
    "parse_endpoint",
]
