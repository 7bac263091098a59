"""Clients for the Transfer Engine metadata store, one per backend.

All backends share :class:`MetadataBackend`: ``get(key) -> bytes | None``,
``put(key, value)``, ``delete(key)`` (a missing key is fine) and
``list(prefix) -> list[str]``. Values are opaque bytes (Mooncake stores compact
JSON). :func:`backend_for` turns a ``metadata_server`` string into a backend the
way Mooncake's ``parseConnectionString`` does:

==============================  ==========================================
``etcd://h:p[,h2:p2]``          :class:`~mooncake_vllm.metadata.etcd.EtcdBackend`
``h:p`` (no scheme)             etcd, as Mooncake does
``redis://[user:pw@]h:p[/db]``  :class:`RedisBackend` (same plain keys as Mooncake's plugin)
``http(s)://.../metadata``      :class:`HttpBackend` (Mooncake's HTTP protocol)
``memory``                      :class:`MemoryBackend` (for the embedded server)
``P2PHANDSHAKE``                no server at all: :class:`~mooncake_vllm.errors.ConfigError`
==============================  ==========================================
"""

from __future__ import annotations

import json
import os
import threading
import urllib.parse
from collections.abc import Mapping

from mooncake_vllm.addresses import P2P_HANDSHAKE, MetadataURL, redact_url
from mooncake_vllm.errors import ConfigError, ConfigProblem, MetadataFullError, StoreError, StoreUnavailableError
from mooncake_vllm.metadata.base import DEFAULT_TIMEOUT, MetadataBackend, http_request
from mooncake_vllm.metadata.etcd import EtcdBackend

__all__ = [
    "DEFAULT_TIMEOUT",
    "P2P_HANDSHAKE",
    "HttpBackend",
    "MemoryBackend",
    "MetadataBackend",
    "RedisBackend",
    "backend_for",
    "http_request",
    "redact_url",
]

class MemoryBackend(MetadataBackend):
    """A thread-safe in-process dict; what the embedded server uses by default.

    ``max_total_bytes`` / ``max_keys`` bound what it holds (defaults as Mooncake's
    own HTTP metadata server: 1 GiB, 65536 keys); a put over either raises
    :class:`MetadataFullError` and stores nothing.
    """

    url = "memory"

    def __init__(self, *, max_total_bytes: int = 1 << 30, max_keys: int = 65536) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.max_total_bytes, self.max_keys = max_total_bytes, max_keys
        self.total_bytes = 0

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def put(self, key: str, value: bytes) -> None:
        value = bytes(value)
        with self._lock:
            old = self._data.get(key)
            if old is None and len(self._data) >= self.max_keys:
                raise MetadataFullError(
                    f"metadata store full: {len(self._data)} keys, the limit is {self.max_keys} "
                    "(MC_METADATA_MAX_KEYS); remove stale entries with `mooncake-vllm metadata gc --apply` "
                    "or raise MC_METADATA_MAX_KEYS for the metadata server")
            total = self.total_bytes - (len(old) if old is not None else 0) + len(value)
            if total > self.max_total_bytes:
                raise MetadataFullError(
                    f"metadata store full: {self.total_bytes} bytes stored, this {len(value)}-byte value would "
                    f"exceed the limit of {self.max_total_bytes} bytes (MC_METADATA_MAX_TOTAL_BYTES); remove stale "
                    "entries with `mooncake-vllm metadata gc --apply` or raise MC_METADATA_MAX_TOTAL_BYTES")
            self._data[key] = value
            self.total_bytes = total

    def delete(self, key: str) -> None:
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self.total_bytes -= len(old)

    def list(self, prefix: str = "mooncake/") -> list[str]:
        with self._lock:
            return sorted(k for k in self._data if k.startswith(prefix))


