"""One store client per process, shared by the scheduler- and worker-side connectors.

With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` both sides live in one process; they
share one :class:`~mooncake_vllm.store.StoreClient`. A pool that is down at start
is a warning, not an error: vLLM serves by recomputing, and a background thread
retries the connection now and then without ever blocking the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from mooncake_vllm.config import StoreConfig
from mooncake_vllm.errors import StoreUnavailableError
from mooncake_vllm.placement import off_compute_cores
from mooncake_vllm.store import StoreClient

__all__ = ["ClientSource", "SharedClient", "shared_client"]

log = logging.getLogger(__name__)

_RETRY_SECONDS = 15.0
_registry: dict[StoreConfig, SharedClient] = {}
_registry_lock = threading.Lock()


class ClientSource(Protocol):
    """Where a connector side gets its store client (:class:`SharedClient`, or a wrapper
    of one such as :class:`~mooncake_vllm.v1.metrics.MeteredSource`)."""

    def get(self) -> StoreClient | None:
        """The connected client, or ``None`` while the pool is away; never blocks long."""
        ...

    def on_connect(self, callback: Callable[[StoreClient], object]) -> None:
        """Run ``callback(client)`` now if connected, else once a connection succeeds."""
        ...


class SharedClient:
    """A lazily (re)connected :class:`StoreClient`; :meth:`get` never blocks long."""

    def __init__(self, config: StoreConfig, *, timeout: float = 5.0,
                 retry_seconds: float = _RETRY_SECONDS,
                 connect: Callable[[StoreConfig, float], StoreClient] | None = None) -> None:
        self.config = config
        self._timeout = timeout
        self._retry = retry_seconds
        self._connect = connect or (lambda cfg, t: StoreClient.connect(cfg, timeout=t))
        self._client: StoreClient | None = None
        self._lock = threading.Lock()
        self._last_attempt = 0.0
        self._connecting = False
        self._warned = False
        self._listeners: list[Callable[[StoreClient], object]] = []

    def start(self) -> StoreClient | None:
        """Connect now (bounded by the timeout); warn once and carry on if the pool is away."""
        with self._lock:
            if self._client is None and not self._connecting:
                self._connecting = True
            else:
                return self._client
        # connect from a thread off the compute cores: Mooncake's own threads inherit it
        worker = threading.Thread(target=self._attempt_off_compute, name="mcv-connect",
                                  daemon=True)
        worker.start()
        worker.join(self._timeout + 5.0)
        return self._client

    def get(self) -> StoreClient | None:
        """The connected client, or ``None`` (a retry is started in the background)."""
        client = self._client
        if client is not None:
            return client
        with self._lock:
            due = time.monotonic() - self._last_attempt >= self._retry
            if self._connecting or not due:
                return None
            self._connecting = True
        threading.Thread(target=self._attempt_off_compute, name="mcv-reconnect",
                         daemon=True).start()
        return None

    def on_connect(self, callback: Callable[[StoreClient], object]) -> None:
        """Run ``callback(client)`` now if connected, else once a connection succeeds."""
        with self._lock:
            client = self._client
            if client is None:
                self._listeners.append(callback)
                return
        callback(client)

    def _attempt_off_compute(self) -> None:
        off_compute_cores()
        self._attempt()

    def _attempt(self) -> None:
        try:
            client = self._connect(self.config, self._timeout)
        except (StoreUnavailableError, OSError) as exc:
            with self._lock:
                self._last_attempt = time.monotonic()
                self._connecting = False
                first, self._warned = not self._warned, True
            if first:
                log.warning("mooncake-vllm: Mooncake pool unavailable at start (%s); vLLM "
                            "recomputes every prompt and the connection is retried every "
                            "%.0f s", exc, self._retry)
            return
        with self._lock:
            self._client = client
            self._connecting = False
            listeners, self._listeners = self._listeners, []
            recovered = self._warned
        if recovered:
            log.warning("mooncake-vllm: connected to the Mooncake pool at %s",
                        self.config.master_server_address)
        for callback in listeners:
            callback(client)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


def shared_client(config: StoreConfig, *, timeout: float = 5.0) -> SharedClient:
    """The process-wide :class:`SharedClient` for ``config`` (created on first use)."""
    with _registry_lock:
        shared = _registry.get(config)
        if shared is None:
            shared = _registry[config] = SharedClient(config, timeout=timeout)
    return shared
