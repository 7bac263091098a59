"""What every metadata backend shares: the :class:`MetadataBackend` interface and
one stdlib HTTP call (:func:`http_request`) used by the HTTP and etcd backends."""

from __future__ import annotations

import http.client
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import TracebackType

from mooncake_vllm.errors import StoreError, StoreUnavailableError

__all__ = ["DEFAULT_TIMEOUT", "MetadataBackend", "http_request"]

DEFAULT_TIMEOUT = 3.0


class MetadataBackend(ABC):
    """A key/value store holding Transfer Engine metadata."""

    #: the connection string this backend was made from (credentials removed)
    url: str = ""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The stored bytes, or None when the key is absent."""

    @abstractmethod
    def put(self, key: str, value: bytes) -> None:
        """Store ``value`` verbatim under ``key`` (overwrites)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""

    @abstractmethod
    def list(self, prefix: str = "mooncake/") -> list[str]:
        """Every key starting with ``prefix``, sorted."""

    def close(self) -> None:  # noqa: B027 (a no-op default; backends holding connections override it)
        """Release connections (idempotent)."""

    def __enter__(self) -> MetadataBackend:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


#: largest HTTP answer read from a metadata server or etcd (entries are KiB; a listing of thousands, a few MiB)
MAX_RESPONSE_BYTES = 64 << 20


def http_request(
    method: str, url: str, body: bytes | None = None, *, timeout: float = DEFAULT_TIMEOUT,
    headers: Mapping[str, str] | None = None,
) -> tuple[int, bytes]:
    """One HTTP request with the stdlib; ``(status, body)``.

    Raises :class:`StoreUnavailableError` when the server cannot be reached, and
    :class:`StoreError` when it answers more than ``MAX_RESPONSE_BYTES``.
    """
    parts = urllib.parse.urlsplit(url)
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    try:
        conn.request(method, target, body=body, headers=dict(headers or {}))
        resp = conn.getresponse()
        data = resp.read(MAX_RESPONSE_BYTES + 1)  # a runaway server cannot exhaust our memory
        if len(data) > MAX_RESPONSE_BYTES:
            raise StoreError(f"{parts.scheme}://{parts.netloc} answered {method} {parts.path} with more than "
                             f"{MAX_RESPONSE_BYTES >> 20} MiB; is that a metadata server?")
        return resp.status, data
    except OSError as exc:  # refused, timeout, reset, DNS
        raise StoreUnavailableError(
            f"metadata server {parts.scheme}://{parts.netloc} unreachable ({method} {parts.path}): {exc}; "
            "check that it runs and that the URL is right"
        ) from exc
    finally:
        conn.close()
