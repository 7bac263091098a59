"""Upstream vLLM instances: address parsing, per-instance state, the pool.

Addresses are ``host:port`` with ``host`` an IPv4 literal, a bracketed IPv6
literal (``[::1]:8100``) or a DNS name (``localhost``, ``prefill-0.svc``), with
an optional ``http://`` / ``https://`` scheme and an optional P2P bootstrap port
after ``@`` (``10.0.0.2:8100@8998``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field

from mooncake_vllm.addresses import HOST_PORT_FIX, HostPort
from mooncake_vllm.errors import ConfigError, ConfigProblem
from mooncake_vllm.proxy.engine_load import EngineLoad

__all__ = ["KINDS", "Endpoint", "Instance", "InstancePool", "parse_endpoint"]

#: the two instance kinds of a disaggregated deployment
KINDS: tuple[str, str] = ("prefill", "decode")


@dataclass(frozen=True)
class Endpoint:
    """One upstream address; ``key`` is its canonical ``host:port`` form."""

    host: str  # without brackets
    port: int
    scheme: str = "http"
    bootstrap_port: int | None = None

    @property
    def netloc(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def key(self) -> str:
        return self.netloc

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.netloc}"

    @property
    def bootstrap_url(self) -> str:
        """``http://host:bootstrap_port`` of the P2P MooncakeConnector (default 8998)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.bootstrap_port or 8998}"

    def __str__(self) -> str:
        return self.key


def parse_endpoint(value: str, *, field_name: str = "instance") -> Endpoint:
    """Parse ``[scheme://]host:port[@bootstrap_port]``; raises ``ConfigError`` naming the field."""
    if not isinstance(value, str) or not value.strip():
        return _endpoint(HostPort.parse("", field=field_name, strict=True, shown=str(value)))
    text = value.strip().rstrip("/")
    scheme = "http"
    if "://" in text:
        scheme, text = text.split("://", 1)
        if scheme not in ("http", "https"):
            raise ConfigError(field_name, [ConfigProblem(
                field_name, f"{value!r}: scheme {scheme!r} is not http or https", HOST_PORT_FIX)])
    bootstrap: int | None = None
    if "@" in text:
        text, boot = text.rsplit("@", 1)
        bootstrap = HostPort.parse(f"_:{boot}", field=field_name, shown=value).port
    return _endpoint(HostPort.parse(text, field=field_name, strict=True, shown=value), scheme, bootstrap)


def _endpoint(hp: HostPort, scheme: str = "http", bootstrap: int | None = None) -> Endpoint:
    return Endpoint(hp.host, hp.port, scheme, bootstrap)


@dataclass(eq=False)
class Instance:
    """One upstream vLLM server and its live state (mutated only on the event loop)."""

    kind: str
    endpoint: Endpoint
    healthy: bool = True
    draining: bool = False
    in_flight: int = 0
    requests: int = 0
    errors: int = 0
    last_error: str = ""
    validated: bool = False
    probe_failures: int = 0  # consecutive failed health checks
    #: P2P: dp rank -> engine id, from the prefill's bootstrap server ``/query``
    engine_ids: dict[int, str] = field(default_factory=dict)
    #: the instance's last ``/metrics`` answer (``engine_load``), None before the first
    engine: EngineLoad | None = None
    engine_failures: int = 0
    _rr: int = 0
    _idle: asyncio.Event | None = field(default=None, repr=False)

    @property
    def key(self) -> str:
        return self.endpoint.key

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def available(self) -> bool:
        return self.healthy and not self.draining

    @property
    def load(self) -> int:
        """Requests on the instance: those in flight through this proxy now, plus those its engine
        last reported (still fresh) beyond ours in flight then: other clients'. Not the larger of
        the two: the engine's count lags up to a scrape interval, and a request of ours that ended
        since (in a closed loop the turn before the one being routed) would still count."""
        e = self.engine
        return self.in_flight + (e.others if e is not None and e.fresh() else 0)

    def acquire(self) -> None:
        self.in_flight += 1
        self.requests += 1

    def release(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if ``timeout`` ran out first."""
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return self.in_flight == 0
        return True

    def mark_failed(self, reason: str) -> None:
        self.healthy = False
        self.errors += 1
        self.last_error = reason

    def next_dp_rank(self) -> int:
        """Round-robin over the DP ranks the bootstrap server reported (0 if none)."""
        ranks = sorted(self.engine_ids) or [0]
        self._rr += 1
        return ranks[self._rr % len(ranks)]

    def status(self) -> dict[str, object]:
        return {
            "instance": self.key,
            "url": self.url,
            "healthy": self.healthy,
            "draining": self.draining,
            "in_flight": self.in_flight,
            "requests": self.requests,
            "errors": self.errors,
            "last_error": self.last_error,
            **({"engine_ids": {str(k): v for k, v in self.engine_ids.items()}} if self.engine_ids else {}),
        }


class InstancePool:
    """The prefill and decode instances, in insertion order per kind."""

    def __init__(self) -> None:
        self._by_kind: dict[str, dict[str, Instance]] = {k: {} for k in KINDS}
        self._available: dict[str, list[Instance]] = {k: [] for k in KINDS}

    def _check_kind(self, kind: str) -> None:
        if kind not in self._by_kind:
            raise ConfigError(
                "type", [ConfigProblem("type", f"{kind!r} is not an instance type", "use 'prefill' or 'decode'")]
            )

    def add(self, instance: Instance) -> None:
        self._check_kind(instance.kind)
        self._by_kind[instance.kind][instance.key] = instance
        self.refresh()

    def get(self, kind: str, key: str) -> Instance | None:
        self._check_kind(kind)
        return self._by_kind[kind].get(key)

    def remove(self, kind: str, key: str) -> Instance | None:
        self._check_kind(kind)
        inst = self._by_kind[kind].pop(key, None)
        self.refresh()
        return inst

    def refresh(self) -> None:
        """Rebuild the per-kind rotation lists; call after any health/drain change."""
        for kind, insts in self._by_kind.items():
            self._available[kind] = [i for i in insts.values() if i.available]

    def available(self, kind: str) -> list[Instance]:
        return self._available[kind]

    def of_kind(self, kind: str) -> list[Instance]:
        return list(self._by_kind[kind].values())

    def __iter__(self) -> Iterator[Instance]:
        for insts in self._by_kind.values():
            yield from list(insts.values())

    def unavailable_reason(self, kind: str) -> str:
        """Why no instance of ``kind`` can take a request (for the 503 body)."""
        insts = self.of_kind(kind)
        if not insts:
            return f"no {kind} instance is configured; add one with POST /instances/add"
        parts = []
        for i in insts:
            state = "draining" if i.draining else f"unhealthy ({i.last_error or 'failed health check'})"
            parts.append(f"{i.key} {state}")
        return f"no healthy {kind} instance: " + "; ".join(parts)
