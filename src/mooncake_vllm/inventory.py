"""What the pool holds, per key namespace, from the master's HTTP port alone.

Source: ``mooncake_master``'s HTTP (metrics) port, verified on 0.3.13.post1:

* ``GET /get_all_keys``: every key, one per line (no prefix filter, no paging). It
  is read as a stream and only counted: per namespace digest, the number of
  values and a bounded sample of keys; the listing is cut at ``max_keys``.
* ``GET /batch_query_keys?keys=k1,k2``: each key's replicas and their sizes; asked
  for at most ``size_sample`` keys per namespace (all of them when the namespace is
  smaller: exact bytes, else an estimate from the sample, marked so). A key's replicas
  say where it is: DRAM (``values``) and/or the disk tier (``local_disk_values``).
* ``GET /metrics``: the tiers of the whole pool (:func:`pool_tiers`): DRAM and disk bytes
  used and their capacity, values evicted from DRAM, and reads the disk answered.

No value is ever read. The master exposes no per-key time, so there is no age per
key. Which namespace a digest is comes from the registry keys instances write at
start (:meth:`~mooncake_vllm.keys.KeyNamespace.registry_key`): the key carries the
fields, so the listing names them. Values without a registry key are listed as
"unregistered" (written before registration existed, or its entry was evicted).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

from mooncake_vllm.errors import StoreUnavailableError
from mooncake_vllm.keys import KeyNamespace, block_key_digest, parse_registry_key

__all__ = [
    "NamespaceEntry",
    "PoolInventory",
    "Split",
    "engine_fields",
    "pool_tiers",
    "scan_pool",
    "splits",
]

#: per-rank fields: one engine writes one namespace per (tp, pp) rank
_RANK_FIELDS = ("tp_rank", "pp_rank")
#: fields that split one model's namespaces by accident, the most telling first (the layout
#: fingerprint follows block size, dtype and TP size, so it comes last)
_DIFF_ORDER = ("block_size", "dtype", "tp_size", "layout")
_MAX_LINE = 4096
_QUERY_BATCH = 128


@dataclass
class NamespaceEntry:
    """One namespace digest in the pool."""

    digest: str
    namespace: KeyNamespace | None = None  #: None = no registry key (fields unknown)
    keys: int = 0  #: values stored under it (blocks, V0 tails)
    bytes: int | None = None  #: value bytes (one replica each); None = not measured
    bytes_estimated: bool = False
    #: values with a DRAM replica / a disk-tier replica (estimated like ``bytes``); None = not measured
    in_dram: int | None = None
    on_disk: int | None = None
    sample: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        ns = self.namespace
        return {"digest": self.digest, "registered": ns is not None,
                "describe": ns.describe() if ns else None,
                "fields": asdict(ns) if ns else None, "keys": self.keys, "bytes": self.bytes,
                "bytes_estimated": self.bytes_estimated, "in_dram": self.in_dram, "on_disk": self.on_disk,
                "age_s": None}


@dataclass
class PoolInventory:
    """The namespaces of one pool, as far as the listing went."""

    url: str
    entries: dict[str, NamespaceEntry]
    listed_keys: int = 0
    other_keys: int = 0  #: keys that are no mooncake-vllm value (other software, probes)
    truncated: bool = False  #: the listing stopped at ``max_keys``
    source: str = "GET /get_all_keys (master HTTP port)"
    #: the pool's tiers (:func:`pool_tiers`); None = not asked
    tiers: dict[str, int] | None = None

    def as_dict(self) -> dict[str, object]:
        return {"master_http": self.url, "source": self.source, "listed_keys": self.listed_keys,
                "other_keys": self.other_keys, "truncated": self.truncated,
                "age": "not exposed by mooncake_master (no per-key time on its HTTP port)",
                "tiers": self.tiers,
                "namespaces": [e.as_dict() for e in self.sorted()]}

    def sorted(self) -> list[NamespaceEntry]:
        """Registered first, by model then fields; unregistered by digest."""
        def order(e: NamespaceEntry) -> tuple:
            ns = e.namespace
            return (ns is None, ns.describe() if ns else e.digest)
        return sorted(self.entries.values(), key=order)


def _base(url: str) -> str:
    base = url.rstrip("/")
    return base if "://" in base else "http://" + base


def _lines(url: str, timeout: float) -> Iterator[str]:
    """The listing's lines, streamed (never the whole body in memory)."""
    try:
        resp = urllib.request.urlopen(f"{url}/get_all_keys", timeout=timeout)  # noqa: S310 - http(s)
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise StoreUnavailableError(
            f"mooncake_master at {url} did not list its keys (GET /get_all_keys): {exc}. Fix: give the "
            f"master's HTTP port with --master-http (its --metrics_port, default 9003)") from None
    with resp:
        while True:
            try:
                line = resp.readline(_MAX_LINE)
            except OSError as exc:
                raise StoreUnavailableError(f"mooncake_master at {url}: the key listing broke off: {exc}") from None
            if not line:
                return
            yield line.decode("utf-8", "replace").rstrip("\r\n")


