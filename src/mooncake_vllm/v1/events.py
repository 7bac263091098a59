"""KV events for KV-aware routers: what the pool holds, through vLLM's KV-event publisher.

Where the release carries connector KV events (fact ``connector_kv_events``) and
the server runs with ``--kv-events-config`` (``enable_kv_cache_events``):

* **Workers** (:class:`WorkerEvents`) note, after each save, which of its keys the
  pool answers present (one batched, time-boxed lookup on the save thread), and
  after a load that failed, which of its keys the pool no longer has. The
  records ride the worker's stats each step (``get_kv_connector_stats``:
  ``MultiConnector`` forwards its children's stats, not their worker events) to the
  scheduler side (``update_connector_output``), as :class:`PoolKVEvents`.
* **The scheduler side** (:class:`SchedulerEvents`) knows, for every chunk it
  planned to save or load, vLLM's block hash, the parent hash and the tokens. A
  chunk becomes ``BlockStored(medium="MOONCAKE")`` once EVERY rank (TP x PP) has
  it in the pool, and ``BlockRemoved(medium="MOONCAKE")`` when a rank found it gone;
  vLLM publishes them with its own (``take_events``). Chunks are named by vLLM's
  block hashes (the hashes of its GPU-tier events), so a router can tell which
  prefixes an instance can load from the pool.

Nothing here blocks the engine: the extra lookups run on the save and load threads.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_vllm.compat.facts import installed_facts
from mooncake_vllm.v1.namespace import block_hashes

try:  # vLLM >= 0.13.0 (fact connector_kv_events)
    from vllm.distributed.kv_events import KVConnectorKVEvents as _EventsBase
except ImportError:  # pragma: no cover - older releases never collect connector events
    _EventsBase = object

__all__ = ["POOL_MEDIUM", "PoolKVEvents", "SchedulerEvents", "WorkerEvents", "kv_events_wanted"]

log = logging.getLogger(__name__)

#: ``medium`` of the pool's events (vLLM's own tiers are "GPU", "CPU", "STORAGE").
POOL_MEDIUM = "MOONCAKE"
STORED, REMOVED = "stored", "removed"
_MAX_BLOCKS = 1 << 16  # chunk descriptors (and partial-rank records) kept, oldest dropped first


def kv_events_wanted(vllm_config: Any) -> bool:
    """The server publishes KV events and this vLLM carries connector events to the publisher."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    if not getattr(cfg, "enable_kv_cache_events", False):
        return False
    facts = installed_facts()
    return facts is not None and facts.connector_kv_events


class PoolKVEvents(_EventsBase):
    """One step's pool observations of one or more workers: ``(side, kind, digest)`` records.

    vLLM's output aggregator merges the workers' containers; only our scheduler
    side reads the records (picklable: they cross process boundaries).
    """

    def __init__(self, records: Iterable[tuple[str, str, str]] = (), workers: int = 1) -> None:
        self.records = list(records)
        self.workers = workers

    def add_events(self, events: list[Any]) -> None:
        self.records.extend(events)

    def aggregate(self) -> PoolKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list[Any]:
        return list(self.records)

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.records.clear()

    def merge(self, other: Any) -> PoolKVEvents:
        self.add_events(other.get_all_events())
        return self

    def __repr__(self) -> str:
        return f"<PoolKVEvents {len(self.records)} records from {self.workers} worker(s)>"


def _digest(key: str) -> str:
    return key.rsplit("/", 1)[-1]


class WorkerEvents:
    """Per-worker pool observations, taken once per step."""

    def __init__(self, side: str) -> None:
        self.side = side  #: "tp<r>-pp<r>", distinct per rank
        self._lock = threading.Lock()
        self._records: list[tuple[str, str, str]] = []

    def _note(self, kind: str, keys: Iterable[str]) -> None:
        with self._lock:
            self._records += [(self.side, kind, _digest(k)) for k in keys]

    def saved(self, client: Any, keys: Sequence[str]) -> None:
        """After a save: the keys the pool now holds (stored now or before)."""
        present = client.exists(list(keys))
        self._note(STORED, [k for k, p in zip(keys, present) if p])

    def load_failed(self, client: Any, keys: Sequence[str], ok: Sequence[bool]) -> None:
        """After a load with failures: the keys the pool no longer holds."""
        failed = [k for k, good in zip(keys, ok) if not good]
        present = client.exists(failed)
        # a failed lookup answers all-False: only trust "absent" when the pool answered at all
        health = getattr(client, "health", None)
        if health is not None and health.breaker.is_open:
            return
        self._note(REMOVED, [k for k, p in zip(failed, present) if not p])

    def take(self) -> PoolKVEvents | None:
        with self._lock:
            records, self._records = self._records, []
        return PoolKVEvents(records) if records else None


