"""The one Mooncake store client both engines use.

What it adds over ``mooncake.store.MooncakeDistributedStore``:

* **fail fast** — a dead, wrong or hung master is a :class:`StoreUnavailableError`
  within ``timeout`` seconds (:mod:`~mooncake_vllm.store.connect`);
* **every call time-boxed** — lookups, puts, gets, values and close run on bounded
  worker pools with deadlines (:mod:`~mooncake_vllm.store.timebox`); an open
  circuit breaker sends nothing at all (:mod:`~mooncake_vllm.store.health`);
* **host and CUDA memory** — blocks move through registered slots with torch ops
  (:mod:`~mooncake_vllm.store.mover`), or zero-copy with host KV (saves of large
  pieces; background loads, verified in place: :mod:`~mooncake_vllm.store.direct`), or
  straight between GPU memory and the pool with checksums computed on the GPU
  (``gpu_path``, :func:`~mooncake_vllm.store.paths.choose_gpu_path`,
  :mod:`~mooncake_vllm.store.direct`);
* **never wrong KV** — every value carries a :mod:`~mooncake_vllm.codec` header
  whose checksum is taken while the bytes are known good (:class:`SaveTicket`);
  a truncated, foreign, corrupt or raced value is a miss;
* **counters and rate-limited warnings** — :class:`~mooncake_vllm.stats.StoreStats`,
  one line per failure cause per minute, naming the fix.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mooncake_vllm import codec
from mooncake_vllm.compat.detect import mooncake_is_cuda_build
from mooncake_vllm.config import StoreConfig
from mooncake_vllm.keys import seen_key
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.settings import SAVE_ADMISSIONS
from mooncake_vllm.stats import StoreStats
from mooncake_vllm.store.codes import Code
from mooncake_vllm.store.connect import open_store
from mooncake_vllm.store.direct import get_direct
from mooncake_vllm.store.fetch import get_staged
from mooncake_vllm.store.health import FailureLog, PoolHealth
from mooncake_vllm.store.misses import missed
from mooncake_vllm.store.mover import checksums_on_device
from mooncake_vllm.store.paths import LayoutPaths, SaveTicket, StagingSizes, choose_gpu_path
from mooncake_vllm.store.probe import probe_loads
from mooncake_vllm.store.puts import put_ticket
from mooncake_vllm.store.timebox import TimeBox
from mooncake_vllm.store.transport import Transport

__all__ = ["LANE_BUFFER", "StoreClient"]

log = logging.getLogger(__name__)

#: local buffer of each extra store client (lanes carry registered transfers only)
LANE_BUFFER = 16 << 20


class StoreClient:
    """A connected Mooncake store client; use :meth:`connect`."""

    def __init__(self, store: Any, config: StoreConfig, *, op_timeout: float = 5.0,
                 lookup_timeout: float = 1.0, cooldown: float = 3.0,
                 cleanup: Callable[[], None] | None = None,
                 staging: StagingSizes | None = None, zero_copy: bool = True,
                 open_lane: Callable[[], Any] | None = None) -> None:
        self.transport = Transport(store, config, op_timeout=op_timeout,
                                   lookup_timeout=lookup_timeout, cooldown=cooldown,
                                   cleanup=cleanup)
        self.config = config
        self._staging = staging or StagingSizes()
        #: zero-copy saves of host KV need Mooncake's multi-buffer API (>= 0.3.7)
        self._multi = zero_copy and hasattr(store, "batch_put_from_multi_buffers")
        self._open_lane = open_lane
        self._paths: dict[int, LayoutPaths] = {}
        self._registered: set[tuple[int, int]] = set()

    @classmethod
    def connect(cls, config: StoreConfig, *, timeout: float = 5.0,
                store_factory: Callable[[], Any] | None = None,
                staging: StagingSizes | None = None, zero_copy: bool = True) -> StoreClient:
        """Set up a client, or raise :class:`StoreUnavailableError` within ``timeout``.

        More store clients (lanes) are opened when a layout is registered with
        ``clients`` > 1: pure clients (no segment) with a small local buffer."""
        opened = open_store(config, timeout=timeout, store_factory=store_factory)
        lane_config = dataclasses.replace(config, global_segment_size=0,
                                          local_buffer_size=min(config.local_buffer_size,
                                                                LANE_BUFFER))

        def open_lane() -> Any:
            return open_store(lane_config, timeout=timeout, store_factory=store_factory,
                              metadata=opened.metadata).store

        return cls(opened.store, config, op_timeout=timeout, cleanup=opened.cleanup,
                   staging=staging, zero_copy=zero_copy, open_lane=open_lane)

    # ------------------------------------------------------------------ plumbing
    @property
    def stats(self) -> StoreStats:
        """Counters of every call this client made."""
        return self.transport.stats

    @property
    def health(self) -> PoolHealth:
        """The pool's breaker state, as this client sees it."""
        return self.transport.health

    @property
    def failures(self) -> FailureLog:
        """Rate-limited failure lines (one per cause per interval)."""
        return self.transport.failures

    @property
    def lanes(self) -> int:
        """How many store clients carry this client's block transfers."""
        return len(self.transport.lanes)

    @property
    def store(self) -> Any:
        """The raw ``MooncakeDistributedStore`` of lane 0 (benchmarks and tests)."""
        return self.transport.store

    @property
    def healthy(self) -> bool:
        """Whether the client will currently talk to the pool."""
        return self.transport.admits()

    # ------------------------------------------------------------------ queries
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Presence of every key, in one batched, time-boxed query; ``False`` on any error."""
        return self._exists(keys, self.transport.lookups)

    def audit_exists(self, keys: Sequence[str]) -> list[bool] | None:
        """:meth:`exists` on the audits' own time box (their thread never holds the worker
        vLLM's lookups need); ``None`` when the pool did not answer (nothing is known lost)."""
        return self._answer(keys, self.transport.audit_lookups)

    def _exists(self, keys: Sequence[str], box: TimeBox) -> list[bool]:
        present = self._answer(keys, box)
        return [False] * len(keys) if present is None else present

    def _answer(self, keys: Sequence[str], box: TimeBox) -> list[bool] | None:
        """The pool's answer, or ``None`` when it gave none (counted as errors; a miss of the
        scheduler's lookups only: a save's or an audit's check misses nothing)."""
        if not keys:
            return []
        t = self.transport
        t.stats.add("lookups")
        if not t.admits():
            t.stats.add("lookup_errors", len(keys))
            if box is t.lookups:
                missed(t, "pool_away", len(keys))
            return None
        start = time.perf_counter()
        codes = t.run(box, t.lookup_timeout, t.batch_exist, list(keys))
        if isinstance(codes, BaseException) or (codes and all(c < 0 for c in codes)):
            t.stats.add("lookup_errors", len(keys))
            if box is t.lookups:
                missed(t, "lookup_failed", len(keys))
            if not isinstance(codes, BaseException):
                t.health.failed(f"batch_is_exist returned {sorted(set(codes))}")
            return None
        t.stats.observe("exists", time.perf_counter() - start)
        return [c == 1 for c in codes]

    def longest_prefix(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are all present in the pool."""
        count = 0
        for present in self.exists(keys):
            if not present:
                break
            count += 1
        self.stats.add("hits", count)
        self.stats.add("misses", len(keys) - count)
        return count

    # ------------------------------------------------------------------ layouts
    def register_layout(self, layout: BlockLayout, gpu_path: str = "auto",
                        clients: int = 1) -> None:
        """Set up the staging slots (and, for zero-copy, register the KV memory).

        ``gpu_path`` (``auto`` | ``staged`` | ``zero_copy``): how a KV cache in
        CUDA memory moves (:func:`~mooncake_vllm.store.paths.choose_gpu_path`).
        ``clients``: store clients to stripe this process's block transfers over
        (opened here, before anything is registered, so each registers it all).
        """
        if id(layout) in self._paths:
            return
        if clients > 1 and self._open_lane is not None:
            got = self.transport.add_lanes(clients, self._open_lane)
            log.info("mooncake-vllm: block transfers striped over %d store client(s)", got)

        def register(ptr: int, nbytes: int) -> int:
            return 0 if self.transport.register(ptr, nbytes) else -1

        store = self.transport.store
        multi = self._multi and not layout.on_cuda and self._register_kv(layout, register)
        direct = False
        if layout.on_cuda:
            path, why = choose_gpu_path(
                gpu_path, protocol=self.config.protocol, cuda_build=self._cuda_build(),
                multi_buffer=self._multi and hasattr(store, "batch_get_into_multi_buffers"),
                whole_words=checksums_on_device(layout))
            if path == "zero_copy" and not self._register_kv(layout, register):
                path, why = "staged", "Mooncake refused to register the KV cache's CUDA memory"
            direct = path == "zero_copy"
            (log.warning if gpu_path == "zero_copy" and not direct else log.info)(
                "mooncake-vllm: CUDA KV cache moves %s (%s)",
                "straight between GPU memory and the pool" if direct
                else "through pinned staging slots", why)
        paths = LayoutPaths(layout, register, multi_buffer=multi, sizes=self._staging,
                            gpu_zero_copy=direct,
                            host_direct=multi and hasattr(store, "batch_get_into_multi_buffers"))
        if not paths.registered:
            log.warning("mooncake-vllm: Mooncake refused to register staging memory; "
                        "transfers through it may fail")
        self._paths[id(layout)] = paths
        log.info("mooncake-vllm: KV cache on %s, %s saves, loads through %d staging slots%s",
                 layout.device, "zero-copy" if paths.zero_copy_save else "snapshot",
                 paths.load_pool.count, " (background loads straight into the KV blocks)"
                 if paths.direct_loads else "")

    def gpu_path(self, layout: BlockLayout) -> str:
        """``zero_copy`` or ``staged`` for a registered CUDA layout, ``host`` otherwise."""
        paths = self._paths_for(layout)
        if not layout.on_cuda:
            return "host"
        return "zero_copy" if paths.gpu_zero_copy else "staged"

    def _cuda_build(self) -> bool:
        """Whether this Mooncake reads GPU addresses (a CUDA build; tests may say so)."""
        flag = getattr(self.transport.store, "reads_gpu_memory", None)
        return bool(flag) if flag is not None else mooncake_is_cuda_build()

    def _register_kv(self, layout: BlockLayout, register: Callable[[int, int], int]) -> bool:
        ok = True
        for region in layout.regions():
            if region in self._registered:
                continue
            if register(*region) == 0:
                self._registered.add(region)
            else:
                ok = False
        if not ok:
            log.info("KV cache memory not registered with Mooncake: saves use a snapshot copy")
        return ok

    def _paths_for(self, layout: BlockLayout) -> LayoutPaths:
        if id(layout) not in self._paths:
            self.register_layout(layout)
        return self._paths[id(layout)]

    # ------------------------------------------------------------------ saves
    def saves_snapshot(self, layout: BlockLayout) -> bool:
        """Whether a save of ``layout`` is a snapshot (its bytes copied out at capture: the
        blocks are free at once), not checksums of blocks kept until the put."""
        return not self._paths_for(layout).zero_copy_save

    def prepare_save(self, keys: Sequence[str], layout: BlockLayout,
                     block_ids: Sequence[int], *, defer_fence: bool = False,
                     admission: str = "all", always: Iterable[str] = ()) -> SaveTicket:
        """Capture a save now (no pool call): a snapshot, or checksums of the blocks.

        ``defer_fence`` (a caller that keeps the blocks until it frees them): a CUDA
        snapshot's read of the blocks is not waited for by vLLM's stream; the caller
        must ``ticket.fence.order()`` before vLLM may reuse them. ``admission``
        (``save_admission``): ``"repeat"`` stores a new block only if it was saved before
        (:meth:`commit_save`), except the keys in ``always``.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        if admission not in SAVE_ADMISSIONS:
            raise ValueError(f"save admission {admission!r}: use one of {', '.join(SAVE_ADMISSIONS)}")
        paths = self._paths_for(layout)
        if not keys or not self.transport.admits() or time.monotonic() < self.transport.full_until:
            if keys:
                self.stats.add("saves_skipped", len(keys))
            return SaveTicket([], [], layout, snapshot=True)
        ticket = paths.capture(list(keys), list(block_ids), defer_fence=defer_fence)
        ticket.repeat_only, ticket.always = admission == "repeat", frozenset(always)
        if ticket.dropped:
            self.stats.add("saves_dropped_no_slot", ticket.dropped)
            self.failures.warn("slots", f"mooncake-vllm: {ticket.dropped} block save(s) dropped: "
                               "the staging slots are all waiting for puts (the pool is slower "
                               "than the engine; raise the staging size or the pool's bandwidth)")
        return ticket

    def commit_save(self, ticket: SaveTicket) -> int:
        """Put a captured save (existing keys are skipped); how many blocks were new.

        The puts are striped over the store clients (:mod:`~mooncake_vllm.store.puts`).
        A ``repeat_only`` ticket stores only the blocks saved before (:meth:`_admitted`)."""
        paths = self._paths_for(ticket.layout)
        try:
            if not ticket.keys or not self.transport.admits():
                return 0
            present = self._exists(ticket.keys, self.transport.save_lookups)
            todo = [i for i, p in enumerate(present) if not p]
            self.stats.add("skipped_existing", len(ticket.keys) - len(todo))
            if ticket.repeat_only and todo:
                todo = self._admitted(ticket, todo)
            return put_ticket(self.transport, paths, ticket, todo)
        finally:
            if not ticket.abandoned:
                paths.release(ticket)

    def _admitted(self, ticket: SaveTicket, todo: list[int]) -> list[int]:
        """``save_admission: "repeat"``: the positions of ``todo`` to store — those whose mark
        is in the pool (saved before, by any instance) and those in ``ticket.always``. The
        others are first sightings: their marks are put instead (``saves_first_seen``); where
        the pool does not answer, none of them is stored (``saves_skipped``)."""
        ask = [i for i in todo if ticket.keys[i] not in ticket.always]
        if not ask:
            return todo
        marks = [seen_key(ticket.keys[i]) for i in ask]
        seen = self._answer(marks, self.transport.save_lookups)
        if seen is None:
            self.stats.add("saves_skipped", len(ask))
            first = set(ask)
        else:
            first = {i for i, s in zip(ask, seen) if not s}
            if first:
                self._put_marks([mark for i, mark in zip(ask, marks) if i in first])
        return [i for i in todo if i not in first]

    def mark_seen(self, keys: Sequence[str]) -> None:
        """First sightings under ``save_admission: "repeat"`` decided before any capture
        (the V1 scheduler, :mod:`mooncake_vllm.v1.admission`): put the marks of chunk
        ``keys``, store none of their KV (the pool away: ``saves_skipped``)."""
        if not keys:
            return
        if not self.transport.admits():
            self.stats.add("saves_skipped", len(keys))
            return
        self._put_marks([seen_key(k) for k in keys])

    def _put_marks(self, marks: list[str]) -> None:
        """Put the (empty, framed) ``marks`` in one time-boxed call: their blocks were not
        stored (``saves_first_seen``; ``seen_marks_put``, and ``seen_marks_failed`` for a
        failed one, which leaves its block a first sighting next time too)."""
        t = self.transport
        self.stats.add("saves_first_seen", len(marks))
        values = [codec.frame_value(mark, b"") for mark in marks]

        def put() -> list[int]:
            rc = t.store.put_batch(marks, values)  # Mooncake >= 0.3.5, as everything we need
            return list(rc) if isinstance(rc, (list, tuple)) else [rc] * len(marks)

        codes = t.run(t.control, t.op_timeout, put)
        ok = 0 if isinstance(codes, BaseException) else sum(
            1 for c in codes if c in (Code.OK, Code.OBJECT_ALREADY_EXISTS))
        if ok:
            t.stats.add("seen_marks_put", ok)
        if ok < len(marks):
            t.stats.add("seen_marks_failed", len(marks) - ok)

    def discard(self, ticket: SaveTicket) -> None:
        """Drop a captured save without putting it (its slots are handed back)."""
        self._paths_for(ticket.layout).release(ticket)

    def put_blocks(self, keys: Sequence[str], layout: BlockLayout,
                   block_ids: Sequence[int], *, admission: str = "all") -> int:
        """Store blocks under ``keys`` now (capture + put); returns how many were new."""
        return self.commit_save(self.prepare_save(keys, layout, block_ids, admission=admission))

    # ------------------------------------------------------------------ loads
    def remove_matching(self, pattern: str) -> int | None:
        """Remove every key matching the regular expression ``pattern`` (leases ignored:
        a reader of a removed value fails its checksum and recomputes); the count removed,
        or ``None`` when the pool is away or has no ``remove_by_regex`` (Mooncake < 0.3.6)."""
        return self.transport.remove_matching(pattern)

    def stream_position(self, layout: BlockLayout) -> Any:
        """For a background load: an event on vLLM's stream, taken on vLLM's thread."""
        return self._paths_for(layout).mover.stream_position()

    def get_blocks(self, keys: Sequence[str], layout: BlockLayout, block_ids: Sequence[int],
                   *, after: Any = None, background: bool = False) -> list[bool]:
        """Load blocks into the KV cache; ``True`` where loaded and verified.

        On CUDA the copies are ordered on vLLM's stream (no layer reads a block
        before it is loaded). ``background``: called off vLLM's thread for a
        request vLLM schedules only once told: the copies start after ``after``
        (:meth:`stream_position`) and are complete when this returns; into registered
        KV they go straight into the blocks, verified there (:mod:`.direct`).
        Transfers are striped over the store clients.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        paths = self._paths_for(layout)
        if background and paths.direct_loads:
            out = get_direct(self.transport, paths, keys, block_ids, after) if keys else []
        else:
            out = get_staged(self.transport, paths, keys, block_ids, after, background)
        loaded = sum(out)
        self.stats.add("blocks_got", loaded)
        self.stats.add("bytes_got", loaded * layout.block_nbytes)
        self.stats.add("load_failed", len(out) - loaded)
        return out

    def probe_loads(self, layout: BlockLayout) -> list[tuple[int, float]]:
        """Timed throw-away loads ``(blocks, seconds)`` through this layout's load slots,
        over every lane (:mod:`~mooncake_vllm.store.probe`); never touches the KV cache."""
        return probe_loads(self.transport, self._paths_for(layout))

    # ------------------------------------------------------------------ values
    def put_value(self, key: str, data: bytes | memoryview) -> bool:
        """Store a small framed value (e.g. a V0 prompt tail); ``False`` on failure."""
        t = self.transport
        if not t.admits():
            return False
        rc = t.run(t.control, t.op_timeout, t.store.put, key, codec.frame_value(key, data))
        if rc not in (Code.OK, Code.OBJECT_ALREADY_EXISTS):
            self.stats.add("errors")
            if isinstance(rc, int):
                t.note_failures("put", [rc])
            return False
        return True

    def get_value(self, key: str) -> bytes | None:
        """A value stored with :meth:`put_value`, or ``None`` if missing or damaged."""
        t = self.transport
        if not t.admits():
            return None
        raw = t.run(t.control, t.op_timeout, t.store.get, key)
        if isinstance(raw, BaseException) or not raw:
            return None
        payload = codec.unframe_value(key, raw)
        if payload is None:
            self.stats.add("corrupt")
        return payload

    # ------------------------------------------------------------------ hand-off markers
    def publish_marker(self, key: str, chunk_keys: Sequence[str],
                       value: Callable[[int], bytes]) -> bool:
        """Count the leading ``chunk_keys`` present, then put ``value(count)`` under ``key``
        (framed like :meth:`put_value`); one time-boxed call on the publish box."""
        t = self.transport
        if not t.admits():
            return False

        def publish() -> int:
            codes = t.batch_exist(list(chunk_keys)) if chunk_keys else []
            present = next((i for i, c in enumerate(codes) if c != 1), len(codes))
            return t.store.put(key, codec.frame_value(key, value(present)))

        rc = t.run(t.publish, t.op_timeout, publish)
        return rc in (Code.OK, Code.OBJECT_ALREADY_EXISTS)

    def take_markers(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each marker's payload (``None``: absent or damaged); a marker read is removed (it
        has one reader). One time-boxed call on the markers box."""
        t = self.transport
        if not keys or not t.admits():
            return [None] * len(keys)

        def read() -> list[bytes | None]:
            return [t.store.get(key) or None if code == 1 else None
                    for key, code in zip(keys, t.batch_exist(list(keys)))]

        # a late poll is asked again (the waiter's own bound ends the wait): it opens no
        # breaker, which would turn the lookup right after the wait into a 0-block miss.
        # Markers are removed only once their values are in hand: a read that overran its box
        # (and finishes later in the box's worker) leaves them for the next poll
        got = t.run(t.markers, t.lookup_timeout, read, breaker=False)
        if isinstance(got, BaseException):
            return [None] * len(keys)
        taken = [key for key, raw in zip(keys, got) if raw]
        if taken:
            t.run(t.markers, t.lookup_timeout, lambda: [t.remove(key) for key in taken], breaker=False)
        return [codec.unframe_value(key, raw) if raw else None for key, raw in zip(keys, got)]

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Close the client (its segment, if any, is unmounted by Mooncake)."""
        self.transport.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