class HttpBackend(MetadataBackend):
    """Mooncake's HTTP metadata protocol: GET/PUT/DELETE ``<url>?key=<urlencoded>``.

    Listing is not part of Mooncake's protocol. mooncake-vllm's own server
    (:mod:`mooncake_vllm.metadata.server`) adds ``GET <url>?prefix=<p>`` →
    ``{"keys": [...]}``; against other servers :meth:`list` raises
    :class:`StoreError`.
    """

    def __init__(self, url: str, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.url = url
        self.timeout = timeout
        self._headers = {"Content-Type": "application/json"}
        token = os.environ.get("MC_METADATA_HTTP_TOKEN", "")
        if token:  # newer Mooncake servers accept a shared bearer token
            self._headers["Authorization"] = f"Bearer {token}"

    def _url(self, param: str, value: str) -> str:
        sep = "&" if "?" in self.url else "?"
        return f"{self.url}{sep}{param}={urllib.parse.quote(value, safe='')}"

    def _call(self, method: str, param: str, value: str, body: bytes | None = None) -> tuple[int, bytes]:
        return http_request(method, self._url(param, value), body, timeout=self.timeout, headers=self._headers)

    def get(self, key: str) -> bytes | None:
        status, body = self._call("GET", "key", key)
        if status == 200:
            return body
        if status == 404:
            return None
        raise StoreError(f"GET {key!r} from {self.url} returned HTTP {status}: {_snippet(body)}")

    def put(self, key: str, value: bytes) -> None:
        status, body = self._call("PUT", "key", key, bytes(value))
        if status != 200:
            raise StoreError(f"PUT {key!r} to {self.url} returned HTTP {status}: {_snippet(body)}")

    def delete(self, key: str) -> None:
        status, body = self._call("DELETE", "key", key)
        if status not in (200, 404):  # Mooncake's Python server answers 404 for a missing key
            raise StoreError(f"DELETE {key!r} at {self.url} returned HTTP {status}: {_snippet(body)}")

    def list(self, prefix: str = "mooncake/") -> list[str]:
        status, body = self._call("GET", "prefix", prefix)
        try:
            keys = json.loads(body)["keys"] if status == 200 else None
        except (ValueError, KeyError, TypeError):
            keys = None
        if not isinstance(keys, list):
            raise StoreError(
                f"{self.url} cannot list keys (HTTP {status}: {_snippet(body)}); listing is an extension of "
                "mooncake-vllm's metadata server, not of Mooncake's protocol: run `mooncake-vllm metadata serve` "
                "instead of mooncake_http_metadata_server, or use etcd/redis"
            )
        return sorted(str(k) for k in keys)


def _snippet(body: bytes, limit: int = 200) -> str:
    text = body.decode("utf-8", "replace").strip()
    return (text[:limit] + "...") if len(text) > limit else (text or "<empty body>")


class RedisBackend(MetadataBackend):
    """Redis with Mooncake's plain keys (``GET``/``SET``/``DEL`` of ``mooncake/...``).

    Credentials and the database come from the URL or, like Mooncake's redis
    plugin, from ``MC_REDIS_USERNAME`` / ``MC_REDIS_PASSWORD`` / ``MC_REDIS_DB_INDEX``.
    """

    def __init__(self, url: str, *, timeout: float = DEFAULT_TIMEOUT, env: Mapping[str, str] = os.environ) -> None:
        import redis  # optional dependency: extra "redis"

        parts = urllib.parse.urlsplit(url)
        self.url = redact_url(url)
        db_text = parts.path.strip("/") or env.get("MC_REDIS_DB_INDEX", "") or "0"
        if not db_text.isdigit():
            raise _url_error(url, f"database {db_text!r} is not a number", "use redis://host:port/<db number>")
        try:
            port = parts.port or 6379
        except ValueError as exc:
            raise _url_error(url, str(exc), "use redis://host:port") from exc
        self._client = redis.Redis(
            host=parts.hostname or "127.0.0.1",
            port=port,
            db=int(db_text),
            username=urllib.parse.unquote(parts.username) if parts.username else env.get("MC_REDIS_USERNAME") or None,
            password=urllib.parse.unquote(parts.password) if parts.password else env.get("MC_REDIS_PASSWORD") or None,
            ssl=parts.scheme == "rediss",
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
        )
        self._errors = (redis.ConnectionError, redis.TimeoutError)

    def _do(self, what: str, fn, *args):  # noqa: ANN001, ANN202 - thin wrapper
        try:
            return fn(*args)
        except self._errors as exc:
            raise StoreUnavailableError(
                f"redis metadata store {self.url} unreachable ({what}): {exc}; check that redis runs at that address"
            ) from exc

    def get(self, key: str) -> bytes | None:
        value = self._do("GET", self._client.get, key)
        return None if value is None else bytes(value)

    def put(self, key: str, value: bytes) -> None:
        self._do("SET", self._client.set, key, bytes(value))

    def delete(self, key: str) -> None:
        self._do("DEL", self._client.delete, key)

    def list(self, prefix: str = "mooncake/") -> list[str]:
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in prefix) + "*"
        keys = self._do("SCAN", lambda: list(self._client.scan_iter(match=pattern, count=1000)))
        return sorted(k.decode("utf-8", "replace") for k in keys)

    def close(self) -> None:
        self._client.close()


def _url_error(url: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"metadata URL {redact_url(url)!r}", [ConfigProblem("metadata_server", problem, fix)])


def backend_for(url: str, *, timeout: float = DEFAULT_TIMEOUT) -> MetadataBackend:
    """The backend for a Mooncake ``metadata_server`` string (see the module docstring)."""
    text = (url or "").strip()
    if not text:
        raise _url_error(url, "empty metadata server", "give http://host:port/metadata, etcd://host:port or redis://host:port")
    if text.upper() == P2P_HANDSHAKE:
        raise _url_error(
            text,
            "P2PHANDSHAKE needs no metadata server: peers exchange segment metadata over the Transfer Engine RPC "
            "port, so there are no entries to read, list or clean",
            "nothing to do for P2PHANDSHAKE; use an http/etcd/redis metadata server if you need `metadata list|gc`",
        )
    if text in ("memory", "memory://"):
        return MemoryBackend()
    scheme = MetadataURL.parse(text).scheme
    if scheme in ("", "etcd"):
        return EtcdBackend.from_url(text, timeout=timeout)
    if scheme in ("redis", "rediss"):
        return RedisBackend(text, timeout=timeout)
    if scheme in ("http", "https"):
        if not urllib.parse.urlsplit(text).hostname:
            raise _url_error(text, "no host in the URL", "use http://host:port/metadata")
        return HttpBackend(text, timeout=timeout)
    raise _url_error(
        text,
        f"unknown metadata scheme {scheme + '://'!r} (Mooncake would abort the process on it)",
        "use http://host:port/metadata, etcd://host:port, host:port (etcd), redis://host:port or P2PHANDSHAKE",
    )