def scan_pool(url: str, *, timeout: float = 5.0, max_keys: int = 1_000_000,
              size_sample: int = 2048, sizes: bool = True) -> PoolInventory:
    """List the pool at the master's HTTP address ``url``; count values per namespace and,
    with ``sizes``, measure their bytes. Raises :class:`StoreUnavailableError`."""
    base = _base(url)
    inv = PoolInventory(base, {})
    deadline = time.monotonic() + max(timeout * 20, 30.0)
    for line in _lines(base, timeout):
        if not line:
            continue
        if inv.listed_keys >= max_keys or time.monotonic() > deadline:
            inv.truncated = True
            break
        inv.listed_keys += 1
        digest = block_key_digest(line)
        if digest is not None:
            entry = inv.entries.setdefault(digest, NamespaceEntry(digest))
            entry.keys += 1
            if len(entry.sample) < size_sample:
                entry.sample.append(line)
            continue
        ns = parse_registry_key(line)
        if ns is not None:
            inv.entries.setdefault(ns.digest(), NamespaceEntry(ns.digest())).namespace = ns
        else:
            inv.other_keys += 1
    if sizes:
        for entry in inv.entries.values():
            _measure(base, entry, timeout)
        inv.tiers = pool_tiers(base, timeout=timeout)
    return inv


#: what :func:`pool_tiers` reports, from the master's Prometheus series (0.3.13.post1 names)
_TIER_SERIES = {
    "dram_used_bytes": "master_allocated_bytes",
    "dram_capacity_bytes": "master_total_capacity_bytes",
    "disk_used_bytes": "master_allocated_file_size_bytes",
    "disk_capacity_bytes": "master_total_file_capacity_bytes",
    "disk_values": "file_cache_nums_",
    "disk_reads": "file_cache_hit_nums_",
    "disk_read_bytes": "file_cache_hit_bytes_total",
    "dram_evicted_values": "master_evicted_key_count_mem",
}


def pool_tiers(url: str, *, timeout: float = 5.0) -> dict[str, int]:
    """DRAM and disk-tier use of the pool, from the master's ``GET /metrics``: bytes used and
    capacity per tier, values on disk, reads the disk answered (``disk_reads``: the master
    counts them; a client is not told which tier answered its read) and values evicted from
    DRAM. A series the master does not export is left out (a release without the tier: no
    disk keys). Raises :class:`StoreUnavailableError`."""
    base = _base(url)
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=timeout) as resp:  # noqa: S310 - http(s)
            text = resp.read(16 << 20).decode("utf-8", "replace")
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise StoreUnavailableError(f"mooncake_master at {base} did not answer GET /metrics: {exc}") from None
    series: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in _TIER_SERIES.values():
            try:
                series[name] = int(float(value.split()[0]))
            except (ValueError, IndexError):
                pass
    return {ours: series[theirs] for ours, theirs in _TIER_SERIES.items() if theirs in series}


def _replica(item: object) -> tuple[int, bool, bool] | None:
    """(size, in DRAM, on disk) of one ``batch_query_keys`` answer; None if absent."""
    if not isinstance(item, dict) or not item.get("ok"):
        return None
    dram = [v for v in item.get("values") or () if isinstance(v, dict) and isinstance(v.get("size_"), int)]
    disk = [v for v in item.get("local_disk_values") or ()
            if isinstance(v, dict) and isinstance(v.get("object_size"), int)]
    if dram:
        return dram[0]["size_"], True, bool(disk)  # one replica: the value's own size
    if disk:
        return disk[0]["object_size"], False, True
    return None