@dataclass(frozen=True)
class _Chunk:
    block_hash: Any
    parent: Any
    token_ids: tuple[int, ...]
    lora_id: int | None
    lora_name: str | None


class SchedulerEvents:
    """Chunk descriptors of planned saves/loads, and the events they turn into."""

    def __init__(self, block_size: int, world: int, *, medium: str = POOL_MEDIUM) -> None:
        self.block_size = block_size
        self.world = world  #: ranks that must hold a chunk before it counts as stored
        self.medium = medium
        self._chunks: OrderedDict[str, _Chunk] = OrderedDict()
        self._ranks: OrderedDict[str, set[str]] = OrderedDict()
        self._stored: list[str] = []
        self._removed: list[str] = []
        self.counters = {"stored_events": 0, "removed_events": 0, "unnamed_chunks": 0,
                         "dropped_records": 0}

    # ------------------------------------------------------------------ planning
    def planned(self, meta: Any, requests: Any) -> None:
        """Remember vLLM's names of the chunks this step's jobs move."""
        for job in (*meta.saves, *meta.loads):
            st = requests.get(job.req_id)
            request = getattr(st, "request", None)
            if request is None or not job.digests:
                continue
            try:
                first = st.digests.index(job.digests[0])
            except ValueError:
                continue
            for offset, digest in enumerate(job.digests):
                chunk = self._describe(request, first + offset)
                if chunk is None:
                    self.counters["unnamed_chunks"] += 1
                    continue
                self._chunks[digest] = chunk
                self._chunks.move_to_end(digest)
            while len(self._chunks) > _MAX_BLOCKS:
                self._chunks.popitem(last=False)

    def _describe(self, request: Any, index: int) -> _Chunk | None:
        hashes = block_hashes(request)
        if index >= len(hashes):
            return None
        bs = self.block_size
        tokens = getattr(request, "prompt_token_ids", None) or ()
        lora = getattr(request, "lora_request", None)
        return _Chunk(_external(hashes[index]), _external(hashes[index - 1]) if index else None,
                      tuple(tokens[index * bs:(index + 1) * bs]),
                      getattr(lora, "lora_int_id", None) if lora is not None else None,
                      getattr(lora, "lora_name", None) if lora is not None else None)

    # ------------------------------------------------------------------ worker reports
    def received(self, events: Any) -> None:
        """Fold one step's worker records in."""
        if not isinstance(events, PoolKVEvents):
            return
        for side, kind, digest in events.get_all_events():
            if kind == REMOVED:
                self._ranks.pop(digest, None)
                self._removed.append(digest)
                continue
            ranks = self._ranks.setdefault(digest, set())
            ranks.add(side)
            if len(ranks) >= self.world:
                del self._ranks[digest]
                self._stored.append(digest)
        while len(self._ranks) > _MAX_BLOCKS:
            self._ranks.popitem(last=False)

    def take_events(self) -> list[Any]:
        """vLLM ``BlockStored`` / ``BlockRemoved`` events for what the workers reported."""
        stored, self._stored = self._stored, []
        removed, self._removed = self._removed, []
        if not stored and not removed:
            return []
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        fields = set(getattr(BlockStored, "__struct_fields__", ()))
        events: list[Any] = []
        for digest in dict.fromkeys(stored):
            chunk = self._chunks.get(digest)
            if chunk is None:
                continue
            kwargs: dict[str, Any] = {
                "block_hashes": [chunk.block_hash], "parent_block_hash": chunk.parent,
                "token_ids": list(chunk.token_ids), "block_size": self.block_size,
                "lora_id": chunk.lora_id, "medium": self.medium}
            if "lora_name" in fields:
                kwargs["lora_name"] = chunk.lora_name
            events.append(BlockStored(**kwargs))
        self.counters["stored_events"] += len(events)
        gone = [self._chunks[d].block_hash for d in dict.fromkeys(removed) if d in self._chunks]
        if gone:
            events.append(BlockRemoved(block_hashes=gone, medium=self.medium))
            self.counters["removed_events"] += len(gone)
        return events


def _external(block_hash: Any) -> Any:
    """vLLM's published form of a block hash (bytes, or int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    try:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    except ImportError:  # older releases hash into BlockHash tuples and publish their hash_value
        return getattr(block_hash, "hash_value", block_hash)
    return maybe_convert_block_hash(block_hash)
