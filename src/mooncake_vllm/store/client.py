"""The one Mooncake store client both engines use.

What it adds over ``mooncake.store.MooncakeDistributedStore``:

* **fail fast** — a dead, wrong or hung master is a :class:`StoreUnavailableError`
  within ``timeout`` seconds (:mod:`~mooncake_vllm.store.connect`);
* **every call time-boxed** — lookups, puts, gets, values and close run on bounded
  worker pools with deadlines (:mod:`~mooncake_vllm.store.timebox`); an open
  circuit breaker sends nothing at all (:mod:`~mooncake_vllm.store.health`);
* **host and CUDA memory** — blocks move through registered slots with torch ops
  (:mod:`~mooncake_vllm.store.mover`), or zero-copy from host KV on save;
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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_vllm import codec
from mooncake_vllm.config import StoreConfig
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.stats import StoreStats
from mooncake_vllm.store.codes import Code, call, describe, is_fatal
from mooncake_vllm.store.connect import open_store
from mooncake_vllm.store.health import FailureLog, PoolHealth
from mooncake_vllm.store.paths import LayoutPaths, SaveTicket, StagingSizes
from mooncake_vllm.store.slots import Run, SlotPool, slots_of
from mooncake_vllm.store.timebox import CallRejected, CallTimedOut, LateRelease, TimeBox

__all__ = ["StoreClient"]

log = logging.getLogger(__name__)

_MAX_BATCH = 256
#: slowest transfer rate a put/get is allowed before it counts as hung (bytes/s)
_MIN_RATE = 200e6
#: after "pool full", skip saves this long (backpressure, not an error storm)
_FULL_BACKOFF = 5.0
#: a load is cut into about this many fetches, two in flight: verifying one overlaps
#: the transfer of the next (the checksum holds the GIL, Mooncake's call does not)
_LOAD_PIECES = 4
_MIN_FETCH = 16


@dataclass
class _Fetch:
    """One ``batch_get_into`` in flight: ``keys`` from position ``pos`` into ``runs``."""

    pos: int
    keys: list[str]
    runs: list[Run]
    future: Any
    late: LateRelease
    started: float


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
    def register_layout(self, layout: BlockLayout) -> None:
        """Set up the staging slots (and, for zero-copy saves, register the KV memory)."""
        if id(layout) in self._paths:
            return

        def register(ptr: int, nbytes: int) -> int:
            rc = call(self._store.register_buffer, ptr, nbytes)
            return rc if isinstance(rc, int) else -1

        multi = self._multi and not layout.on_cuda and self._register_kv(layout, register)
        paths = LayoutPaths(layout, register, multi_buffer=multi, sizes=self._staging)
        if not paths.registered:
            log.warning("mooncake-vllm: Mooncake refused to register staging memory; "
                        "transfers through it may fail")
        self._paths[id(layout)] = paths
        log.info("mooncake-vllm: KV cache on %s, %s saves, loads through %d staging slots",
                 layout.device, "zero-copy" if paths.zero_copy_save else "snapshot",
                 paths.load_pool.count)

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
                     block_ids: Sequence[int]) -> SaveTicket:
        """Capture a save now (no pool call): a snapshot, or checksums of host blocks."""
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        paths = self._paths_for(layout)
        if not keys or self._closed or not self.health.admit() or time.monotonic() < self._full_until:
            if keys:
                self.stats.add("saves_skipped", len(keys))
            return SaveTicket([], [], layout, snapshot=True)
        ticket = paths.capture(list(keys), list(block_ids))
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
            for i in range(0, len(todo), _MAX_BATCH):
                if not self.health.admit():  # the lookup (or a batch) just found it away
                    self.stats.add("saves_skipped", len(todo) - i)
                    return stored
                ok = self._put_batch(paths, ticket, todo[i:i + _MAX_BATCH])
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
        raced = [i for i in good if not paths.still_intact(ticket, i)]
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
        pool, n = paths.load_pool, len(keys)
        step = max(1, min(_MAX_BATCH, pool.count // 2, max(_MIN_FETCH, -(-n // _LOAD_PIECES))))
        out = [False] * n
        inflight: deque[_Fetch] = deque()
        pos, broken = 0, False
        while pos < n or inflight:
            while not broken and pos < n and len(inflight) < 2:
                fetch = self._start_fetch(paths, pos, list(keys[pos:pos + step]))
                if fetch is None and not inflight:
                    pool.settle()  # slots waiting on finished device copies
                    fetch = self._start_fetch(paths, pos, list(keys[pos:pos + step]))
                if fetch is None:
                    broken = not inflight
                    break
                inflight.append(fetch)
                pos += len(fetch.keys)
            if not inflight:
                break
            fetch = inflight.popleft()
            got = self._finish_fetch(paths, fetch, block_ids, after, background)
            if got is None:  # timed out or failed: the rest is a miss, slots come back late
                for rest in inflight:
                    rest.late.timed_out()
                inflight.clear()
                broken = True
                break
            out[fetch.pos:fetch.pos + len(got)] = got
        loaded = sum(out)
        self.stats.add("blocks_got", loaded)
        self.stats.add("bytes_got", loaded * layout.block_nbytes)
        self.stats.add("load_failed", n - loaded)
        return out

    def _start_fetch(self, paths: LayoutPaths, pos: int, keys: list[str]) -> _Fetch | None:
        if self._closed or not self.health.admit():
            return None
        pool = paths.load_pool
        runs = pool.take(len(keys))
        if not runs:
            return None
        slots = slots_of(runs)
        keys = keys[:len(slots)]
        late = LateRelease(lambda: pool.release(runs))
        try:
            future = self._transfers.submit(
                self._store.batch_get_into, keys, [pool.address(s) for s in slots],
                [paths.slot_nbytes] * len(keys), on_done=late.returned, wait=self._lookup_timeout)
        except CallRejected as exc:
            pool.release(runs)
            self.stats.add("rejected")
            self.health.failed(str(exc))
            return None
        return _Fetch(pos, keys, runs, future, late, time.perf_counter())

    def _finish_fetch(self, paths: LayoutPaths, fetch: _Fetch, block_ids: Sequence[int],
                      after: Any, background: bool) -> list[bool] | None:
        pool, size = paths.load_pool, paths.slot_nbytes
        try:
            codes = self._transfers.result(fetch.future,
                                           self._transfer_timeout(len(fetch.keys) * size))
        except CallTimedOut as exc:
            self.stats.add("timeouts")
            fetch.late.timed_out()  # the slots come back when Mooncake returns
            self.health.failed(str(exc))
            return None
        if isinstance(codes, BaseException):
            pool.release(fetch.runs)
            self.health.failed(f"batch_get_into raised {type(codes).__name__}")
            return None
        self.stats.observe("get", time.perf_counter() - fetch.started)
        ok: list[bool] = []
        for key, slot, code in zip(fetch.keys, slots_of(fetch.runs), codes):
            if code != size:
                ok.append(False)
                if code in (Code.OBJECT_NOT_FOUND, Code.LEASE_EXPIRED, 0):
                    self.stats.add("misses")
                elif code > 0 or code == Code.INVALID_PARAMS:
                    self.stats.add("corrupt")  # a value of another size
                else:
                    self.stats.add("errors")
                continue
            reason = paths.verify_slot(slot, key)
            if reason:
                self.failures.warn("corrupt", f"mooncake-vllm: ignoring stored block {key}: {reason}")
                self.stats.add("corrupt")
            ok.append(reason is None)
        self._note_failures("get", codes)
        self._name_lost_segment(fetch.keys, codes)
        blocks = list(block_ids[fetch.pos:fetch.pos + len(ok)])
        done = (paths.mover.scatter(pool, fetch.runs, ok, blocks, after=after, wait=background)
                if any(ok) else None)
        pool.release(fetch.runs, after=done)
        return ok

    def _name_lost_segment(self, keys: Sequence[str], codes: Sequence[Any]) -> None:
        """Values the master still lists but cannot deliver: say once which segment is gone."""
        lost = [k for k, c in zip(keys, codes)
                if c in (Code.TRANSFER_FAIL, Code.SEGMENT_NOT_FOUND)]
        if not lost:
            return
        self.stats.add("lost_segment_reads", len(lost))
        # the name costs a master round trip: ask once per log interval, not on every load
        if not hasattr(self._store, "get_replica_desc") or not self.failures.ready("segment query"):
            return
        try:
            replicas = self._control.run(1.0, self._store.get_replica_desc, lost[0])
            where = replicas[0].get_memory_descriptor().buffer_descriptor.transport_endpoint
        except Exception:  # noqa: BLE001 - naming the segment is best effort
            return
        self.failures.warn(f"segment {where}", f"mooncake-vllm: pool segment {where} does not "
                           f"answer ({len(lost)} block(s) of one load): the holder owning it died "
                           "or stalled; its values are lost and read as misses until the master "
                           "expires it (--client_ttl). Restart that holder; keep the pool in "
                           "several holders so one loss costs only its share")

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

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Close the client (its segment, if any, is unmounted by Mooncake)."""
        if self._closed:
            return
        self._closed = True
        self.health.close()
        self._lookups.close()
        self._transfers.close()
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
