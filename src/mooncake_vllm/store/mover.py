"""Copy whole blocks between the KV cache and staging slots, in host or CUDA memory.

Everything here is torch ops on the byte views of :meth:`BlockLayout.byte_views`,
so the same code moves host tensors (numpy arrays included) and CUDA tensors;
device memory is never read from the host.

On CUDA, ordering with vLLM follows its current stream (the one the forward pass
runs on) without ever synchronising the device:

* **save**: the gather runs on our save stream after an event recorded on vLLM's
  stream (so it reads the KV the forward wrote), into a device staging buffer,
  then device→host into pinned slots. A :class:`CopyFence` says when vLLM's
  blocks have been read: ordered at once (vLLM's stream waits for the gather,
  the blocks are free for reuse as soon as the snapshot is queued), or — for a
  caller that keeps the blocks until it frees them (the V1 worker) — ordered
  only then, so the forward pass never waits for a save's copy.
* **load**: host→device and the scatter run on our load stream after an event on
  vLLM's stream (earlier kernels may still use those blocks); vLLM's stream then
  waits for the scatter, so no layer reads a block before it is loaded.
* **host waits sleep**: the events a thread of ours waits on (a save's bytes in the
  slots, a background load's scatter, GPU checksums) are blocking-sync events, so the
  waiting thread sleeps in the driver instead of spinning a core beside vLLM's (a
  default CUDA event spins for as long as the queued work before it runs: a whole
  forward pass when a save's gather waits for it).
* **checksums on the GPU** (the zero-copy path, where Mooncake moves blocks straight
  between GPU memory and the pool): :meth:`BlockMover.checksums` computes the
  :data:`~mooncake_vllm.codec.WSUM64` checksum of blocks in place with torch ops
  and copies only the 8-byte results to pinned host memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mooncake_vllm import codec
from mooncake_vllm.codec import HEADER_SIZE
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.store.slots import Run, SlotPool

__all__ = ["BlockMover", "CopyFence", "DEVICE_STAGE_BYTES", "checksums_on_device"]

#: device staging per direction (each copy is cut into pieces of this size)
DEVICE_STAGE_BYTES = 256 << 20
#: blocks checksummed per kernel batch (bounds the temporaries to ~2 × this × a layer's block)
_SUM_BATCH = 512
#: staged rows checksummed per kernel (the products' temporary: this many blocks' bytes)
_ROW_BATCH = 8


#: host copies go run by run (slices: plain memcpy per segment) when a run's piece of a
#: layer is at least this big or runs are long; numpy's fancy indexing copies twice
#: (a temporary, then the destination) and ran at about half of memcpy (bench_store)
_RUN_COPY_BYTES = 16 << 10


def _id_runs(ids: Sequence[int], positions: Sequence[int] | None = None) -> list[tuple[int, int, int]]:
    """``(position, first block id, count)``: stretches where both ids and positions step by one."""
    pos = list(range(len(ids))) if positions is None else positions
    runs: list[tuple[int, int, int]] = []
    for i, (p, b) in enumerate(zip(pos, ids)):
        if runs and i and p == pos[i - 1] + 1 and b == ids[i - 1] + 1:
            start, first, k = runs[-1]
            runs[-1] = (start, first, k + 1)
        else:
            runs.append((p, b, 1))
    return runs


def _copy_by_runs(runs: Sequence[tuple[int, int, int]], n: int, shape: tuple[int, int, int]) -> bool:
    """Whether run-by-run slice copies beat one fancy-indexed copy (Python loop cost)."""
    _layers, segs, seg_nbytes = shape
    return bool(runs) and (segs * seg_nbytes >= _RUN_COPY_BYTES or len(runs) * 4 <= n)


class CopyFence:
    """A queued copy that reads vLLM's blocks: whoever reuses them must come after it.

    :meth:`order` makes vLLM's stream wait for the copy (later kernels only, the host
    never waits); it is idempotent, and says whether the copy was still running.
    """

    __slots__ = ("event", "stream", "ordered")

    def __init__(self, event: Any, stream: Any) -> None:
        self.event, self.stream, self.ordered = event, stream, False

    def order(self) -> bool:
        """Order vLLM's later work after the copy; whether the copy was still running."""
        if self.ordered:
            return False
        self.ordered = True
        running = not self.event.query()
        if running:
            self.stream.wait_event(self.event)
        return running


