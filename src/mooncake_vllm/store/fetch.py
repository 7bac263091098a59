"""Staged loads: gets into registered slots, striped over the lanes, verified, scattered.

A load is cut into fetches of at least :data:`MIN_FETCH` blocks, two in flight per
lane (:class:`~mooncake_vllm.store.transport.Lane`), so the transfers of several
Mooncake clients overlap. Each fetch gets its values AND verifies them (header and
checksum, on the host) on its lane's worker, so checksums run in parallel too; the
calling thread collects fetches in order and scatters only verified slots into the
KV cache. A fetch abandoned at its deadline keeps its slots until Mooncake returns.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mooncake_vllm.errors import CallRejected, CallTimedOut
from mooncake_vllm.store.codes import Code
from mooncake_vllm.store.misses import missed
from mooncake_vllm.store.slots import Run, slots_of
from mooncake_vllm.store.timebox import LateRelease

if TYPE_CHECKING:
    from mooncake_vllm.store.paths import LayoutPaths
    from mooncake_vllm.store.transport import Lane, Transport

__all__ = ["LOAD_PIECES", "MAX_BATCH", "MIN_FETCH", "Fetch", "count_failed_get", "get_staged",
           "get_verified", "judge_gets", "name_lost_segment"]

#: a load of one lane is cut into about this many fetches (two in flight)
LOAD_PIECES = 4
#: the fewest blocks one fetch asks for (a smaller get costs more per byte)
MIN_FETCH = 16
#: keys per Mooncake batch call (puts and gets)
MAX_BATCH = 256


@dataclass
class Fetch:
    """One ``batch_get_into`` (+ verification) in flight: ``keys`` from ``pos`` into ``runs``."""

    pos: int
    keys: list[str]
    runs: list[Run]
    future: Any
    late: LateRelease
    started: float
    lane: Lane


def count_failed_get(transport: Transport, code: Any) -> None:
    """Count one value a get did not deliver whole: a miss, a value of another size, an error."""
    if code in (Code.OBJECT_NOT_FOUND, Code.LEASE_EXPIRED, 0):
        transport.stats.add("misses")
    elif isinstance(code, int) and (code > 0 or code == Code.INVALID_PARAMS):
        transport.stats.add("corrupt")  # a value of another size
    else:
        transport.stats.add("errors")


def failed_get_cause(code: Any) -> str:
    """The miss cause of a value a get did not deliver whole ("" = simply absent)."""
    if code in (Code.OBJECT_NOT_FOUND, Code.LEASE_EXPIRED, 0):
        return ""
    if code in (Code.TRANSFER_FAIL, Code.SEGMENT_NOT_FOUND):
        return "lost_segment"
    if isinstance(code, int) and (code > 0 or code == Code.INVALID_PARAMS):
        return "corrupt"
    return "load_error"


def fetch_size(count: int, slots: int, lanes: int) -> int:
    """Blocks per fetch: about :data:`LOAD_PIECES` per lane, two in flight per lane."""
    depth = 2 * lanes
    return max(1, min(MAX_BATCH, slots // depth,
                      max(MIN_FETCH, -(-count // (LOAD_PIECES * lanes)))))


def get_staged(transport: Transport, paths: LayoutPaths, keys: Sequence[str],
               block_ids: Sequence[int], after: Any, background: bool) -> list[bool]:
    """Load ``keys`` into ``block_ids`` through the load slots; ``True`` where verified."""
    pool, lanes = paths.load_pool, transport.lanes
    out = [False] * len(keys)
    n = transport.holders.usable(keys)  # up to the first block of a suspended holder
    missed(transport, "holder_suspended", len(keys) - n)
    step = fetch_size(n, pool.count, len(lanes))
    inflight: deque[Fetch] = deque()
    pos, started, broken = 0, 0, False
    done = 0  # keys before this position were delivered or counted
    cause = ""  # why the rest is a miss, once broken
    while pos < n or inflight:
        while not broken and pos < n and len(inflight) < 2 * len(lanes):
            lane = lanes[started % len(lanes)]
            fetch = _start(transport, lane, paths, pos, list(keys[pos:pos + step]))
            if isinstance(fetch, str) and not inflight:
                pool.settle()  # slots waiting on finished device copies
                fetch = _start(transport, lane, paths, pos, list(keys[pos:pos + step]))
            if isinstance(fetch, str):
                broken, cause = not inflight, fetch
                break
            inflight.append(fetch)
            pos += len(fetch.keys)
            started += 1
        if not inflight:
            break
        fetch = inflight.popleft()
        got = _finish(transport, paths, fetch, block_ids, after, background)
        if isinstance(got, str):  # timed out or failed: the rest is a miss, slots come back late
            for rest in inflight:  # given up too: their workers are handed on while spares last
                rest.late.timed_out()
                rest.lane.transfers.abandon(rest.future)
            inflight.clear()
            broken, cause, done = True, got, fetch.pos
            break
        out[fetch.pos:fetch.pos + len(got)] = got
        done = fetch.pos + len(got)
    missed(transport, cause or "no_slot", n - done)
    return out


def get_verified(store: Any, paths: LayoutPaths, keys: list[str],
                  slots: list[int]) -> tuple[list[Any], list[str | None]]:
    """On the lane's worker: get into ``slots``, then why each delivered value is bad."""
    size = paths.slot_nbytes
    codes = list(store.batch_get_into(keys, [paths.load_pool.address(s) for s in slots],
                                      [size] * len(keys)))
    reasons = [paths.verify_slot(slot, key) if code == size else None
               for key, slot, code in zip(keys, slots, codes)]
    return codes, reasons


