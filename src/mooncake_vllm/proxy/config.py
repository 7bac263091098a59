"""The proxy's configuration: one dataclass, and the keys it reads from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ProxyConfig", "config_from_env"]


@dataclass
class ProxyConfig:
    """Everything the proxy needs; ``prefill``/``decode`` are ``host:port`` strings."""

    model: str
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    scheduling: str = "round_robin"
    flow: str = "store"
    target_vllm: str | None = None  # p2p only; None = ask the instances' GET /version
    admin_api_key: str | None = field(default=None, repr=False)  # None/empty: admin endpoints disabled (403)
    upstream_api_key: str | None = field(default=None, repr=False)  # sent as Bearer when the client sends none
    health_interval: float = 5.0
    health_timeout: float = 2.0
    health_failures: int = 2  # consecutive failed checks before leaving rotation
    unavailable_wait: float = 5.0  # a request finding no instance of a kind waits this long for one
    connect_timeout: float = 5.0
    request_timeout: float | None = None  # whole upstream request; None = no limit
    drain_timeout: float = 300.0
    max_body_bytes: int = 64 << 20  # one client request body (413 above)
    max_upstream_bytes: int = 256 << 20  # one buffered upstream answer (prefill, non-streamed decode)
    header_timeout: float = 10.0  # a client's request head must arrive within this
    body_timeout: float = 60.0  # ... and its body within this (408 otherwise)
    idle_timeout: float = 60.0  # idle keep-alive client connections close after this
    max_connections: int = 4096  # open client connections (always kept below the descriptor limit)
    kv_events: str = "tcp://127.0.0.1:5557"  # kv_aware: the SUB socket the instances publish KV events to
    kv_tokenize_timeout: float = 2.0  # kv_aware: one instance /tokenize (and /version) call
    tokenizer: str | None = None  # kv_aware: the served model's tokenizer dir (completions tokenized here)
    kv_replay: dict[str, str] | list[str] = field(default_factory=dict)  # kv_aware: host:port -> replay socket
    kv_queue_cap: int = 0  # kv_aware: requests on an instance beyond which it picks another; 0 = no cap
    engine_metrics_interval: float = 1.0  # seconds between reads of each instance's /metrics; 0 = never


def config_from_env(**kwargs: Any) -> ProxyConfig:
    """A ProxyConfig whose keys come from ``ADMIN_API_KEY`` / ``OPENAI_API_KEY``."""
    kwargs.setdefault("admin_api_key", os.environ.get("ADMIN_API_KEY") or None)
    kwargs.setdefault("upstream_api_key", os.environ.get("OPENAI_API_KEY") or None)
    return ProxyConfig(**kwargs)