def checksums_on_device(layout: BlockLayout) -> bool:
    """Whether the GPU can checksum ``layout``'s blocks in place (wsum64 over whole 8-byte
    words of KV in CUDA memory): what GPU zero-copy needs."""
    return layout.on_cuda and layout.seg_nbytes % 8 == 0


class BlockMover:
    """Gather blocks into slots and scatter slots into blocks, for one layout."""

    def __init__(self, layout: BlockLayout, *, device_stage_bytes: int = DEVICE_STAGE_BYTES) -> None:
        import torch

        self._torch = torch
        self.layout = layout
        self.views = layout.byte_views()
        self.slot_nbytes = HEADER_SIZE + layout.block_nbytes
        self.cuda = layout.on_cuda
        #: host memory moves through numpy fancy indexing: torch's CPU index_select
        #: on bytes runs at a fraction of memcpy speed (measured 0.3-0.8 vs 3.7 GB/s)
        self._host_views = None if self.cuda else [v.numpy() for v in self.views]
        self._shape = (layout.num_layers, layout.segs_per_layer, layout.seg_nbytes)
        if self.cuda:
            self.device = torch.device(layout.device)
            rows = max(1, device_stage_bytes // self.slot_nbytes)
            self.save_stream = torch.cuda.Stream(self.device)
            self.load_stream = torch.cuda.Stream(self.device)
            self.save_stage = torch.empty((rows, self.slot_nbytes), dtype=torch.uint8,
                                          device=self.device)
            self.load_stage = torch.empty_like(self.save_stage)
        self._words: list[Any] | None = None
        self._weights: Any = None
        self._row_weights: Any = None

    # ------------------------------------------------------------------ helpers
    def _payload(self, rows: Any) -> Any:
        """``[k, slot]`` rows → ``[k, layers, segs, seg_nbytes]`` block bytes (a view)."""
        return rows[:, HEADER_SIZE:].view(rows.shape[0], *self._shape)

    def _host_wait_event(self) -> Any:
        """An event some thread of ours will ``synchronize()`` on: it sleeps, not spins."""
        return self._torch.cuda.Event(blocking=True)

    def _index(self, ids: Sequence[int]) -> Any:
        t = self._torch.tensor(list(ids), dtype=self._torch.long)
        if not self.cuda:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)  # on the current (our) stream

    def _gather_into(self, rows: Any, block_ids: Sequence[int]) -> None:
        dst = self._payload(rows)
        if self._host_views is not None:
            out, ids = dst.numpy(), list(block_ids)
            runs = _id_runs(ids)
            if not _copy_by_runs(runs, len(ids), self._shape):
                for layer, view in enumerate(self._host_views):
                    out[:, layer] = view[:, ids].transpose(1, 0, 2)
                return
            for pos, first, k in runs:
                for layer, view in enumerate(self._host_views):
                    out[pos:pos + k, layer] = view[:, first:first + k].transpose(1, 0, 2)
            return
        idx, index_select = self._index(block_ids), self._torch.index_select
        for layer, view in enumerate(self.views):
            # one kernel per layer, straight into the slots' strided view (no temporary):
            # a save's capture is launch-bound on vLLM's thread (~1.3 ms for 32 layers)
            index_select(view, 1, idx, out=dst[:, layer].transpose(0, 1))

    def _scatter_from(self, rows: Any, positions: Sequence[int], block_ids: Sequence[int]) -> None:
        if self._host_views is not None:
            payload, ids = self._payload(rows).numpy(), list(block_ids)
            runs = _id_runs(ids, list(positions))
            if not _copy_by_runs(runs, len(ids), self._shape):
                src = payload[list(positions)]
                for layer, view in enumerate(self._host_views):
                    view[:, ids] = src[:, layer].transpose(1, 0, 2)
                return
            for pos, first, k in runs:
                for layer, view in enumerate(self._host_views):
                    view[:, first:first + k] = payload[pos:pos + k, layer].transpose(1, 0, 2)
            return
        if len(positions) != rows.shape[0]:
            rows = rows.index_select(0, self._index(positions))
        src = self._payload(rows)
        idx = self._index(block_ids)
        for layer, view in enumerate(self.views):
            view.index_copy_(1, idx, src[:, layer].transpose(0, 1))

    def _pieces(self, runs: list[Run], rows: int) -> list[tuple[int, int, int]]:
        """``(first slot, count, position)`` pieces of ``runs`` at most ``rows`` long."""
        out, pos = [], 0
        for start, count in runs:
            for off in range(0, count, rows):
                k = min(rows, count - off)
                out.append((start + off, k, pos + off))
            pos += count
        return out

    # ------------------------------------------------------------------ save
    def gather(self, pool: SlotPool, runs: list[Run], block_ids: Sequence[int], *,
               defer_fence: bool = False, sums: Any = None) -> tuple[Any, CopyFence | None]:
        """Copy ``block_ids`` (in ``runs`` order) into their slots: ``(done, fence)``.

        Host: done on return (``(None, None)``). CUDA: queued; ``done`` completes when
        the bytes are in the slots. The fence (the read of vLLM's blocks) is ordered
        here, unless ``defer_fence``: then it is returned, and the caller must
        :meth:`~CopyFence.order` it before vLLM may reuse the blocks. ``sums`` (CUDA,
        whole words: a pinned int64 host tensor, one per block): filled with each
        slot's payload wsum64, computed on the GPU from the staged copy — the bytes the
        slot will hold — and valid once ``done`` completes; the host then checksums
        nothing (its numpy wsum64 ran at ~0.6 GB/s per put thread on the 2-core dev box).
        """
        if not self.cuda:
            for start, k, pos in self._pieces(runs, pool.count):
                self._gather_into(pool.rows[start:start + k], block_ids[pos:pos + k])
            return None, None
        torch = self._torch
        vllm_stream = torch.cuda.current_stream(self.device)
        written = torch.cuda.Event()
        written.record(vllm_stream)
        fence = CopyFence(torch.cuda.Event(), vllm_stream)
        done = self._host_wait_event()
        pieces = self._pieces(runs, self.save_stage.shape[0])
        try:
            with torch.cuda.stream(self.save_stream):
                self.save_stream.wait_event(written)
                for n, (start, k, pos) in enumerate(pieces):
                    stage = self.save_stage[:k]
                    self._gather_into(stage, block_ids[pos:pos + k])
                    if n == len(pieces) - 1:
                        fence.event.record(self.save_stream)
                    if sums is not None:
                        sums[pos:pos + k].copy_(self.row_sums(stage), non_blocking=True)
                    pool.rows[start:start + k].copy_(stage, non_blocking=True)
                done.record(self.save_stream)
        except BaseException:
            fence.event.record(self.save_stream)  # whatever was queued: vLLM comes after it
            fence.order()
            raise
        if not defer_fence:
            fence.order()  # later steps may reuse the blocks only after this
            return done, None
        return done, fence

    # ------------------------------------------------------------------ load
    def scatter(self, pool: SlotPool, runs: list[Run], ok: Sequence[bool],
                block_ids: Sequence[int], *, after: Any = None, wait: bool = False) -> Any:
        """Copy the slots whose ``ok`` is true into ``block_ids``; the completion event.

        Host: done on return. CUDA: the copy starts after ``after`` (an event on
        vLLM's stream; default: one recorded on the calling thread's current
        stream) and vLLM's stream waits for it, or with ``wait`` (a background
        load, whose request vLLM schedules only once reported) this thread waits.
        The event says when the slots may be reused.
        """
        if not self.cuda:
            for start, k, pos in self._pieces(runs, pool.count):
                sel = [i for i in range(k) if ok[pos + i]]
                if sel:
                    self._scatter_from(pool.rows[start:start + k], sel,
                                       [block_ids[pos + i] for i in sel])
            return None
        torch = self._torch
        vllm_stream = torch.cuda.current_stream(self.device)
        before = after
        if before is None:
            before = torch.cuda.Event()
            before.record(vllm_stream)
        done = self._host_wait_event()
        with torch.cuda.stream(self.load_stream):
            self.load_stream.wait_event(before)
            for start, k, pos in self._pieces(runs, self.load_stage.shape[0]):
                sel = [i for i in range(k) if ok[pos + i]]
                if not sel:
                    continue
                stage = self.load_stage[:k]
                stage.copy_(pool.rows[start:start + k], non_blocking=True)
                self._scatter_from(stage, sel, [block_ids[pos + i] for i in sel])
            done.record(self.load_stream)
        if wait:
            done.synchronize()
        else:
            vllm_stream.wait_event(done)
        return done

    # ------------------------------------------------------------------ checksums
    def row_sums(self, rows: Any) -> Any:
        """wsum64 of each ``[k, slot]`` row's payload (after its header), where the rows
        are: int64 ``[k]`` (read one as ``int(v) & MASK64``). Needs whole words."""
        torch = self._torch
        words = rows[:, HEADER_SIZE:].view(torch.int64)  # [k, payload words]
        weights = self._row_weights
        if weights is None or weights.device != words.device:
            weights = self._row_weights = codec.wsum_weights(words.shape[1], words.device)
        # a few rows at a time: the products are a temporary as large as the rows
        return torch.cat([codec.wsum_rows(words[r:r + _ROW_BATCH], weights)
                          for r in range(0, words.shape[0], _ROW_BATCH)])

    def _block_sums(self, block_ids: Sequence[int]) -> Any:
        """wsum64 of each block, in place, on the current stream: int64 ``[k]`` on its device.

        (Host tensors work too: the same arithmetic on the CPU, which tests compare
        with :func:`codec.checksum_segments`.)
        """
        torch = self._torch
        device = torch.device(self.layout.device)
        if self._words is None:
            layers, segs, seg = self._shape
            words = seg // 8
            self._words = [v.view(torch.int64) for v in self.views]  # [segs, nb, words]
            self._weights = codec.wsum_weights(layers * segs * words, device).view(
                layers, segs, 1, words)
        acc = torch.zeros(len(block_ids), dtype=torch.int64, device=device)
        for off in range(0, len(block_ids), _SUM_BATCH):
            idx = self._index(block_ids[off:off + _SUM_BATCH])
            part = acc[off:off + _SUM_BATCH]
            for words, weights in zip(self._words, self._weights):
                part += codec.wsum_rows(words.index_select(1, idx), weights).sum(dim=0)
        return acc

    def checksums(self, block_ids: Sequence[int], *, after: Any = None,
                  writers_done: bool = False) -> tuple[Any, Any]:
        """Queue the GPU checksums of ``block_ids``: ``(pinned int64 tensor, event)``.

        Runs on the save stream after ``after`` (default: an event on the calling
        thread's current stream, i.e. after the forward pass that wrote the KV).
        ``writers_done``: also after everything queued so far on the legacy default
        stream (where copies made by the transfer engine go). Read the tensor
        only once the event has completed (``codec`` reads it as unsigned).
        """
        torch = self._torch
        before = after
        if before is None:
            before = torch.cuda.Event()
            before.record(torch.cuda.current_stream(self.device))
        done = self._host_wait_event()
        host = torch.empty(len(block_ids), dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(self.save_stream):
            self.save_stream.wait_event(before)
            if writers_done:
                legacy = torch.cuda.Event()
                legacy.record(torch.cuda.default_stream(self.device))
                self.save_stream.wait_event(legacy)
            if block_ids:
                host.copy_(self._block_sums(block_ids), non_blocking=True)
            done.record(self.save_stream)
        return host, done

    def stream_position(self) -> Any:
        """An event on the calling thread's current stream (vLLM's, on its thread)."""
        if not self.cuda:
            return None
        event = self._torch.cuda.Event()
        event.record(self._torch.cuda.current_stream(self.device))
        return event
