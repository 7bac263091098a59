"""Zero-copy loads: Mooncake writes straight into the KV blocks, which are then verified.

One multi-buffer get per block: the 64-byte header into a registered host slot,
the block's bytes into its segments of the (registered) KV cache — the same
bytes, in the same order, as a value put from slots or from the blocks. Then
each block's checksum is computed where the KV lives:

* **host KV** — on the host, one read pass over the landed bytes (the header's
  kind: xxh3 for values framed from host memory, wsum64 from CUDA memory). It
  saves a staged load's scatter pass and its cold staging pages: on the 2-core
  dev box 4k / 8k-token pool hits of the CPU bench model came 13 % / 33 % sooner
  (docs/bench-results/bench_serving-2026-12-05-host-direct.json); the check
  itself reads memory at ~8 GB/s (xxh3), ~25 % of a loopback get's time there;
* **CUDA KV** — on the GPU (wsum64, after the transfer engine's copies); only
  the 8-byte results come to the host. An xxh3 value is a counted miss there.

A block whose header or checksum is wrong is a failed block: vLLM recomputes it,
overwriting whatever was written. Gets are striped over the transport's lanes
(:data:`DEPTH` in flight per lane); the calling thread verifies each one while the
next one runs.

Only for *background* loads (the request stays parked until reported), because
a get abandoned at its deadline may still write into the blocks: the loader
then waits for Mooncake to return (up to :data:`LATE_WAIT` more seconds) before
reporting, and if it never does, zero-copy loads are switched off for good.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mooncake_vllm import codec
from mooncake_vllm.errors import CallRejected, CallTimedOut
from mooncake_vllm.store.fetch import LOAD_PIECES, MAX_BATCH, judge_gets
from mooncake_vllm.store.misses import missed
from mooncake_vllm.store.slots import Run, slots_of
from mooncake_vllm.store.timebox import LateRelease

if TYPE_CHECKING:
    from mooncake_vllm.store.paths import LayoutPaths
    from mooncake_vllm.store.transport import Lane, Transport

__all__ = ["DEPTH", "LATE_WAIT", "MIN_BATCH_BYTES", "batch_size", "get_direct"]

log = logging.getLogger(__name__)

#: after a deadline, how long a zero-copy load waits for Mooncake to stop writing
LATE_WAIT = 60.0
#: gets in flight per lane: two concurrent gets moved less than one on a 2-core box
#: (3 MiB blocks over loopback TCP: 31 blocks in 92 ms vs 77 ms, verification included)
DEPTH = 1
#: the fewest bytes one get asks for (a smaller get costs more per byte)
MIN_BATCH_BYTES = 8 << 20


@dataclass
class _Batch:
    """One multi-buffer get on a lane: ``keys`` from ``pos`` into ``blocks``."""

    pos: int
    keys: list[str]
    blocks: list[int]
    runs: list[Run]
    future: Any
    late: LateRelease
    started: float
    lane: Lane
    codes: list[Any] = field(default_factory=list)  #: once the get returned


def batch_size(count: int, lanes: int, slot_nbytes: int) -> int:
    """Blocks per get: about :data:`~mooncake_vllm.store.fetch.LOAD_PIECES` per lane (as a
    staged load's fetches: verifying one overlaps the next one's transfer), at least
    :data:`MIN_BATCH_BYTES`, at most :data:`MAX_BATCH` keys."""
    least = -(-MIN_BATCH_BYTES // slot_nbytes)
    return max(1, min(MAX_BATCH, max(least, -(-count // (LOAD_PIECES * lanes)))))


def get_direct(transport: Transport, paths: LayoutPaths, keys: Sequence[str],
               block_ids: Sequence[int], after: Any) -> list[bool]:
    """Load ``keys`` straight into ``block_ids``; ``True`` where verified in place."""
    out = [False] * len(keys)
    if after is not None:
        after.synchronize()  # vLLM's earlier kernels are done with these blocks
    lanes = transport.lanes
    n = transport.holders.usable(keys)  # up to the first block of a suspended holder
    missed(transport, "holder_suspended", len(keys) - n)
    step = batch_size(n, len(lanes), paths.slot_nbytes)
    inflight: deque[_Batch] = deque()
    landed: _Batch | None = None  # its get returned: verified while the next one runs
    pos, started, done, cause = 0, 0, 0, ""  # done: keys delivered or counted
    while True:
        while not cause and pos < n and len(inflight) < DEPTH * len(lanes):
            batch = _submit(transport, lanes[started % len(lanes)], paths, pos,
                            list(keys[pos:pos + step]), list(block_ids[pos:pos + step]))
            if isinstance(batch, str):
                cause = batch
                break
            inflight.append(batch)
            pos += len(batch.keys)
            started += 1
        if landed is not None:
            out[landed.pos:landed.pos + len(landed.keys)] = _verify(transport, paths, landed)
            done, landed = landed.pos + len(landed.keys), None
        if not inflight:
            break
        batch = inflight.popleft()
        got = _finish(transport, paths, batch)
        if got == "load_timeout":  # wait until no get still in flight writes
            for rest in inflight:
                rest.late.timed_out()
                _wait_late(paths, rest.future)
            cause, done = got, batch.pos
            break
        if isinstance(got, str):  # raised: the others in flight are collected as usual
            missed(transport, got, len(batch.keys))
            cause, done = cause or got, batch.pos + len(batch.keys)
            continue
        batch.codes, landed = got, batch
    missed(transport, cause or "no_slot", n - done)
    return out


def _submit(transport: Transport, lane: Lane, paths: LayoutPaths, pos: int, keys: list[str],
            blocks: list[int]) -> _Batch | str:
    """Start one get (else the miss cause: breaker open, no header slot, refused)."""
    if not transport.admits():
        return "breaker_open"
    headers, layout = paths.header_pool, paths.layout
    runs = headers.take(len(keys))
    slots = slots_of(runs)
    if len(slots) < len(keys):
        headers.release(runs)
        transport.stats.add("load_no_slot", len(keys))
        return "no_slot"
    ptrs, sizes = [], []
    for slot, block in zip(slots, blocks):
        segs = layout.segments(block)
        ptrs.append([headers.address(slot)] + [p for p, _ in segs])
        sizes.append([codec.HEADER_SIZE] + [nbytes for _, nbytes in segs])
    late = LateRelease(lambda: headers.release(runs))
    try:
        fut = lane.transfers.submit(lane.store.batch_get_into_multi_buffers, keys, ptrs, sizes,
                                    on_done=late.returned, wait=transport.lookup_timeout)
    except CallRejected as exc:
        headers.release(runs)
        transport.rejected(exc, breaker=not transport.holders.master_answers())
        return "load_rejected"
    return _Batch(pos, keys, blocks, runs, fut, late, time.perf_counter(), lane)


def _finish(transport: Transport, paths: LayoutPaths, batch: _Batch) -> list[Any] | str:
    """The codes of one get (else the miss cause: it timed out, having waited for it to
    end, or it raised)."""
    timeout = transport.transfer_timeout(len(batch.keys) * paths.slot_nbytes)
    try:
        codes = batch.lane.transfers.result(batch.future, timeout)
    except CallTimedOut as exc:
        transport.timed_out(exc, batch.late, breaker=not transport.holders.stalled(batch.keys))
        _wait_late(paths, batch.future)
        return "load_timeout"
    if isinstance(codes, BaseException):
        paths.header_pool.release(batch.runs)
        transport.health.failed(f"batch_get_into_multi_buffers raised {type(codes).__name__}")
        return "load_error"
    transport.stats.observe("get", time.perf_counter() - batch.started)
    return list(codes)


def _verify(transport: Transport, paths: LayoutPaths, batch: _Batch) -> list[bool]:
    """Check each landed value's header, then its checksum computed in place; count."""
    headers, layout = paths.header_pool, paths.layout
    slots = slots_of(batch.runs)
    reasons: list[str | None] = [None] * len(batch.keys)
    checked: list[tuple[int, codec.Header]] = []
    for i, (key, code) in enumerate(zip(batch.keys, batch.codes)):
        if code != paths.slot_nbytes:
            continue
        header, reason = codec.check_header(headers.view(slots[i])[:codec.HEADER_SIZE],
                                            layout.block_nbytes,
                                            layout_digest=paths.layout_digest,
                                            key_digest=codec.digest16(key))
        if header is not None and reason is None and header.checksum_kind not in paths.in_place_kinds:
            reason = f"{codec.CHECKSUM_KINDS[header.checksum_kind]} checksum (not verifiable on the GPU)"
            transport.stats.add("unverifiable_on_gpu")
        if reason or header is None:
            reasons[i] = reason
            continue
        checked.append((i, header))
    headers.release(batch.runs)
    if checked:
        sums = paths.block_sums([batch.blocks[i] for i, _ in checked],
                                [h.checksum_kind for _, h in checked])
        for (i, header), got in zip(checked, sums):
            if got != header.checksum:
                reasons[i] = "checksum mismatch (corrupt value)"
    return judge_gets(transport, batch.keys, batch.codes, reasons, paths.slot_nbytes)


def _wait_late(paths: LayoutPaths, fut: Any) -> None:
    """A get past its deadline may still write into the KV blocks: wait for it to end."""
    try:
        fut.result(timeout=LATE_WAIT)
        return
    except Exception:  # noqa: BLE001 - still running (or failed): treat alike
        if fut.done():
            return
    paths.direct_loads = False
    log.error("mooncake-vllm: a zero-copy load has not returned %.0f s after its deadline; "
              "it may still write into KV blocks. Zero-copy loads are off for this process "
              "(loads go through staging slots). Fix: check the pool's holders%s",
              LATE_WAIT, ", or set gpu_path=staged" if paths.layout.on_cuda else "")
