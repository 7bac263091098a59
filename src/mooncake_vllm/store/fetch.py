"""Staged loads: pipelined ``batch_get_into`` through registered slots, verified on the host.

A load is cut into about :data:`LOAD_PIECES` fetches, two in flight: verifying one
overlaps the transfer of the next (the checksum holds the GIL, Mooncake's call does
not). Only verified slots are scattered into the KV cache; a fetch abandoned at its
deadline keeps its slots until Mooncake returns.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mooncake_vllm.store.codes import Code
from mooncake_vllm.store.slots import Run, slots_of
from mooncake_vllm.store.timebox import CallRejected, CallTimedOut, LateRelease

if TYPE_CHECKING:
    from mooncake_vllm.store.client import StoreClient
    from mooncake_vllm.store.paths import LayoutPaths

__all__ = ["MAX_BATCH", "Fetch", "count_failed_get", "finish_fetch", "get_staged", "name_lost_segment",
           "start_fetch"]

LOAD_PIECES = 4
_MIN_FETCH = 16
#: keys per Mooncake batch call (puts and gets)
MAX_BATCH = 256


@dataclass
class Fetch:
    """One ``batch_get_into`` in flight: ``keys`` from position ``pos`` into ``runs``."""

    pos: int
    keys: list[str]
    runs: list[Run]
    future: Any
    late: LateRelease
    started: float


def count_failed_get(client: StoreClient, code: Any) -> None:
    """Count one value a get did not deliver whole: a miss, a value of another size, an error."""
    if code in (Code.OBJECT_NOT_FOUND, Code.LEASE_EXPIRED, 0):
        client.stats.add("misses")
    elif isinstance(code, int) and (code > 0 or code == Code.INVALID_PARAMS):
        client.stats.add("corrupt")  # a value of another size
    else:
        client.stats.add("errors")


def get_staged(client: StoreClient, paths: LayoutPaths, keys: Sequence[str],
               block_ids: Sequence[int], after: Any, background: bool) -> list[bool]:
    """Load ``keys`` into ``block_ids`` through the load slots; ``True`` where verified."""
    pool, n = paths.load_pool, len(keys)
    step = max(1, min(MAX_BATCH, pool.count // 2, max(_MIN_FETCH, -(-n // LOAD_PIECES))))
    out = [False] * n
    inflight: deque[Fetch] = deque()
    pos, broken = 0, False
    while pos < n or inflight:
        while not broken and pos < n and len(inflight) < 2:
            fetch = start_fetch(client, paths, pos, list(keys[pos:pos + step]))
            if fetch is None and not inflight:
                pool.settle()  # slots waiting on finished device copies
                fetch = start_fetch(client, paths, pos, list(keys[pos:pos + step]))
            if fetch is None:
                broken = not inflight
                break
            inflight.append(fetch)
            pos += len(fetch.keys)
        if not inflight:
            break
        fetch = inflight.popleft()
        got = finish_fetch(client, paths, fetch, block_ids, after, background)
        if got is None:  # timed out or failed: the rest is a miss, slots come back late
            for rest in inflight:
                rest.late.timed_out()
            inflight.clear()
            broken = True
            break
        out[fetch.pos:fetch.pos + len(got)] = got
    return out


def start_fetch(client: StoreClient, paths: LayoutPaths, pos: int,
                keys: list[str]) -> Fetch | None:
    """Start one ``batch_get_into`` of ``keys`` into free load slots (``None``: none free / refused)."""
    if client._closed or not client.health.admit():
        return None
    pool = paths.load_pool
    runs = pool.take(len(keys))
    if not runs:
        return None
    slots = slots_of(runs)
    keys = keys[:len(slots)]
    late = LateRelease(lambda: pool.release(runs))
    try:
        future = client._transfers.submit(
            client._store.batch_get_into, keys, [pool.address(s) for s in slots],
            [paths.slot_nbytes] * len(keys), on_done=late.returned, wait=client._lookup_timeout)
    except CallRejected as exc:
        pool.release(runs)
        client.stats.add("rejected")
        client.health.failed(str(exc))
        return None
    return Fetch(pos, keys, runs, future, late, time.perf_counter())

def finish_fetch(client: StoreClient, paths: LayoutPaths, fetch: Fetch,
                 block_ids: Sequence[int],
             after: Any, background: bool) -> list[bool] | None:
    """Collect one fetch, verify each slot on the host, scatter the good ones (``None``: failed)."""
    pool, size = paths.load_pool, paths.slot_nbytes
    try:
        codes = client._transfers.result(fetch.future,
                                       client._transfer_timeout(len(fetch.keys) * size))
    except CallTimedOut as exc:
        client.stats.add("timeouts")
        fetch.late.timed_out()  # the slots come back when Mooncake returns
        client.health.failed(str(exc))
        return None
    if isinstance(codes, BaseException):
        pool.release(fetch.runs)
        client.health.failed(f"batch_get_into raised {type(codes).__name__}")
        return None
    client.stats.observe("get", time.perf_counter() - fetch.started)
    ok: list[bool] = []
    for key, slot, code in zip(fetch.keys, slots_of(fetch.runs), codes):
        if code != size:
            ok.append(False)
            if code in (Code.OBJECT_NOT_FOUND, Code.LEASE_EXPIRED, 0):
                client.stats.add("misses")
            elif code > 0 or code == Code.INVALID_PARAMS:
                client.stats.add("corrupt")  # a value of another size
            else:
                client.stats.add("errors")
            continue
        reason = paths.verify_slot(slot, key)
        if reason:
            client.failures.warn("corrupt", f"mooncake-vllm: ignoring stored block {key}: {reason}")
            client.stats.add("corrupt")
        ok.append(reason is None)
    client._note_failures("get", codes)
    name_lost_segment(client, fetch.keys, codes)
    blocks = list(block_ids[fetch.pos:fetch.pos + len(ok)])
    done = (paths.mover.scatter(pool, fetch.runs, ok, blocks, after=after, wait=background)
            if any(ok) else None)
    pool.release(fetch.runs, after=done)
    return ok

def name_lost_segment(client: StoreClient, keys: Sequence[str], codes: Sequence[Any]) -> None:
    """Values the master still lists but cannot deliver: say once which segment is gone."""
    lost = [k for k, c in zip(keys, codes)
            if c in (Code.TRANSFER_FAIL, Code.SEGMENT_NOT_FOUND)]
    if not lost:
        return
    client.stats.add("lost_segment_reads", len(lost))
    # the name costs a master round trip: ask once per log interval, not on every load
    if not hasattr(client._store, "get_replica_desc") or not client.failures.ready("segment query"):
        return
    try:
        replicas = client._control.run(1.0, client._store.get_replica_desc, lost[0])
        where = replicas[0].get_memory_descriptor().buffer_descriptor.transport_endpoint
    except Exception:  # noqa: BLE001 - naming the segment is best effort
        return
    client.failures.warn(f"segment {where}", f"mooncake-vllm: pool segment {where} does not "
                       f"answer ({len(lost)} block(s) of one load): the holder owning it died "
                       "or stalled; its values are lost and read as misses until the master "
                       "expires it (--client_ttl). Restart that holder; keep the pool in "
                       "several holders so one loss costs only its share")