def _start(transport: Transport, lane: Lane, paths: LayoutPaths, pos: int,
           keys: list[str]) -> Fetch | str:
    """Start one fetch into free load slots (else the miss cause: no slot, refused)."""
    if not transport.admits():
        return "breaker_open"
    pool = paths.load_pool
    runs = pool.take(len(keys))
    if not runs:
        return "no_slot"
    slots = slots_of(runs)
    keys = keys[:len(slots)]
    late = LateRelease(lambda: pool.release(runs))
    try:
        future = lane.transfers.submit(get_verified, lane.store, paths, keys, slots,
                                       on_done=late.returned, wait=transport.lookup_timeout)
    except CallRejected as exc:
        pool.release(runs)
        # every worker hangs on a transfer: a holder, or the pool? (the master answers or not)
        transport.rejected(exc, breaker=not transport.holders.master_answers())
        return "load_rejected"
    return Fetch(pos, keys, runs, future, late, time.perf_counter(), lane)


def _finish(transport: Transport, paths: LayoutPaths, fetch: Fetch, block_ids: Sequence[int],
            after: Any, background: bool) -> list[bool] | str:
    """Collect one fetch and scatter its verified slots (else the miss cause: it failed)."""
    pool, size = paths.load_pool, paths.slot_nbytes
    try:
        got = fetch.lane.transfers.result(fetch.future,
                                          transport.transfer_timeout(len(fetch.keys) * size))
    except CallTimedOut as exc:
        # the slots come back when Mooncake returns; one hung holder does not shut the pool
        transport.timed_out(exc, fetch.late, breaker=not transport.holders.stalled(fetch.keys))
        return "load_timeout"
    if isinstance(got, BaseException):
        pool.release(fetch.runs)
        transport.health.failed(f"batch_get_into raised {type(got).__name__}")
        return "load_error"
    codes, reasons = got
    transport.stats.observe("get", time.perf_counter() - fetch.started)
    ok = judge_gets(transport, fetch.keys, codes, reasons, size)
    blocks = list(block_ids[fetch.pos:fetch.pos + len(ok)])
    done = (paths.mover.scatter(pool, fetch.runs, ok, blocks, after=after, wait=background)
            if any(ok) else None)
    pool.release(fetch.runs, after=done)
    return ok


def judge_gets(transport: Transport, keys: Sequence[str], codes: Sequence[Any],
               reasons: Sequence[str | None], size: int) -> list[bool]:
    """Count and log one batch's outcome: ``True`` where a whole value (``size`` bytes)
    came back and passed its checks (``reasons[i]`` is why value ``i`` did not)."""
    ok: list[bool] = []
    causes: list[str] = []
    for key, code, reason in zip(keys, codes, reasons):
        if code != size:
            count_failed_get(transport, code)
            ok.append(False)
            causes.append(failed_get_cause(code))
            continue
        if reason:
            transport.failures.warn("corrupt", f"mooncake-vllm: ignoring stored block {key}: "
                                    f"{reason}; vLLM recomputes it")
            transport.stats.add("corrupt")
            causes.append("corrupt")
        ok.append(reason is None)
    for cause in set(causes) - {""}:
        missed(transport, cause, causes.count(cause))
    transport.note_failures("get", codes)
    name_lost_segment(transport, keys, codes)
    return ok


def name_lost_segment(transport: Transport, keys: Sequence[str], codes: Sequence[Any]) -> None:
    """Values the master still lists but cannot deliver: say once which segment is gone."""
    lost = [k for k, c in zip(keys, codes)
            if c in (Code.TRANSFER_FAIL, Code.SEGMENT_NOT_FOUND)]
    if not lost:
        return
    transport.stats.add("lost_segment_reads", len(lost))
    store = transport.store
    # the name costs a master round trip: ask once per log interval, not on every load
    if not hasattr(store, "get_replica_desc") or not transport.failures.ready("segment query"):
        return
    try:
        replicas = transport.control.run(1.0, store.get_replica_desc, lost[0])
        where = replicas[0].get_memory_descriptor().buffer_descriptor.transport_endpoint
    except Exception:  # noqa: BLE001 - naming the segment is best effort
        return
    transport.failures.warn(f"segment {where}", f"mooncake-vllm: pool segment {where} does not "
                            f"answer ({len(lost)} block(s) of one load): the holder owning it "
                            "died or stalled; its values are lost and read as misses until the "
                            "master expires it (--client_ttl). Restart that holder; keep the "
                            "pool in several holders so one loss costs only its share")
