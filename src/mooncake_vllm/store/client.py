"""The one Mooncake store client both engines use.

What it adds over ``mooncake.store.MooncakeDistributedStore``:

* **fail fast** — a dead, wrong or hung master is a :class:`StoreUnavailableError`
  within ``timeout`` seconds (:mod:`~mooncake_vllm.store.connect`);
* **every call time-boxed** — lookups, puts, gets, values and close run on bounded
  worker pools with deadlines (:mod:`~mooncake_vllm.store.timebox`); an open
  circuit breaker sends nothing at all (:mod:`~mooncake_vllm.store.health`);
* **host and CUDA memory** — blocks move through registered slots with torch ops
  (:mod:`~mooncake_vllm.store.mover`), or zero-copy from host KV on save, or
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

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_vllm import codec
from mooncake_vllm.compat.detect import mooncake_is_cuda_build
from mooncake_vllm.config import StoreConfig
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.stats import StoreStats
from mooncake_vllm.store.codes import Code, call, describe, is_fatal
from mooncake_vllm.store.connect import open_store
from mooncake_vllm.store.direct import get_direct
from mooncake_vllm.store.fetch import MAX_BATCH, get_staged
from mooncake_vllm.store.health import FailureLog, PoolHealth
from mooncake_vllm.store.paths import LayoutPaths, SaveTicket, StagingSizes, choose_gpu_path
from mooncake_vllm.store.slots import Run, slots_of
from mooncake_vllm.store.timebox import CallRejected, CallTimedOut, LateRelease, TimeBox

__all__ = ["StoreClient"]

log = logging.getLogger(__name__)

#: slowest transfer rate a put/get is allowed before it counts as hung (bytes/s)
_MIN_RATE = 200e6
#: after "pool full", skip saves this long (backpressure, not an error storm)
_FULL_BACKOFF = 5.0


class StoreClient:
    """A connected Mooncake store client; use :meth:`connect`."""

    def __init__(self, store: Any, config: StoreConfig, *, op_timeout: float = 5.0,
                 lookup_timeout: float = 1.0, cooldown: float = 3.0,
                 cleanup: Callable[[], None] | None = None,
                 staging: StagingSizes | None = None, zero_copy: bool = True) -> None:
        self._store = store
        self.config = config
        self.stats = StoreStats()
        self._op_timeout = op_timeout
        #: existence queries sit on the scheduler's path
        self._lookup_timeout = min(lookup_timeout, op_timeout)
        self._cleanup = cleanup
        self._staging = staging or StagingSizes()
        #: zero-copy saves of host KV need Mooncake's multi-buffer API (>= 0.3.7)
        self._multi = zero_copy and hasattr(store, "batch_put_from_multi_buffers")
        # separate boxes: a save (on the save thread) never holds the worker a scheduler
        # lookup or a load needs, so neither waits behind it (nor is refused for it)
        self._lookups = TimeBox("lookup", 1)
        self._transfers = TimeBox("transfer", 2)
        self._save_lookups = TimeBox("save-lookup", 1)
        self._saves = TimeBox("save", 1)
        self._control = TimeBox("control", 1)
        #: hand-off markers, each box with one caller thread (a worker's save thread
        #: publishes, the scheduler's waiter reads), never competing with lookups
        self._publish = TimeBox("publish", 1)
        self._markers = TimeBox("markers", 1)
        self.health = PoolHealth(config.master_server_address, self._probe, self.stats,
                                 cooldown=cooldown)
        self.failures = FailureLog()
        self._paths: dict[int, LayoutPaths] = {}
        self._registered: set[tuple[int, int]] = set()
        self._full_until = 0.0
        self._closed = False

    @classmethod
    def connect(cls, config: StoreConfig, *, timeout: float = 5.0,
                store_factory: Callable[[], Any] | None = None,
                staging: StagingSizes | None = None, zero_copy: bool = True) -> StoreClient:
        """Set up a client, or raise :class:`StoreUnavailableError` within ``timeout``."""
        store, cleanup = open_store(config, timeout=timeout, store_factory=store_factory)
        return cls(store, config, op_timeout=timeout, cleanup=cleanup, staging=staging,
                   zero_copy=zero_copy)

    # ------------------------------------------------------------------ plumbing
    def _run(self, box: TimeBox, timeout: float, fn: Callable[..., Any], *args: Any,
             late: LateRelease | None = None) -> Any:
        """A time-boxed call; failures of the pool itself open the breaker."""
        try:
            result = box.run(timeout, fn, *args,
                             on_done=late.returned if late is not None else None)
        except CallTimedOut as exc:
            self.stats.add("timeouts")
            if late is not None:
                late.timed_out()
            self.health.failed(str(exc))
            return exc
        except CallRejected as exc:
            self.stats.add("rejected")
            self.health.failed(str(exc))
            return exc
        if isinstance(result, BaseException):
            self.health.failed(f"{getattr(fn, '__name__', 'call')} raised {type(result).__name__}")
        return result

    def _transfer_timeout(self, nbytes: int) -> float:
        return self._op_timeout + nbytes / _MIN_RATE

    def _probe(self) -> bool:
        """One real call: does the master answer an existence query in time?"""
        try:
            rc = self._control.run(self._op_timeout, self._store.is_exist, "mcv/probe")
        except (CallTimedOut, CallRejected):
            return False
        return not isinstance(rc, BaseException) and rc >= 0

    @property
    def healthy(self) -> bool:
        """Whether the client will currently talk to the pool."""
        return not self._closed and self.health.admit()

    def _note_failures(self, op: str, codes: Sequence[Any]) -> list[int]:
        """Count, log (rate-limited, by cause) and react to failed codes of one batch."""
        failed = [c for c in codes if isinstance(c, int) and c < 0
                  and c not in (Code.OBJECT_ALREADY_EXISTS, Code.OBJECT_NOT_FOUND)]
        if op == "put":
            failed += [c for c in codes if c == Code.OBJECT_NOT_FOUND]
        for code in sorted(set(failed)):
            n = failed.count(code)
            self.stats.add(f"{op}_failed_{Code(code).name.lower()}" if code in Code._value2member_map_
                           else f"{op}_failed_other", n)
            self.failures.warn(f"{op}{code}", f"mooncake-vllm: {n} block {op}(s) failed with "
                               f"{describe(code)}")
            if code == Code.NO_AVAILABLE_HANDLE:
                self._full_until = time.monotonic() + _FULL_BACKOFF
        if any(is_fatal(c) for c in failed):
            self.health.failed(f"batch {op} returned {sorted(set(failed))}")
        return failed

    # ------------------------------------------------------------------ queries
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Presence of every key, in one batched, time-boxed query; ``False`` on any error."""
        return self._exists(keys, self._lookups)

    def _exists(self, keys: Sequence[str], box: TimeBox) -> list[bool]:
        if not keys:
            return []
        self.stats.add("lookups")
        if self._closed or not self.health.admit():
            self.stats.add("lookup_errors", len(keys))
            return [False] * len(keys)
        start = time.perf_counter()
        codes = self._run(box, self._lookup_timeout, self._batch_exist, list(keys))
        if isinstance(codes, BaseException) or (codes and all(c < 0 for c in codes)):
            self.stats.add("lookup_errors", len(keys))
            if not isinstance(codes, BaseException):
                self.health.failed(f"batch_is_exist returned {sorted(set(codes))}")
            return [False] * len(keys)
        self.stats.observe("exists", time.perf_counter() - start)
        return [c == 1 for c in codes]

    def _batch_exist(self, keys: list[str]) -> list[int]:
        if hasattr(self._store, "batch_is_exist"):
            return list(self._store.batch_is_exist(keys))
        return [self._store.is_exist(k) for k in keys]

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
    def register_layout(self, layout: BlockLayout, gpu_path: str = "auto") -> None:
        """Set up the staging slots (and, for zero-copy, register the KV memory).

        ``gpu_path`` (``auto`` | ``staged`` | ``zero_copy``): how a KV cache in
        CUDA memory moves (:func:`~mooncake_vllm.store.paths.choose_gpu_path`).
        """
        if id(layout) in self._paths:
            return

        def register(ptr: int, nbytes: int) -> int:
            rc = call(self._store.register_buffer, ptr, nbytes)
            return rc if isinstance(rc, int) else -1

        multi = self._multi and not layout.on_cuda and self._register_kv(layout, register)
        direct = False
        if layout.on_cuda:
            path, why = choose_gpu_path(
                gpu_path, protocol=self.config.protocol, cuda_build=self._cuda_build(),
                multi_buffer=self._multi and hasattr(self._store, "batch_get_into_multi_buffers"),
                whole_words=layout.seg_nbytes % 8 == 0)
            if path == "zero_copy" and not self._register_kv(layout, register):
                path, why = "staged", "Mooncake refused to register the KV cache's CUDA memory"
            direct = path == "zero_copy"
            (log.warning if gpu_path == "zero_copy" and not direct else log.info)(
                "mooncake-vllm: CUDA KV cache moves %s (%s)",
                "straight between GPU memory and the pool" if direct
                else "through pinned staging slots", why)
        paths = LayoutPaths(layout, register, multi_buffer=multi, sizes=self._staging,
                            gpu_zero_copy=direct)
        if not paths.registered:
            log.warning("mooncake-vllm: Mooncake refused to register staging memory; "
                        "transfers through it may fail")
        self._paths[id(layout)] = paths
        log.info("mooncake-vllm: KV cache on %s, %s saves, loads through %d staging slots",
                 layout.device, "zero-copy" if paths.zero_copy_save else "snapshot",
                 paths.load_pool.count)

    def gpu_path(self, layout: BlockLayout) -> str:
        """``zero_copy`` or ``staged`` for a registered CUDA layout, ``host`` otherwise."""
        paths = self._paths_for(layout)
        if not layout.on_cuda:
            return "host"
        return "zero_copy" if paths.gpu_zero_copy else "staged"

    def _cuda_build(self) -> bool:
        """Whether this Mooncake reads GPU addresses (a CUDA build; tests may say so)."""
        flag = getattr(self._store, "reads_gpu_memory", None)
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
    def prepare_save(self, keys: Sequence[str], layout: BlockLayout,
                     block_ids: Sequence[int], *, defer_fence: bool = False) -> SaveTicket:
        """Capture a save now (no pool call): a snapshot, or checksums of the blocks.

        ``defer_fence`` (a caller that keeps the blocks until it frees them): a CUDA
        snapshot's read of the blocks is not waited for by vLLM's stream; the caller
        must ``ticket.fence.order()`` before vLLM may reuse them.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        paths = self._paths_for(layout)
        if not keys or self._closed or not self.health.admit() or time.monotonic() < self._full_until:
            if keys:
                self.stats.add("saves_skipped", len(keys))
            return SaveTicket([], [], layout, snapshot=True)
        ticket = paths.capture(list(keys), list(block_ids), defer_fence=defer_fence)
        if ticket.dropped:
            self.stats.add("saves_dropped_no_slot", ticket.dropped)
            self.failures.warn("slots", f"mooncake-vllm: {ticket.dropped} block save(s) dropped: "
                               "the staging slots are all waiting for puts (the pool is slower "
                               "than the engine; raise the staging size or the pool's bandwidth)")
        return ticket

    def commit_save(self, ticket: SaveTicket) -> int:
        """Put a captured save (existing keys are skipped); how many blocks were new."""
        paths = self._paths_for(ticket.layout)
        try:
            if not ticket.keys or self._closed or not self.health.admit():
                return 0
            present = self._exists(ticket.keys, self._save_lookups)
            todo = [i for i, p in enumerate(present) if not p]
            self.stats.add("skipped_existing", len(ticket.keys) - len(todo))
            stored = 0
            for i in range(0, len(todo), MAX_BATCH):
                if not self.health.admit():  # the lookup (or a batch) just found it away
                    self.stats.add("saves_skipped", len(todo) - i)
                    return stored
                ok = self._put_batch(paths, ticket, todo[i:i + MAX_BATCH])
                if ok is None:
                    return stored  # abandoned: the late call hands the slots back
                stored += ok
            return stored
        finally:
            if not ticket.abandoned:
                paths.release(ticket)

    def discard(self, ticket: SaveTicket) -> None:
        """Drop a captured save without putting it (its slots are handed back)."""
        self._paths_for(ticket.layout).release(ticket)

    def put_blocks(self, keys: Sequence[str], layout: BlockLayout,
                   block_ids: Sequence[int]) -> int:
        """Store blocks under ``keys`` now (capture + put); returns how many were new."""
        return self.commit_save(self.prepare_save(keys, layout, block_ids))

    def _put_batch(self, paths: LayoutPaths, ticket: SaveTicket, keep: list[int]) -> int | None:
        keys = [ticket.keys[i] for i in keep]
        nbytes = len(keep) * paths.slot_nbytes
        header_runs: list[Run] = []
        start = time.perf_counter()
        if ticket.snapshot:
            ptrs, sizes = paths.frame_snapshot(ticket, keep)
            late = LateRelease(lambda: paths.release(ticket))
            codes = self._run(self._saves, self._transfer_timeout(nbytes),
                              self._store.batch_put_from, keys, ptrs, sizes, late=late)
        else:
            header_runs = paths.header_pool.take(len(keep))
            if len(slots_of(header_runs)) < len(keep):
                paths.header_pool.release(header_runs)
                self.stats.add("saves_dropped_no_slot", len(keep))
                return 0
            ptrs, msizes = paths.frame_zero_copy(ticket, keep, header_runs)
            late = LateRelease(lambda: paths.header_pool.release(header_runs))
            codes = self._run(self._saves, self._transfer_timeout(nbytes),
                              self._store.batch_put_from_multi_buffers, keys, ptrs, msizes,
                              late=late)
        if isinstance(codes, CallTimedOut):
            ticket.abandoned = True
            self.stats.add("saves_abandoned", len(keys))
            return None
        if header_runs:
            paths.header_pool.release(header_runs)
        if isinstance(codes, BaseException):
            return 0
        self.stats.observe("put", time.perf_counter() - start)
        good = [i for i, c in zip(keep, codes) if c in (Code.OK, Code.OBJECT_ALREADY_EXISTS)]
        self._note_failures("put", codes)
        if not ticket.snapshot:
            good = self._recheck(paths, ticket, good)
        self.stats.add("blocks_put", len(good))
        self.stats.add("bytes_put", len(good) * paths.layout.block_nbytes)
        return len(good)

    def _recheck(self, paths: LayoutPaths, ticket: SaveTicket, good: list[int]) -> list[int]:
        """Zero-copy: remove values whose block changed while it was being put."""
        raced = [i for i, ok in zip(good, paths.intact(ticket, good)) if not ok] if good else []
        for i in raced:
            self._run(self._control, self._op_timeout, self._remove, ticket.keys[i])
        if raced:
            self.stats.add("save_raced", len(raced))
            self.failures.warn("raced", f"mooncake-vllm: {len(raced)} block(s) changed while "
                               "being saved (vLLM reused them); their values were removed")
        return [i for i in good if i not in set(raced)]

    def _remove(self, key: str) -> Any:
        try:
            return self._store.remove(key, True)
        except TypeError:  # releases before remove(force)
            return self._store.remove(key)

    # ------------------------------------------------------------------ loads
    def remove_matching(self, pattern: str) -> int | None:
        """Remove every key matching the regular expression ``pattern`` (leases ignored:
        a reader of a removed value fails its checksum and recomputes); the count removed,
        or ``None`` when the pool is away or has no ``remove_by_regex`` (Mooncake < 0.3.6)."""
        remove = getattr(self._store, "remove_by_regex", None)
        if self._closed or remove is None or not self.health.admit():
            return None
        rc = self._run(self._control, self._op_timeout, remove, pattern, True)
        return rc if isinstance(rc, int) and not isinstance(rc, bool) and rc >= 0 else None

    def stream_position(self, layout: BlockLayout) -> Any:
        """For a background load: an event on vLLM's stream, taken on vLLM's thread."""
        return self._paths_for(layout).mover.stream_position()

    def get_blocks(self, keys: Sequence[str], layout: BlockLayout, block_ids: Sequence[int],
                   *, after: Any = None, background: bool = False) -> list[bool]:
        """Load blocks into the KV cache; ``True`` where loaded and verified.

        On CUDA the copies are ordered on vLLM's stream (no layer reads a block
        before it is loaded). ``background``: called off vLLM's thread for a
        request vLLM schedules only once told: the copies start after ``after``
        (:meth:`stream_position`) and are complete when this returns.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        paths = self._paths_for(layout)
        if background and paths.gpu_zero_copy_loads:
            out = get_direct(self, paths, keys, block_ids, after) if keys else []
            self._count_loaded(layout, out)
            return out
        out = get_staged(self, paths, keys, block_ids, after, background)
        self._count_loaded(layout, out)
        return out

    def _count_loaded(self, layout: BlockLayout, out: list[bool]) -> None:
        loaded = sum(out)
        self.stats.add("blocks_got", loaded)
        self.stats.add("bytes_got", loaded * layout.block_nbytes)
        self.stats.add("load_failed", len(out) - loaded)

    # ------------------------------------------------------------------ values
    def put_value(self, key: str, data: bytes | memoryview) -> bool:
        """Store a small framed value (e.g. a V0 prompt tail); ``False`` on failure."""
        if self._closed or not self.health.admit():
            return False
        rc = self._run(self._control, self._op_timeout, self._store.put, key,
                       codec.frame_value(key, data))
        if rc not in (Code.OK, Code.OBJECT_ALREADY_EXISTS):
            self.stats.add("errors")
            if isinstance(rc, int):
                self._note_failures("put", [rc])
            return False
        return True

    def get_value(self, key: str) -> bytes | None:
        """A value stored with :meth:`put_value`, or ``None`` if missing or damaged."""
        if self._closed or not self.health.admit():
            return None
        raw = self._run(self._control, self._op_timeout, self._store.get, key)
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
        if self._closed or not self.health.admit():
            return False

        def publish() -> int:
            codes = list(self._batch_exist(list(chunk_keys))) if chunk_keys else []
            present = next((i for i, c in enumerate(codes) if c != 1), len(codes))
            return self._store.put(key, codec.frame_value(key, value(present)))

        rc = self._run(self._publish, self._op_timeout, publish)
        return rc in (Code.OK, Code.OBJECT_ALREADY_EXISTS)

    def take_markers(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each marker's payload (``None``: absent or damaged); a marker read is removed (it
        has one reader). One time-boxed call on the markers box."""
        if not keys or self._closed or not self.health.admit():
            return [None] * len(keys)

        def take() -> list[bytes | None]:
            out: list[bytes | None] = []
            for key, code in zip(keys, self._batch_exist(list(keys))):
                raw = self._store.get(key) if code == 1 else None
                out.append(codec.unframe_value(key, raw) if raw else None)
                if raw:
                    self._remove(key)
            return out

        got = self._run(self._markers, self._lookup_timeout, take)
        return [None] * len(keys) if isinstance(got, BaseException) else got

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Close the client (its segment, if any, is unmounted by Mooncake)."""
        if self._closed:
            return
        self._closed = True
        self.health.close()
        self._lookups.close()
        self._transfers.close()
        self._publish.close()
        self._markers.close()
        self._save_lookups.close()
        self._saves.close()
        closer = threading.Thread(target=call, args=(self._store.close,), daemon=True,
                                  name="mcv-close")
        closer.start()
        closer.join(self._op_timeout)  # a dead master must not hang shutdown
        self._control.close()
        if self._cleanup:
            self._cleanup()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
