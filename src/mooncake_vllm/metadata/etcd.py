"""etcd v3 metadata backend over etcd's JSON gateway (plain HTTP, stdlib only).

Why not a client library:

* ``etcd3`` 0.12.0 (PyPI, last release 2020) ships code generated for
  protobuf 3.x; with current protobuf (checked: 7.36) ``import etcd3`` fails
  with ``TypeError: Descriptors cannot be created directly`` unless protobuf
  is downgraded, which would fight vLLM's own protobuf requirement.
* ``aetcd`` is maintained but asyncio-only and pulls grpcio + protobuf (tens of
  MB, another protobuf pin) for the four calls we need.
* ``etcd3gw`` (maintained, OpenStack) already speaks the same JSON gateway,
  but adds ``requests``, ``futurist`` and ``pbr``.

etcd's gRPC gateway is part of every etcd v3 server (``/v3/`` from 3.4,
``/v3beta/`` on 3.3, ``/v3alpha/`` on 3.2), is enabled by default on the
client port, and needs only ``POST`` of JSON with base64 keys:
``/v3/kv/range``, ``/v3/kv/put``, ``/v3/kv/deleterange``. That is ~100 lines
with :mod:`http.client`, no dependency, no protobuf conflict, and the same
keys Mooncake's etcd plugin writes (plain ``mooncake/...`` strings).
"""

from __future__ import annotations

import base64
import json
import threading

from mooncake_vllm.addresses import MetadataURL
from mooncake_vllm.errors import StoreError, StoreUnavailableError
from mooncake_vllm.metadata.base import DEFAULT_TIMEOUT, MetadataBackend, http_request

__all__ = ["EtcdBackend"]

#: gateway prefixes by etcd release, newest first
_API_PREFIXES = ("/v3/", "/v3beta/", "/v3alpha/")


def _b64(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return base64.b64encode(data).decode("ascii")


def _prefix_end(prefix: bytes) -> bytes:
    """Smallest key greater than every key starting with ``prefix`` (etcd's range_end)."""
    data = bytearray(prefix)
    while data:
        if data[-1] < 0xFF:
            data[-1] += 1
            return bytes(data)
        data.pop()
    return b"\0"  # empty prefix: the whole key space


class EtcdBackend(MetadataBackend):
    """etcd v3 through its JSON gateway; tries each endpoint in turn."""

    def __init__(self, endpoints: list[str], *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.endpoints = list(endpoints)
        self.url = "etcd://" + ",".join(e.split("://", 1)[1] for e in self.endpoints)
        self.timeout = timeout
        self._api: dict[str, str] = {}  # endpoint -> detected gateway prefix
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, *, timeout: float = DEFAULT_TIMEOUT) -> EtcdBackend:
        return cls(MetadataURL.parse(url).etcd_endpoints(), timeout=timeout)

    def _post(self, endpoint: str, method: str, payload: dict) -> tuple[int, bytes]:
        prefixes = [self._api[endpoint]] if endpoint in self._api else list(_API_PREFIXES)
        status, body = 404, b""
        for prefix in prefixes:
            status, body = http_request(
                "POST", f"{endpoint}{prefix}{method}", json.dumps(payload).encode(), timeout=self.timeout,
                headers={"Content-Type": "application/json"},
            )
            if status != 404:
                with self._lock:
                    self._api[endpoint] = prefix
                break
        return status, body

    def _call(self, method: str, payload: dict) -> dict:
        failures: list[str] = []
        for endpoint in self.endpoints:
            try:
                status, body = self._post(endpoint, method, payload)
            except StoreUnavailableError as exc:
                failures.append(str(exc))
                continue
            if status != 200:
                raise StoreError(
                    f"etcd {endpoint} rejected {method} (HTTP {status}): {body[:200].decode('utf-8', 'replace')}"
                )
            return json.loads(body or b"{}")
        raise StoreUnavailableError(
            f"no etcd endpoint of {self.url} answered: {'; '.join(failures)}; check that etcd runs "
            "(etcd --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379)"
        )

    def get(self, key: str) -> bytes | None:
        kvs = self._call("kv/range", {"key": _b64(key)}).get("kvs") or []
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    def put(self, key: str, value: bytes) -> None:
        self._call("kv/put", {"key": _b64(key), "value": _b64(bytes(value))})

    def delete(self, key: str) -> None:
        self._call("kv/deleterange", {"key": _b64(key)})

    def list(self, prefix: str = "mooncake/") -> list[str]:
        start = prefix.encode() or b"\0"
        doc = self._call("kv/range", {"key": _b64(start), "range_end": _b64(_prefix_end(prefix.encode())),
                                      "keys_only": True})
        return sorted(base64.b64decode(kv["key"]).decode("utf-8", "replace") for kv in doc.get("kvs") or [])
