"""Zero-copy loads of CUDA KV: Mooncake writes straight into the KV blocks, the GPU verifies.

One multi-buffer get per block: the 64-byte header into a registered host slot,
the block's bytes into its GPU segments (the same bytes, in the same order, as
a value put from slots or from GPU memory). Then, on our stream and after the
transfer engine's copies, the GPU computes each block's wsum64 checksum; only
the 8-byte results come to the host. A block whose header or checksum is wrong
is a failed block: vLLM recomputes it, overwriting whatever was written.

Only for *background* loads (the request stays parked until reported), because
a get abandoned at its deadline may still write into the blocks: the loader
then waits for Mooncake to return (up to :data:`LATE_WAIT` more seconds) before
reporting, and if it never does, zero-copy loads are switched off for good.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mooncake_vllm import codec
from mooncake_vllm.store.fetch import MAX_BATCH, count_failed_get
from mooncake_vllm.store.slots import slots_of
from mooncake_vllm.store.timebox import CallRejected, CallTimedOut, LateRelease

if TYPE_CHECKING:
    from mooncake_vllm.store.client import StoreClient
    from mooncake_vllm.store.paths import LayoutPaths

__all__ = ["LATE_WAIT", "get_direct"]

log = logging.getLogger(__name__)

#: after a deadline, how long a zero-copy load waits for Mooncake to stop writing
LATE_WAIT = 60.0


def get_direct(client: StoreClient, paths: LayoutPaths, keys: Sequence[str],
               block_ids: Sequence[int], after: Any) -> list[bool]:
    """Load ``keys`` straight into ``block_ids``; ``True`` where verified on the GPU."""
    out = [False] * len(keys)
    if after is not None:
        after.synchronize()  # vLLM's earlier kernels are done with these blocks
    for off in range(0, len(keys), MAX_BATCH):
        got = _get_batch(client, paths, list(keys[off:off + MAX_BATCH]),
                         list(block_ids[off:off + MAX_BATCH]))
        if got is None:
            break
        out[off:off + len(got)] = got
    return out


def _get_batch(client: StoreClient, paths: LayoutPaths, keys: list[str],
               blocks: list[int]) -> list[bool] | None:
    if not client.healthy:
        return None
    headers = paths.header_pool
    runs = headers.take(len(keys))
    slots = slots_of(runs)
    if len(slots) < len(keys):
        headers.release(runs)
        client.stats.add("load_no_slot", len(keys))
        return None
    layout = paths.layout
    ptrs, sizes = [], []
    for slot, block in zip(slots, blocks):
        segs = layout.segments(block)
        ptrs.append([headers.address(slot)] + [p for p, _ in segs])
        sizes.append([codec.HEADER_SIZE] + [n for _, n in segs])
    late = LateRelease(lambda: headers.release(runs))
    start = time.perf_counter()
    try:
        fut = client._transfers.submit(client._store.batch_get_into_multi_buffers, keys, ptrs,
                                       sizes, on_done=late.returned, wait=client._lookup_timeout)
    except CallRejected as exc:
        headers.release(runs)
        client.stats.add("rejected")
        client.health.failed(str(exc))
        return None
    timeout = client._transfer_timeout(len(keys) * paths.slot_nbytes)
    try:
        codes = client._transfers.result(fut, timeout)
    except CallTimedOut as exc:
        client.stats.add("timeouts")
        client.health.failed(str(exc))
        late.timed_out()
        _wait_late(paths, fut)
        return None
    headers.release(runs)
    if isinstance(codes, BaseException):
        client.health.failed(f"batch_get_into_multi_buffers raised {type(codes).__name__}")
        return None
    client.stats.observe("get", time.perf_counter() - start)
    candidates: list[int] = []
    expected: list[int] = []
    ok = [False] * len(keys)
    for i, (key, code) in enumerate(zip(keys, codes)):
        if code != paths.slot_nbytes:
            count_failed_get(client, code)
            continue
        header, reason = codec.check_header(headers.view(slots[i])[:codec.HEADER_SIZE],
                                            layout.block_nbytes,
                                            layout_digest=paths.layout_digest,
                                            key_digest=codec.digest16(key))
        if header is not None and reason is None and header.checksum_kind != codec.WSUM64:
            reason = f"{codec.CHECKSUM_KINDS[header.checksum_kind]} checksum (not verifiable on the GPU)"
            client.stats.add("unverifiable_on_gpu")
        if reason:
            client.failures.warn("corrupt", f"mooncake-vllm: ignoring stored block {key}: {reason}")
            client.stats.add("corrupt")
            continue
        assert header is not None
        candidates.append(i)
        expected.append(header.checksum)
    client._note_failures("get", codes)
    if candidates:
        sums = paths.device_sums([blocks[i] for i in candidates], writers_done=True)
        for i, want, got in zip(candidates, expected, sums):
            if got == want:
                ok[i] = True
            else:
                client.stats.add("corrupt")
                client.failures.warn("corrupt", f"mooncake-vllm: stored block {keys[i]} failed "
                                     "its GPU checksum; vLLM recomputes it")
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
