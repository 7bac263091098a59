"""Each instance's own load and cache counters, read from its ``GET /metrics`` (vLLM's Prometheus text).

The proxy polls every instance in rotation every ``engine_metrics_interval`` seconds
(time-boxed like a health check; a failure is counted, never fatal) and keeps the last
answer on the instance (``Instance.engine``). ``kv_aware`` weighs requests the engine
reports running or waiting beyond the proxy's own in flight at that answer (other clients');
the proxy's ``/metrics`` repeats each instance's counters as
``mooncake_proxy_instance_*`` so one scrape shows the fleet: prompt tokens, tokens served
from its own prefix cache (``source="hbm"``) and through the connector (``source="pool"``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from mooncake_vllm.httpsafe import read_answer

__all__ = ["VLLM_METRICS", "EngineLoad", "parse", "poll_loop", "render", "scrape"]

log = logging.getLogger(__name__)

#: our name -> vLLM's metric (a counter may carry ``_total``; label sets are summed: DP ranks, engines)
VLLM_METRICS: dict[str, str] = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_usage": "vllm:kv_cache_usage_perc",
    "prompt_tokens": "vllm:prompt_tokens",
    "hbm_hit_tokens": "vllm:prefix_cache_hits",
    "pool_hit_tokens": "vllm:external_prefix_cache_hits",
    # histogram sums: kv_aware's measured prefill rate (proxy.kv_speed)
    "prefill_tokens": "vllm:request_prefill_kv_computed_tokens_sum",
    "prefill_seconds": "vllm:request_prefill_time_seconds_sum",
    "prefill_requests": "vllm:request_prefill_kv_computed_tokens_count",
}
_ANSWER_LIMIT = 4 << 20
_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)", re.M)


def parse(text: str) -> dict[str, float]:
    """Our names (``VLLM_METRICS``) -> the sum over label sets; names absent are left out."""
    wanted = {m: k for k, m in VLLM_METRICS.items()}
    wanted.update({m + "_total": k for k, m in VLLM_METRICS.items()})
    out: dict[str, float] = {}
    for m in _LINE.finditer(text):
        key = wanted.get(m.group(1))
        if key is None:
            continue
        try:
            value = float(m.group(2))
        except ValueError:
            continue
        out[key] = out.get(key, 0.0) + value
    return out


@dataclass(frozen=True)
class EngineLoad:
    """One answer of an instance's ``/metrics``; ``at`` is ``time.monotonic()`` when it came."""

    at: float
    max_age: float
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prompt_tokens: float = 0.0
    hbm_hit_tokens: float = 0.0
    pool_hit_tokens: float = 0.0
    prefill_tokens: float = 0.0  # computed (not cached) prompt tokens, summed over requests
    prefill_seconds: float = 0.0  # seconds requests spent in prefill, summed
    prefill_requests: float = 0.0  # finished prefills those sums are over (0 if it does not say)
    #: this proxy's requests in flight on the instance when the answer came
    ours: int = 0

    @property
    def requests(self) -> int:
        """Requests the engine holds, running or waiting."""
        return int(self.running + self.waiting)

    @property
    def others(self) -> int:
        """Requests the engine held beyond this proxy's own in flight then (other clients')."""
        return max(0, self.requests - self.ours)

    def fresh(self, now: float | None = None) -> bool:
        """Younger than ``max_age`` (an old answer says nothing about the load now)."""
        return (time.monotonic() if now is None else now) - self.at <= self.max_age

    @classmethod
    def from_metrics(cls, values: Mapping[str, float], max_age: float, at: float | None = None,
                     ours: int = 0) -> EngineLoad:
        return cls(at=time.monotonic() if at is None else at, max_age=max_age, ours=ours,
                   **{k: float(v) for k, v in values.items() if k in VLLM_METRICS})


class _Target(Protocol):
    url: str
    key: str
    in_flight: int
    engine: EngineLoad | None
    engine_failures: int


class _Server(Protocol):
    session: aiohttp.ClientSession | None
    pool: Any
    config: Any
    kv: Any  # kv_aware's router (it calibrates the pool's cost from the answers), or None


async def scrape(session: aiohttp.ClientSession, inst: _Target, timeout: float, max_age: float) -> bool:
    """Read one instance's ``/metrics`` into ``inst.engine``; False (counted) on any failure."""
    try:
        async with session.get(inst.url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout)) as up:
            if up.status != 200:
                raise ValueError(f"HTTP {up.status}")
            text = (await read_answer(up, _ANSWER_LIMIT)).decode("utf-8", "replace")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        inst.engine_failures += 1
        if inst.engine_failures == 1:
            log.info("could not read %s/metrics (%s); its engine load is unknown until it answers",
                     inst.url, type(exc).__name__)
        return False
    values = parse(text)
    if values:
        inst.engine = EngineLoad.from_metrics(values, max_age, ours=inst.in_flight)
    return bool(values)


async def poll_loop(server: _Server) -> None:
    """Scrape every available instance every ``engine_metrics_interval`` seconds until cancelled."""
    interval = server.config.engine_metrics_interval
    while True:
        insts = [i for k in ("prefill", "decode") for i in server.pool.available(k)]
        if server.session is not None and insts:
            await asyncio.gather(*(scrape(server.session, i, server.config.health_timeout, 3 * interval)
                                   for i in insts), return_exceptions=True)
            if server.kv is not None:
                server.kv.calibrate(insts)
        await asyncio.sleep(interval)


def _lab(inst: Any, **extra: str) -> str:
    labels = {"kind": inst.kind, "instance": inst.key, **extra}
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


#: proxy metric, type, help, then (EngineLoad field, extra labels) per line of each instance
_RENDERED: tuple[tuple[str, str, str, tuple[tuple[str, dict[str, str]], ...]], ...] = (
    ("mooncake_proxy_instance_engine_requests", "gauge", "Requests the instance's engine reported, by state.",
     (("running", {"state": "running"}), ("waiting", {"state": "waiting"}))),
    ("mooncake_proxy_instance_kv_cache_usage", "gauge", "The instance's KV cache use (0-1), as it reported.",
     (("kv_usage", {}),)),
    ("mooncake_proxy_instance_prompt_tokens_total", "counter", "Prompt tokens the instance reported.",
     (("prompt_tokens", {}),)),
    ("mooncake_proxy_instance_cached_tokens_total", "counter", "Prompt tokens the instance served from its own "
     "prefix cache (hbm) or through its KV connector (pool), as it reported.",
     (("hbm_hit_tokens", {"source": "hbm"}), ("pool_hit_tokens", {"source": "pool"}))),
)


def render(instances: Iterable[Any]) -> str:
    """The ``mooncake_proxy_instance_*`` lines of the instances' last engine answers."""
    every = list(instances)
    insts = [i for i in every if i.engine is not None]
    out: list[str] = []
    for metric, mtype, help_text, fields in _RENDERED:
        out += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {mtype}"]
        out += [f"{metric}{_lab(i, **extra)} {getattr(i.engine, name):g}" for i in insts for name, extra in fields]
    metric = "mooncake_proxy_instance_engine_metrics_failures_total"
    out += [f"# HELP {metric} Failed reads of the instance's /metrics.", f"# TYPE {metric} counter"]
    out += [f"{metric}{_lab(i)} {i.engine_failures}" for i in every]
    return "\n".join(out) + "\n"
