"""Puts of a captured save, striped over the transport's lanes.

The blocks still to store are cut into one batch per lane (at least
:data:`LANE_BATCH_BYTES`, at most :data:`~mooncake_vllm.store.fetch.MAX_BATCH` keys each)
and put at once, a round at a time. A snapshot's batch is framed (checksums + headers into its slots) on
its lane's worker, so checksums of several batches run in parallel; a zero-copy
batch gets its headers from the checksums taken at capture, and after the put
the blocks are checked again: a block vLLM reused meanwhile has its value
removed (``save_raced``). A round with a batch past its deadline abandons the
save: the snapshot's slots come back once every put of that round returned.
With a disk tier, keys refused for a full pool are put again on the lane's worker
after each of ``transport.full_waits`` (inside the batch's call, so its slots stay
held and its deadline applies).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mooncake_vllm.errors import CallRejected, CallTimedOut
from mooncake_vllm.store.codes import Code, call
from mooncake_vllm.store.fetch import MAX_BATCH
from mooncake_vllm.store.slots import Run, slots_of
from mooncake_vllm.store.timebox import LateRelease

if TYPE_CHECKING:
    from mooncake_vllm.store.paths import LayoutPaths, SaveTicket
    from mooncake_vllm.store.transport import Lane, Transport

__all__ = ["LANE_BATCH_BYTES", "SLOW_PUT", "put_ticket"]

#: the least one lane's batch carries: a save smaller than this goes to one lane in one call.
#: A request's few new blocks fanned over every lane cost vLLM's process a thread hand-off
#: (a GIL switch beside its forward pass) per lane for bandwidth it does not need; a large
#: save still stripes over all of them
LANE_BATCH_BYTES = 16 << 20

#: a put still unanswered this many seconds into its round is logged while it runs (its
#: store client, its size): the line that tells a hung holder or connection from a slow
#: engine before the deadline abandons it
SLOW_PUT = 1.0


@dataclass
class _Put:
    """One batch put in flight on a lane (``keep``: positions in the ticket)."""

    keep: list[int]
    future: Any
    lane: Lane
    header_runs: list[Run]
    late: LateRelease | None


def put_ticket(transport: Transport, paths: LayoutPaths, ticket: SaveTicket,
               todo: list[int]) -> int:
    """Put the ticket's positions ``todo``; how many blocks were stored.

    Sets ``ticket.abandoned`` when a put outlived its deadline (its late return
    hands the slots back)."""
    lanes = transport.lanes
    least = max(1, LANE_BATCH_BYTES // paths.slot_nbytes)
    per = min(MAX_BATCH, max(least, -(-len(todo) // len(lanes))))
    batches = [todo[i:i + per] for i in range(0, len(todo), per)]
    stored = 0
    for first in range(0, len(batches), len(lanes)):
        if not transport.admits():  # the lookup (or a round) just found the pool away
            transport.stats.add("saves_skipped", sum(map(len, batches[first:])))
            return stored
        round_ = batches[first:first + len(lanes)]
        good = _put_round(transport, paths, ticket, list(zip(lanes, round_)))
        if good is None:
            return stored
        stored += good
    return stored


def _put_round(transport: Transport, paths: LayoutPaths, ticket: SaveTicket,
               work: list[tuple[Lane, list[int]]]) -> int | None:
    start = time.perf_counter()
    # a snapshot's slots are read by every put of the round: back once all have returned
    late = LateRelease(lambda: paths.release(ticket), calls=len(work)) if ticket.snapshot else None
    puts: list[_Put] = []
    for lane, keep in work:
        put = _submit(transport, paths, ticket, lane, keep, late)
        if put is not None:
            puts.append(put)
        elif late is not None:
            late.returned(None)  # this batch never started: nothing of it reads the slots
    stored = 0
    for i, put in enumerate(puts):
        nbytes = len(put.keep) * paths.slot_nbytes
        _note_if_slow(transport, put, nbytes, start)
        try:
            codes = put.lane.saves.result(put.future, transport.transfer_timeout(nbytes))
        except CallTimedOut as exc:
            ticket.abandoned = True
            abandoned = sum(len(p.keep) for p in puts[i:])
            transport.stats.add("saves_abandoned", abandoned)
            away = _pool_away(transport)
            transport.failures.warn("put_timeout", (
                f"mooncake-vllm: a put of {len(put.keep)} blocks ({nbytes / 1e6:.1f} MB) on store "
                f"client {put.lane.index} gave no answer within "
                f"{time.perf_counter() - start:.1f} s; {abandoned} block save(s) abandoned, "
                + ("the master does not answer either: the pool is treated as away"
                   if away else f"saves held back {transport.holders.cooldown:.0f} s (one "
                   "holder or connection hangs, the master answers)")
                + " (counted in dropped_blocks)"), abandoned)
            transport.timed_out(exc, late, breaker=away)
            for rest in puts[i:]:
                if rest.late is not None:
                    rest.late.timed_out()
            return None
        if put.header_runs:
            paths.header_pool.release(put.header_runs)
        if isinstance(codes, BaseException):
            transport.health.failed(f"batch put raised {type(codes).__name__}")
            continue
        transport.stats.observe("put", time.perf_counter() - start)
        good = [p for p, c in zip(put.keep, codes) if c in (Code.OK, Code.OBJECT_ALREADY_EXISTS)]
        transport.note_failures("put", codes)
        if not ticket.snapshot:
            good = _recheck(transport, paths, ticket, good)
        transport.stats.add("blocks_put", len(good))
        transport.stats.add("bytes_put", len(good) * paths.layout.block_nbytes)
        stored += len(good)
    return stored


def _note_if_slow(transport: Transport, put: _Put, nbytes: int, start: float) -> None:
    """Wait until :data:`SLOW_PUT` into the round; a put still running then is counted
    (``puts_slow``) and logged, rate-limited, while it runs."""
    left = SLOW_PUT - (time.perf_counter() - start)
    if put.future.done() or transport.transfer_timeout(nbytes) <= SLOW_PUT:
        return
    if left > 0:
        wait_for([put.future], timeout=left)
    if put.future.done():
        return
    transport.stats.add("puts_slow")
    transport.failures.warn("slow_put", (
        f"mooncake-vllm: a put of {len(put.keep)} blocks ({nbytes / 1e6:.1f} MB) on store client "
        f"{put.lane.index} has not returned after {time.perf_counter() - start:.1f} s (its "
        f"deadline: {transport.transfer_timeout(nbytes):.1f} s); a holder or the connection to "
        "it is slow or hung (store counter puts_slow)"))


def _pool_away(transport: Transport) -> bool:
    """A put hung: is the pool away (the master does not answer either: open the breaker)?
    Else one holder hangs, not the pool: saves are held back a while (the master may place
    the next put on it too) and the breaker stays closed."""
    if not transport.holders.master_answers():
        return True
    transport.stats.add("saves_held_back")
    transport.full_until = time.monotonic() + transport.holders.cooldown
    return False


def _framed_put(transport: Transport, store: Any, paths: LayoutPaths, ticket: SaveTicket,
                keep: list[int]) -> Any:
    """On the lane's worker: checksum and frame the snapshot slots, then put them."""
    ptrs, sizes = paths.frame_snapshot(ticket, keep)
    return _put_until_room(transport, store.batch_put_from, [ticket.keys[i] for i in keep], ptrs, sizes)


