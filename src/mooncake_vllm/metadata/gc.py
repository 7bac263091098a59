"""Find and remove Transfer Engine metadata whose owner process is gone.

Before Mooncake v0.3.12 nobody deletes ``mooncake/ram/<seg>`` and
``mooncake/rpc_meta/<seg>`` when a client crashes, and tutorials say "restart
mooncake_master". Instead, :func:`collect_garbage` probes each segment's
owner and deletes the entries of segments nobody answers for.

Which address is probed (observed on 0.3.13.post1: the port in the segment
name is *not* listened on; the owner listens on ``rpc_meta.rpc_port`` and on
the descriptor's ``tcp_data_port``):

* ``rpc_meta`` → ``ip_or_host_name:rpc_port``; ``ram`` → ``tcp_data_host`` (or
  the segment's host) ``:tcp_data_port``. These are *authoritative*.
* the segment name's ``host:port`` as a last resort (older releases listen there).

A segment is ``alive`` if any address accepts a TCP connection, ``dead`` if it
has an authoritative address and none accepts, else ``unknown``. Only dead
segments are deleted, only with ``apply=True``, and only while each entry
still holds the value that was probed (a re-registered segment is kept).
"""

from __future__ import annotations

import json
import socket
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from mooncake_vllm.errors import StoreError, StoreUnavailableError
from mooncake_vllm.metadata.backends import MetadataBackend
from mooncake_vllm.metadata.entries import KIND_RAM, KIND_RPC_META, ROOT, EntryKey, parse_key, rpc_address

__all__ = ["ALIVE", "DEAD", "UNKNOWN", "GcReport", "SegmentStatus", "collect_garbage", "probe", "scan"]

ALIVE, DEAD, UNKNOWN = "alive", "dead", "unknown"


@dataclass(frozen=True)
class SegmentStatus:
    """One segment's entries and what probing its owner found."""

    segment: str
    cluster_id: str | None
    keys: tuple[str, ...]
    addresses: tuple[str, ...]  # "host:port" probed, authoritative first
    state: str  # ALIVE | DEAD | UNKNOWN
    reason: str


@dataclass
class GcReport:
    """What :func:`collect_garbage` found and did."""

    backend: str
    applied: bool
    segments: list[SegmentStatus] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # stale, but changed since the probe
    errors: list[str] = field(default_factory=list)

    @property
    def stale(self) -> list[SegmentStatus]:
        return [s for s in self.segments if s.state == DEAD]

    def to_dict(self) -> dict:
        return {
            "backend": self.backend,
            "applied": self.applied,
            "segments": [asdict(s) for s in self.segments],
            "stale_keys": [k for s in self.stale for k in s.keys],
            "deleted": list(self.deleted),
            "kept": list(self.kept),
            "errors": list(self.errors),
        }


def probe(host: str, port: int, timeout: float) -> str | None:
    """None when ``host:port`` accepts a TCP connection within ``timeout``, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def _addresses(entries: dict[str, tuple[EntryKey, bytes]]) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(authoritative, fallback) addresses of one segment's owner."""
    auth: list[tuple[str, int]] = []
    fallback: list[tuple[str, int]] = []
    for parsed, value in entries.values():
        if parsed.kind == KIND_RPC_META:
            addr = rpc_address(value)
            if addr:
                auth.append(addr)
        elif parsed.kind == KIND_RAM:
            try:
                doc = json.loads(value)
                port = int(doc.get("tcp_data_port") or 0)
                host = str(doc.get("tcp_data_host") or parsed.host)
            except (ValueError, TypeError, AttributeError):
                continue
            if 0 < port < 65536:
                auth.append((host, port))
        if parsed.port:
            fallback.append((parsed.host, parsed.port))
    dedup = list(dict.fromkeys(auth))
    return dedup, [a for a in dict.fromkeys(fallback) if a not in dedup]


def _judge(segment: str, entries: dict[str, tuple[EntryKey, bytes]], timeout: float) -> SegmentStatus:
    auth, fallback = _addresses(entries)
    results: list[str] = []
    state = UNKNOWN
    for host, port in auth + fallback:
        why = probe(host, port, timeout)
        if why is None:
            state = ALIVE
            results.append(f"{host}:{port} accepts connections")
            break
        results.append(f"{host}:{port} {why}")
    else:
        if auth:
            state = DEAD
    first = next(iter(entries.values()))[0]
    if state == UNKNOWN and not results:
        results.append("no probeable address in the entries")
    return SegmentStatus(
        segment=segment, cluster_id=first.cluster_id, keys=tuple(sorted(entries)),
        addresses=tuple(f"{h}:{p}" for h, p in auth + fallback), state=state, reason="; ".join(results),
    )


def scan(backend: MetadataBackend, *, timeout: float = 1.0, prefix: str = ROOT) -> list[SegmentStatus]:
    """Group ``ram``/``rpc_meta`` entries by segment and probe each owner (concurrently)."""
    return _scan(backend, timeout, prefix)[0]


def _scan(backend: MetadataBackend, timeout: float, prefix: str) -> tuple[list[SegmentStatus], dict[str, bytes]]:
    groups: dict[tuple[str | None, str], dict[str, tuple[EntryKey, bytes]]] = defaultdict(dict)
    values: dict[str, bytes] = {}
    for key in backend.list(prefix):
        parsed = parse_key(key)
        if parsed is None:
            continue
        value = backend.get(key)
        if value is None:  # deleted meanwhile
            continue
        values[key] = value
        groups[(parsed.cluster_id, parsed.segment)][key] = (parsed, value)
    if not groups:
        return [], values
    with ThreadPoolExecutor(max_workers=min(32, len(groups))) as pool:
        statuses = list(pool.map(lambda item: _judge(item[0][1], item[1], timeout), groups.items()))
    return sorted(statuses, key=lambda s: (s.cluster_id or "", s.segment)), values


def collect_garbage(backend: MetadataBackend, *, apply: bool = False, timeout: float = 1.0,
                    prefix: str = ROOT) -> GcReport:
    """Report (and with ``apply=True`` delete) entries of segments whose owner is gone."""
    segments, values = _scan(backend, timeout, prefix)
    report = GcReport(backend=backend.url, applied=apply, segments=segments)
    if not apply:
        return report
    for status in report.stale:
        for key in status.keys:
            try:
                if backend.get(key) != values[key]:
                    report.kept.append(key)  # re-registered since the probe: not stale any more
                    continue
                backend.delete(key)
                report.deleted.append(key)
            except (StoreError, StoreUnavailableError) as exc:
                report.errors.append(f"{key}: {exc}")
    return report
