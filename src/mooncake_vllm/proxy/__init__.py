"""``mooncake-vllm proxy``: the XpYd prefill/decode proxy (store-mediated or P2P flow)."""

from mooncake_vllm.proxy.instances import Endpoint, Instance, InstancePool, parse_endpoint
from mooncake_vllm.proxy.scheduling import POLICIES, SchedulingPolicy, make_policy
from mooncake_vllm.proxy.server import ProxyConfig, ProxyError, ProxyServer, config_from_env

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