def _query_sizes(base: str, keys: Sequence[str], timeout: float) -> list[tuple[int, bool, bool]]:
    query = urllib.parse.quote(",".join(keys), safe="/,")
    try:
        with urllib.request.urlopen(f"{base}/batch_query_keys?keys={query}", timeout=timeout) as resp:  # noqa: S310
            data = json.loads(resp.read(64 << 20))
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise StoreUnavailableError(f"mooncake_master at {base} did not answer GET /batch_query_keys: "
                                    f"{exc}") from None
    found = data.get("data") if isinstance(data, dict) else None
    out = [_replica(found.get(key) if isinstance(found, dict) else None) for key in keys]
    return [r for r in out if r is not None]


def _measure(base: str, entry: NamespaceEntry, timeout: float) -> None:
    if not entry.sample:
        entry.bytes = 0
        return
    found: list[tuple[int, bool, bool]] = []
    for i in range(0, len(entry.sample), _QUERY_BATCH):
        found += _query_sizes(base, entry.sample[i:i + _QUERY_BATCH], timeout)
    if not found:
        return  # every sampled key vanished meanwhile: unknown
    sizes = [s for s, _, _ in found]
    dram = sum(d for _, d, _ in found)
    disk = sum(k for _, _, k in found)
    if len(entry.sample) >= entry.keys and len(sizes) == len(entry.sample):
        entry.bytes, entry.in_dram, entry.on_disk = sum(sizes), dram, disk
    else:
        scale = entry.keys / len(sizes)
        entry.bytes, entry.bytes_estimated = round(sum(sizes) * scale), True
        entry.in_dram, entry.on_disk = round(dram * scale), round(disk * scale)


def engine_fields(ns: KeyNamespace) -> tuple[tuple[str, object], ...]:
    """What identifies one engine's namespaces: every field but the rank ones."""
    return tuple((k, v) for k, v in asdict(ns).items() if k not in _RANK_FIELDS)


@dataclass(frozen=True)
class Split:
    """Several engine namespaces of one model inside one tenant and cache_prefix."""

    model: str
    scope: tuple[tuple[str, str], ...]  #: (tenant / cache_prefix, value) when set
    groups: tuple[tuple[tuple[str, object], ...], ...]  #: each group's engine_fields
    keys: tuple[int, ...]  #: values per group
    differ: tuple[tuple[str, tuple[object, ...]], ...]  #: (field, value per group)

    def text(self) -> str:
        diffs = ", ".join(f"{n} ({' vs '.join(str(v) for v in vals)})" for n, vals in self.differ)
        counts = " / ".join(f"{k} value(s)" for k in self.keys)
        scope = "".join(f", {n} {v}" for n, v in self.scope)
        return (f"{len(self.groups)} namespaces for model {self.model}{scope}: differ in {diffs} — "
                f"instances of these never share KV [{counts}]")


def splits(inv: PoolInventory) -> list[Split]:
    """Per model, tenant and cache_prefix (those separate on purpose) with more than one
    engine namespace registered: which fields differ, most telling first."""
    scopes: dict[tuple[str, str, str], dict[tuple, int]] = {}
    for entry in inv.entries.values():
        ns = entry.namespace
        if ns is not None:
            groups = scopes.setdefault((ns.model_id, ns.tenant, ns.cache_prefix), {})
            key = engine_fields(ns)
            groups[key] = groups.get(key, 0) + entry.keys
    out: list[Split] = []
    for (model, tenant, prefix), groups in sorted(scopes.items()):
        if len(groups) < 2:
            continue
        ordered = sorted(groups, key=lambda g: tuple(v for _, v in g))  # one type per field
        differ = tuple((name, tuple(dict(g)[name] for g in ordered)) for name in _DIFF_ORDER
                       if len({dict(g)[name] for g in ordered}) > 1)
        scope = tuple((n, v) for n, v in (("tenant", tenant), ("cache_prefix", prefix)) if v)
        out.append(Split(model, scope, tuple(ordered), tuple(groups[g] for g in ordered), differ))
    return out
