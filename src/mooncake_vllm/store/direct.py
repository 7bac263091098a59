"""Zero-copy loads of CUDA KV: Mooncake writes straight into the KV blocks, the GPU verifies.

One multi-buffer get per block: the 64-byte header into a registered host slot,
the block's bytes into its GPU segments (the same bytes, in the same order, as
a value put from slots or from GPU memory). Then, on our stream and after the
transfer engine's copies, the GPU computes each block's wsum64 checksum; only
the 8-byte results come to the host. A block whose header or checksum is wrong
is a failed block: vLLM recomputes it, overwriting whatever was written.

Batches are striped over the transport's lanes (one batch in flight per lane).
Only for *background* loads (the request stays parked until reported), because
a get abandoned at its deadline may still write into the blocks: the loader
then waits for Mooncake to return (up to :data:`LATE_WAIT` more seconds) before
reporting, and if it never does, zero-copy loads are switched off for good.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mooncake_vllm import codec
from mooncake_vllm.errors import CallRejected, CallTimedOut
from mooncake_vllm.store.fetch import MAX_BATCH, count_failed_get
from mooncake_vllm.store.slots import Run, slots_of
from mooncake_vllm.store.timebox import LateRelease

if TYPE_CHECKING:
    from mooncake_vllm.store.paths import LayoutPaths
    from mooncake_vllm.store.transport import Lane, Transport

__all__ = ["LATE_WAIT", "get_direct"]

log = logging.getLogger(__name__)

#: after a deadline, how long a zero-copy load waits for Mooncake to stop writing
LATE_WAIT = 60.0


@dataclass
class _Batch:
    """One multi-buffer get in flight on a lane."""

    keys: list[str]
    blocks: list[int]
    runs: list[Run]
    future: Any
    late: LateRelease
    started: float
    lane: Lane


def get_direct(transport: Transport, paths: LayoutPaths, keys: Sequence[str],
               block_ids: Sequence[int], after: Any) -> list[bool]:
    """Load ``keys`` straight into ``block_ids``; ``True`` where verified on the GPU."""
    out = [False] * len(keys)
    if after is not None:
        after.synchronize()  # vLLM's earlier kernels are done with these blocks
    lanes = transport.lanes
    size = max(1, min(MAX_BATCH, -(-len(keys) // len(lanes))))
    offsets = list(range(0, len(keys), size))
    for first in range(0, len(offsets), len(lanes)):
        batches = []
        for lane, off in zip(lanes, offsets[first:first + len(lanes)]):
            batch = _submit(transport, lane, paths, list(keys[off:off + size]),
                            list(block_ids[off:off + size]))
            if batch is None:
                break
            batches.append((off, batch))
        for i, (off, batch) in enumerate(batches):
            got = _finish(transport, paths, batch)
            if got is None:  # a deadline passed: wait until no batch of this round writes
                for _, rest in batches[i + 1:]:
                    rest.late.timed_out()
                    _wait_late(paths, rest.future)
                return out
            out[off:off + len(got)] = got
        if len(batches) < len(offsets[first:first + len(lanes)]):
            break
    return out


def _submit(transport: Transport, lane: Lane, paths: LayoutPaths, keys: list[str],
            blocks: list[int]) -> _Batch | None:
    if not transport.admits():
        return None
    headers = paths.header_pool
    runs = headers.take(len(keys))
    slots = slots_of(runs)
    if len(slots) < len(keys):
        headers.release(runs)
        transport.stats.add("load_no_slot", len(keys))
        return None
    layout = paths.layout
    ptrs, sizes = [], []
    for slot, block in zip(slots, blocks):
        segs = layout.segments(block)
        ptrs.append([headers.address(slot)] + [p for p, _ in segs])
        sizes.append([codec.HEADER_SIZE] + [n for _, n in segs])
    late = LateRelease(lambda: headers.release(runs))
    try:
        fut = lane.transfers.submit(lane.store.batch_get_into_multi_buffers, keys, ptrs, sizes,
                                    on_done=late.returned, wait=transport.lookup_timeout)
    except CallRejected as exc:
        headers.release(runs)
        transport.rejected(exc)
        return None
    return _Batch(keys, blocks, runs, fut, late, time.perf_counter(), lane)


def _finish(transport: Transport, paths: LayoutPaths, batch: _Batch) -> list[bool] | None:
    headers, keys = paths.header_pool, batch.keys
    timeout = transport.transfer_timeout(len(keys) * paths.slot_nbytes)
    try:
        codes = batch.lane.transfers.result(batch.future, timeout)
    except CallTimedOut as exc:
        transport.timed_out(exc, batch.late)
        _wait_late(paths, batch.future)
        return None
    headers.release(batch.runs)
    if isinstance(codes, BaseException):
        transport.health.failed(f"batch_get_into_multi_buffers raised {type(codes).__name__}")
        return None
    transport.stats.observe("get", time.perf_counter() - batch.started)
    layout, slots = paths.layout, slots_of(batch.runs)
    candidates: list[int] = []
    expected: list[int] = []
    ok = [False] * len(keys)
    for i, (key, code) in enumerate(zip(keys, codes)):
        if code != paths.slot_nbytes:
            count_failed_get(transport, code)
            continue
        header, reason = codec.check_header(headers.view(slots[i])[:codec.HEADER_SIZE],
                                            layout.block_nbytes,
                                            layout_digest=paths.layout_digest,
                                            key_digest=codec.digest16(key))
        if header is not None and reason is None and header.checksum_kind != codec.WSUM64:
            reason = f"{codec.CHECKSUM_KINDS[header.checksum_kind]} checksum (not verifiable on the GPU)"
            transport.stats.add("unverifiable_on_gpu")
        if reason:
            transport.failures.warn("corrupt", f"mooncake-vllm: ignoring stored block {key}: "
                                    f"{reason}")
            transport.stats.add("corrupt")
            continue
        assert header is not None
        candidates.append(i)
        expected.append(header.checksum)
    transport.note_failures("get", codes)
    if candidates:
        sums = paths.device_sums([batch.blocks[i] for i in candidates], writers_done=True)
        for i, want, got in zip(candidates, expected, sums):
            if got == want:
                ok[i] = True
            else:
                transport.stats.add("corrupt")
                transport.failures.warn("corrupt", f"mooncake-vllm: stored block {keys[i]} "
                                        "failed its GPU checksum; vLLM recomputes it")
    return ok


def _wait_late(paths: LayoutPaths, fut: Any) -> None:
    """A get past its deadline may still write into the KV blocks: wait for it to end."""
    try:
        fut.result(timeout=LATE_WAIT)
        return
    except Exception:  # noqa: BLE001 - still running (or failed): treat alike
        if fut.done():
            return
    paths.gpu_zero_copy_loads = False
    log.error("mooncake-vllm: a zero-copy load has not returned %.0f s after its deadline; "
              "it may still write into KV blocks. Zero-copy loads are off for this process "
              "(loads go through staging slots). Fix: check the pool's holders, or set "
              "gpu_path=staged", LATE_WAIT)
