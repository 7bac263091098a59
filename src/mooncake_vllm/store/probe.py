"""A short load probe at start: what a load costs before any real load was measured.

The claim policy (:mod:`~mooncake_vllm.v1.claims`) decides nothing until it has
measured a few loads, so a fresh engine claimed its first pool hits blind — on an
H200 a fresh reader's first 2k-token hit took 1.35x its recompute, partly because
its first transfers opened the TCP connections to every holder. The probe puts a
few blocks' worth of throw-away values from the load slots (never vLLM's blocks),
reads them back once over every lane (the connections open here), then times
gets of several sizes striped over the lanes, each verified on the lane's worker
as a real load is. The values are removed afterwards. Loads are what it measures,
so its samples seed the load model the way real loads later refine it.
"""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mooncake_vllm.store.fetch import MIN_FETCH, get_verified
from mooncake_vllm.store.slots import slots_of
from mooncake_vllm.store.timebox import LateRelease

if TYPE_CHECKING:
    from mooncake_vllm.store.paths import LayoutPaths
    from mooncake_vllm.store.transport import Transport

__all__ = ["PROBE_BLOCKS", "PROBE_PREFIX", "probe_loads"]

log = logging.getLogger(__name__)

#: blocks each timed probe load reads (capped at half the load slots): three sizes, so
#: the load model's shape (fixed cost + per token) is fitted from the start
PROBE_BLOCKS = (MIN_FETCH, 2 * MIN_FETCH, 4 * MIN_FETCH)
#: keys of probe values (outside every namespace: no lookup ever matches them)
PROBE_PREFIX = "mcv-probe"


def probe_loads(transport: Transport, paths: LayoutPaths,
                sizes: Sequence[int] = PROBE_BLOCKS) -> list[tuple[int, float]]:
    """Timed loads ``(blocks, seconds)`` of each size in ``sizes`` (empty when the pool is
    away, refuses the values or the slots are busy); every probe value is removed."""
    pool = paths.load_pool
    want = min(max(sizes), pool.count // 2)
    if want < 1 or not transport.admits():
        return []
    runs = pool.take(want)
    slots = slots_of(runs)
    tag = f"{PROBE_PREFIX}/{os.getpid()}-{uuid.uuid4().hex[:8]}"
    keys = [f"{tag}/{i}" for i in range(len(slots))]
    size = paths.slot_nbytes
    lane0 = transport.lanes[0]
    calls: list[Any] = []  # every get: the slots come back once all have returned
    try:
        rc = transport.run(lane0.saves, transport.transfer_timeout(size * len(keys)),
                           lane0.store.batch_put_from, keys,
                           [pool.address(s) for s in slots], [size] * len(keys), breaker=False)
        if isinstance(rc, BaseException) or any(not isinstance(c, int) or c < 0 for c in rc):
            log.info("mooncake-vllm: the load probe could not store its values (%s); the "
                     "first loads are claimed unmeasured", rc)
            return []
        if _timed_get(transport, paths, keys, slots, calls) is None:  # opens every connection
            return []
        out = []
        for n in sizes:
            n = min(n, len(keys))
            seconds = _timed_get(transport, paths, keys[:n], slots[:n], calls)
            if seconds is None:
                break
            out.append((n, seconds))
        return out
    finally:
        if transport.remove_matching(f"^{re.escape(tag)}/") is None:  # one call where it can
            for key in keys:
                transport.run(transport.control, transport.op_timeout, transport.remove, key,
                              breaker=False)
        _release_after(calls, lambda: pool.release(runs))


def _release_after(calls: list[Any], release: Any) -> None:
    """``release()`` now, or once every call still writing into the slots has returned
    (a late get must never land in slots a real load has taken since)."""
    pending = [f for f in calls if not f.done()]
    if not pending:
        release()
        return
    late = LateRelease(release, calls=len(pending))
    for fut in pending:
        fut.add_done_callback(late.returned)
    late.timed_out()


def _timed_get(transport: Transport, paths: LayoutPaths, keys: list[str],
               slots: list[int], calls: list[Any]) -> float | None:
    """Seconds to get (and verify) ``keys`` into ``slots``, split evenly over the lanes;
    ``None`` if any part failed. Each call started is appended to ``calls``."""
    lanes = transport.lanes
    per = -(-len(keys) // len(lanes))
    deadline = transport.transfer_timeout(paths.slot_nbytes * per)
    started = time.perf_counter()
    try:
        mine = []
        for lane, i in zip(lanes, range(0, len(keys), per)):
            fut = lane.transfers.submit(get_verified, lane.store, paths, keys[i:i + per],
                                        slots[i:i + per], wait=transport.lookup_timeout)
            calls.append(fut)
            mine.append((lane, fut))
        for lane, fut in mine:
            result = lane.transfers.result(fut, deadline)
            codes = result[0] if isinstance(result, tuple) else None
            if codes is None or any(c != paths.slot_nbytes for c in codes):
                return None
    except Exception as exc:  # noqa: BLE001 - a probe never fails the engine
        log.info("mooncake-vllm: the load probe failed (%s); the first loads are claimed "
                 "unmeasured", exc)
        return None
    return time.perf_counter() - started
