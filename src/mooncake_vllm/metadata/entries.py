"""Transfer Engine metadata keys: build, parse and validate them.

Every Mooncake client publishes two entries per segment (``host:port``):

* ``mooncake/ram/<segment>``: the segment descriptor (JSON: ``name``,
  ``protocol``, ``tcp_data_port``, ``buffers`` ...);
* ``mooncake/rpc_meta/<segment>``: ``{"ip_or_host_name": ..., "rpc_port": ...}``.

From Mooncake v0.3.8 the prefix is ``mooncake/<MC_METADATA_CLUSTER_ID>/`` when
that variable is set. P2PHANDSHAKE deployments have no entries at all.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "KIND_RAM",
    "KIND_RPC_META",
    "MAX_KEY_LENGTH",
    "ROOT",
    "EntryKey",
    "key_prefix",
    "parse_key",
    "ram_key",
    "rpc_address",
    "rpc_meta_key",
    "validate_key",
]

ROOT = "mooncake/"
KIND_RAM = "ram"
KIND_RPC_META = "rpc_meta"
#: Longest key the server accepts. Real keys are ~40 characters
#: (``mooncake/rpc_meta/255.255.255.255:65535``); 1 KiB leaves room for
#: cluster ids and host names while rejecting garbage.
MAX_KEY_LENGTH = 1024

_KEY_RE = re.compile(r"^mooncake/(?:(?P<cluster>[^/]+)/)?(?P<kind>ram|rpc_meta)/(?P<segment>[^/]+)$")


@dataclass(frozen=True)
class EntryKey:
    """A parsed ``mooncake/[<cluster>/]<kind>/<segment>`` key."""

    key: str
    kind: str  # "ram" | "rpc_meta"
    segment: str  # "host:port"
    cluster_id: str | None = None

    @property
    def host(self) -> str:
        """Host part of the segment name (IPv6 brackets removed)."""
        host, _, _ = self.segment.rpartition(":")
        return (host or self.segment).strip("[]")

    @property
    def port(self) -> int | None:
        """Port part of the segment name, or None when it has none."""
        _, sep, port = self.segment.rpartition(":")
        return int(port) if sep and port.isdigit() else None


def key_prefix(cluster_id: str | None = None, *, env: Mapping[str, str] = os.environ) -> str:
    """``mooncake/`` or ``mooncake/<cluster_id>/``; ``cluster_id`` defaults to ``$MC_METADATA_CLUSTER_ID``."""
    cid = env.get("MC_METADATA_CLUSTER_ID", "") if cluster_id is None else cluster_id
    return f"{ROOT}{cid}/" if cid else ROOT


def ram_key(segment: str, cluster_id: str | None = None, *, env: Mapping[str, str] = os.environ) -> str:
    """Key of a segment descriptor, e.g. ``mooncake/ram/127.0.0.1:12345``."""
    return f"{key_prefix(cluster_id, env=env)}{KIND_RAM}/{segment}"


def rpc_meta_key(segment: str, cluster_id: str | None = None, *, env: Mapping[str, str] = os.environ) -> str:
    """Key of a segment's RPC address, e.g. ``mooncake/rpc_meta/127.0.0.1:12345``."""
    return f"{key_prefix(cluster_id, env=env)}{KIND_RPC_META}/{segment}"


def parse_key(key: str) -> EntryKey | None:
    """Parse a Transfer Engine key; None when it is not a ``ram``/``rpc_meta`` key."""
    m = _KEY_RE.match(key)
    if m is None:
        return None
    return EntryKey(key=key, kind=m["kind"], segment=m["segment"], cluster_id=m["cluster"])


def validate_key(key: str | None) -> str | None:
    """Why ``key`` is not acceptable as a metadata key, or None when it is.

    Accepted: non-empty, at most :data:`MAX_KEY_LENGTH` characters, under
    ``mooncake/`` with something after it, no control characters.
    """
    if key is None:
        return "missing query parameter 'key' (expected ?key=mooncake/...)"
    if not key:
        return "empty key (expected a key such as mooncake/ram/<host:port>)"
    if len(key) > MAX_KEY_LENGTH:
        return f"key is {len(key)} characters long; the limit is {MAX_KEY_LENGTH}"
    if not key.startswith(ROOT) or len(key) == len(ROOT):
        return f"key {key[:80]!r} is not under {ROOT!r} (Transfer Engine keys look like mooncake/ram/<host:port>)"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        return f"key {key[:80]!r} contains control characters"
    return None


def rpc_address(value: bytes | str) -> tuple[str, int] | None:
    """``(ip_or_host_name, rpc_port)`` from an ``rpc_meta`` value, or None if malformed."""
    try:
        doc = json.loads(value)
        host, port = doc["ip_or_host_name"], int(doc["rpc_port"])
    except (ValueError, KeyError, TypeError):
        return None
    return (host, port) if isinstance(host, str) and host and 0 < port < 65536 else None