def _put_until_room(transport: Transport, put: Callable[..., Any], keys: list[str],
                    ptrs: Sequence[Any], sizes: Sequence[Any]) -> Any:
    """``put(keys, ptrs, sizes)``, then again for the keys refused with NO_AVAILABLE_HANDLE while
    the pool has a disk tier and retries make progress (``transport.full_waits``); the codes of
    the last attempts."""
    codes = put(keys, ptrs, sizes)
    if transport.full_waits is None:
        return codes
    first, most, patience = transport.full_waits
    wait, stalled = first, 0.0
    while not isinstance(codes, BaseException) and not transport.closed:
        codes = list(codes)
        full = [i for i, c in enumerate(codes) if c == Code.NO_AVAILABLE_HANDLE]
        if not full or stalled >= patience:
            break
        transport.stats.add("put_retries_full", len(full))
        time.sleep(wait)
        again = call(put, [keys[i] for i in full], [ptrs[i] for i in full], [sizes[i] for i in full])
        if isinstance(again, BaseException):
            break
        for i, code in zip(full, again):
            codes[i] = code
        progress = any(c != Code.NO_AVAILABLE_HANDLE for c in again)
        stalled = 0.0 if progress else stalled + wait
        wait = first if progress else min(most, wait * 2)
    return codes


def _submit(transport: Transport, paths: LayoutPaths, ticket: SaveTicket, lane: Lane,
            keep: list[int], late: LateRelease | None) -> _Put | None:
    keys = [ticket.keys[i] for i in keep]
    wait = transport.transfer_timeout(len(keep) * paths.slot_nbytes)
    header_runs: list[Run] = []
    own_late: LateRelease | None = None
    try:
        if ticket.snapshot:
            fut = lane.saves.submit(_framed_put, transport, lane.store, paths, ticket, keep,
                                    on_done=late.returned if late else None, wait=wait)
        else:
            header_runs = paths.header_pool.take(len(keep))
            if len(slots_of(header_runs)) < len(keep):
                paths.header_pool.release(header_runs)
                transport.stats.add("saves_dropped_no_slot", len(keep))
                return None
            ptrs, msizes = paths.frame_zero_copy(ticket, keep, header_runs)
            runs = header_runs
            own_late = LateRelease(lambda: paths.header_pool.release(runs))
            fut = lane.saves.submit(_put_until_room, transport, lane.store.batch_put_from_multi_buffers,
                                    keys, ptrs, msizes,
                                    on_done=own_late.returned, wait=wait)
    except CallRejected as exc:
        if header_runs:
            paths.header_pool.release(header_runs)
        transport.rejected(exc, breaker=_pool_away(transport))  # its worker hangs on a put
        return None
    return _Put(keep, fut, lane, header_runs, own_late)


def _recheck(transport: Transport, paths: LayoutPaths, ticket: SaveTicket,
             good: list[int]) -> list[int]:
    """Zero-copy: remove values whose block changed while it was being put."""
    raced = [i for i, ok in zip(good, paths.intact(ticket, good)) if not ok] if good else []
    for i in raced:
        transport.run(transport.control, transport.op_timeout, transport.remove, ticket.keys[i])
    if raced:
        transport.stats.add("save_raced", len(raced))
        transport.failures.warn("raced", f"mooncake-vllm: {len(raced)} block(s) changed while "
                                "being saved (vLLM reused them); their values were removed")
    return [i for i in good if i not in set(raced)]
