"""How one layout's blocks travel: what a save captures, and how values move.

* :class:`SaveTicket` — a save captured on the engine's thread, put later:
  either a **snapshot** (the bytes are already in staging slots: the blocks may
  be reused at once) or a **zero-copy** save of host memory whose checksums
  were taken while the bytes were known good (right after the forward pass).
  A zero-copy put reads the blocks later; if vLLM reused one meanwhile, the
  stored bytes no longer match the header's checksum, so a reader refuses
  them, and the writer re-checks after the put and removes such a value.
* :class:`LayoutPaths` — per registered layout: the slot pools, the mover, and
  which save kind applies (zero-copy for host memory with Mooncake's
  multi-buffer API when each layer's piece of a block is large; a snapshot —
  one coalesced slice per block — for small pieces, for CUDA memory, or without
  that API). Loads go through slots (a value is verified before any byte of it
  reaches the KV cache, and a load abandoned at its deadline can only ever
  write into slots that stay reserved until Mooncake returns), except
  *background* loads into registered host KV with Mooncake's multi-buffer get
  (``host_direct``): they get straight into the blocks and verify them there
  (:mod:`~mooncake_vllm.store.direct`).
* **GPU zero-copy** (:func:`choose_gpu_path`): with a CUDA build of Mooncake and
  the KV cache's CUDA memory registered, saves put the blocks straight from GPU
  memory (header from a registered host slot + the block's GPU segments in one
  multi-buffer put) with checksums computed on the GPU, and background loads get
  straight into the KV blocks, then verify them on the GPU (a mismatch is a
  failed block: vLLM recomputes it, overwriting the bytes). KV caches in CUDA
  memory always frame values with the wsum64 checksum, so staged and zero-copy
  instances read each other's values.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mooncake_vllm import codec
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.settings import GPU_PATHS
from mooncake_vllm.store.mover import BlockMover, CopyFence, checksums_on_device
from mooncake_vllm.store.slots import Run, SlotPool, slots_of

__all__ = ["COALESCE_BELOW", "GPU_PATHS", "VERIFY_GPU_SUMS", "LayoutPaths", "SaveTicket",
           "StagingSizes", "choose_gpu_path"]

log = logging.getLogger(__name__)

#: CUDA snapshots whose GPU checksums are compared with the host's before they are trusted
VERIFY_GPU_SUMS = 8


def _unsigned(sums: Any) -> list[int]:
    """GPU checksums from their int64 host tensor, as the codec's unsigned 64-bit values."""
    return [v & codec.MASK64 for v in sums.tolist()]


#: per-layer pieces up to this size are copied into one slice per block: one
#: transfer slice per small piece costs more than the copy (bench/bench_store.py)
COALESCE_BELOW = 256 << 10




def choose_gpu_path(setting: str, *, protocol: str, cuda_build: bool, multi_buffer: bool,
                    whole_words: bool) -> tuple[str, str]:
    """``("staged" | "zero_copy", why)`` for a KV cache in CUDA memory.

    ``zero_copy`` needs a CUDA build of Mooncake (it reads GPU addresses), its
    multi-buffer API and blocks of whole 8-byte words (the GPU checksum); the
    KV cache must then also register (the caller's last check). ``auto`` picks
    it only over RDMA: over TCP the staged path moves contiguous pinned buffers,
    measured on an H200 at 1.40 / 4.04 GB/s put / get against 0.64 / 1.14 for
    per-layer GPU buffers (docs/gpu.md; bench/bench_gpu_store.py measures both).
    """
    missing = [why for ok, why in ((cuda_build, "Mooncake is not a CUDA build "
                                    "(install mooncake-transfer-engine-cuda13)"),
                                   (multi_buffer, "Mooncake lacks the multi-buffer API (>= 0.3.7)"),
                                   (whole_words, "a block segment is not whole 8-byte words"))
               if not ok]
    if setting == "staged":
        return "staged", "gpu_path=staged"
    if setting == "zero_copy":
        return ("staged", "; ".join(missing)) if missing else ("zero_copy", "gpu_path=zero_copy")
    if missing:
        return "staged", "; ".join(missing)
    if protocol != "rdma":
        return "staged", f"auto: protocol {protocol} (staged is faster without RDMA)"
    return "zero_copy", "auto: rdma"


@dataclass(frozen=True)
class StagingSizes:
    """Registered host staging per layout, in bytes (each rounded to whole blocks)."""

    #: snapshots of host KV (small per-layer pieces, or no multi-buffer puts): one step's
    #: saves must fit, or the blocks beyond are dropped (future misses). vLLM on CPU prefills
    #: an 8k-token prompt in one step: 186 MiB for the 12-layer bench model, which 64 MiB
    #: cut to a third (bench_serving). Anonymous memory: pages are touched only when used.
    save_host: int = 512 << 20
    #: pinned snapshots of CUDA KV awaiting their put: a 16k-token prompt of an 8B-class
    #: model is 2 GiB, saved in two chunks faster than TCP puts drain (measured on an H200)
    save_cuda: int = 4 << 30
    load: int = 256 << 20  #: pinned/host slots loads go through
    device_stage: int = 256 << 20  #: device staging per direction (CUDA only)


@dataclass
class SaveTicket:
    """A save captured by :meth:`StoreClient.prepare_save`, put by ``commit_save``."""

    keys: list[str]
    block_ids: list[int]
    layout: BlockLayout
    snapshot: bool  #: bytes are in slots: the blocks may be reused right away
    checksums: list[int] = field(default_factory=list)  #: zero-copy: taken at capture
    #: pinned checksums computed on the GPU, valid once ``ready`` completes: of the blocks
    #: (GPU zero-copy) or of the staged slots (a CUDA snapshot)
    sums: Any = None
    runs: list[Run] = field(default_factory=list)  #: snapshot: slots, ``keys`` order
    ready: Any = None  #: snapshot on CUDA: event completing when slots hold the bytes
    #: CUDA snapshot captured with ``defer_fence``: order it before vLLM reuses the blocks
    fence: CopyFence | None = None
    dropped: int = 0  #: blocks not captured (no free slot): future misses
    pool: SlotPool | None = None
    done: bool = False
    abandoned: bool = False  #: a put outlived its deadline: its late return frees the slots
    #: ``save_admission`` ``"repeat"``: a new block is stored only once its mark is in the
    #: pool (its first save puts the mark instead), except the keys in ``always``
    repeat_only: bool = False
    always: frozenset[str] = frozenset()


class LayoutPaths:
    """Slot pools and the mover of one registered layout."""

    def __init__(self, layout: BlockLayout, register: Any, *, multi_buffer: bool,
                 sizes: StagingSizes, gpu_zero_copy: bool = False,
                 host_direct: bool = False) -> None:
        self.layout = layout
        self.slot_nbytes = codec.HEADER_SIZE + layout.block_nbytes
        self.layout_digest = codec.digest16(layout.fingerprint)
        #: KV in CUDA memory: values carry wsum64, which the GPU computes
        self.checksum_kind = codec.WSUM64 if layout.on_cuda else codec.XXH3
        #: CUDA KV moved straight by Mooncake (registered, CUDA build)
        self.gpu_zero_copy = gpu_zero_copy and layout.on_cuda
        #: background loads straight into the KV blocks (off after a load that never returned):
        #: CUDA KV moved zero-copy, or registered host KV (the caller checked the get API)
        self.direct_loads = self.gpu_zero_copy or (host_direct and not layout.on_cuda)
        #: checksum kinds a direct load verifies where the blocks are (the GPU: wsum64 only)
        self.in_place_kinds = ((codec.WSUM64,) if layout.on_cuda
                               else tuple(codec.CHECKSUM_KINDS))
        self.zero_copy_save = self.gpu_zero_copy or (
            multi_buffer and not layout.on_cuda and layout.seg_nbytes > COALESCE_BELOW)
        pinned = layout.on_cuda
        self.mover = BlockMover(layout, device_stage_bytes=sizes.device_stage)
        self.load_pool = SlotPool(self.slot_nbytes, sizes.load // self.slot_nbytes or 4,
                                  pinned=pinned, register=register)
        self.save_pool: SlotPool | None = None
        if not self.zero_copy_save:
            budget = sizes.save_cuda if layout.on_cuda else sizes.save_host
            self.save_pool = SlotPool(self.slot_nbytes, budget // self.slot_nbytes or 4,
                                      pinned=pinned, register=register)
        self.header_pool = SlotPool(codec.HEADER_SIZE, 1024, pinned=False, register=register)
        #: CUDA snapshots are checksummed on the GPU (until one disagrees with the host)
        self.gpu_snapshot_sums = checksums_on_device(layout)
        self._gpu_sums_checked = 0

    @property
    def registered(self) -> bool:
        pools = [self.load_pool, self.header_pool] + ([self.save_pool] if self.save_pool else [])
        return all(p.registered for p in pools)

    # ------------------------------------------------------------------ capture
    def capture(self, keys: list[str], block_ids: list[int], *,
                defer_fence: bool = False) -> SaveTicket:
        """Take what a later put needs, now, while the blocks hold the keys' bytes.

        ``defer_fence``: see :meth:`BlockMover.gather` (CUDA snapshots only).
        """
        if self.gpu_zero_copy:
            host, ready = self.mover.checksums(block_ids)
            return SaveTicket(keys, block_ids, self.layout, snapshot=False, sums=host,
                              ready=ready)
        if self.zero_copy_save:
            sums = [codec.checksum_segments(self.layout.segments(b)) for b in block_ids]
            return SaveTicket(keys, block_ids, self.layout, snapshot=False, checksums=sums)
        pool = self.save_pool
        assert pool is not None
        runs = pool.take(len(keys))
        n = len(slots_of(runs))
        sums = self._device_sums_buffer(n)
        ready, fence = (self.mover.gather(pool, runs, block_ids[:n], defer_fence=defer_fence,
                                          sums=sums)
                        if n else (None, None))
        return SaveTicket(keys[:n], block_ids[:n], self.layout, snapshot=True, runs=runs,
                          ready=ready, fence=fence, dropped=len(keys) - n, pool=pool, sums=sums)

    def _device_sums_buffer(self, n: int) -> Any:
        """A pinned tensor for the GPU to checksum ``n`` staged slots into, or None where
        the host checksums them (host KV, or CUDA KV not in whole 8-byte words)."""
        if not n or not self.gpu_snapshot_sums:
            return None
        import torch

        return torch.empty(n, dtype=torch.int64, pin_memory=True)

    def frame_snapshot(self, ticket: SaveTicket, keep: Sequence[int]) -> tuple[list[int], list[int]]:
        """Checksum the slots at ``keep`` (positions) and write their headers.

        Returns the slot addresses and sizes to put. Host memory only is read.
        """
        assert ticket.pool is not None
        if ticket.ready is not None:
            ticket.ready.synchronize()  # this thread waits, never vLLM's stream
        pool = ticket.pool
        slots = slots_of(ticket.runs)
        on_gpu = self._trusted_sums(ticket, slots)
        ptrs, sizes = [], []
        for pos in keep:
            slot = slots[pos]
            raw = pool.view(slot)
            payload = raw[codec.HEADER_SIZE:]
            checksum = on_gpu[pos] if on_gpu is not None else codec.checksum_bytes(payload, self.checksum_kind)
            raw[:codec.HEADER_SIZE] = codec.pack_header(
                len(payload), checksum, self.layout_digest, codec.digest16(ticket.keys[pos]),
                self.checksum_kind)
            ptrs.append(pool.address(slot))
            sizes.append(self.slot_nbytes)
        return ptrs, sizes

    def _trusted_sums(self, ticket: SaveTicket, slots: Sequence[int]) -> list[int] | None:
        """The GPU's checksums of a snapshot's slots (None: the host computes them). The
        first :data:`VERIFY_GPU_SUMS` snapshots are checked against the host's; one mismatch
        turns GPU checksums off for good (logged): a wrong one would only turn loads into
        counted misses, but every one of them."""
        if ticket.sums is None or not self.gpu_snapshot_sums:
            return None
        sums = _unsigned(ticket.sums)
        if self._gpu_sums_checked < VERIFY_GPU_SUMS:  # put threads may race here: a check more
            self._gpu_sums_checked += 1
            assert ticket.pool is not None
            host = [codec.checksum_bytes(ticket.pool.view(slot)[codec.HEADER_SIZE:], self.checksum_kind)
                    for slot in slots[:len(sums)]]
            if host != sums:
                self.gpu_snapshot_sums = False
                log.warning("mooncake-vllm: a CUDA snapshot's checksums computed on the GPU differ from "
                            "the host's; the host computes them from now on")
                return None
        return sums

    def frame_zero_copy(self, ticket: SaveTicket, keep: Sequence[int],
                        header_runs: list[Run]) -> tuple[list[list[int]], list[list[int]]]:
        """Headers (from the captured checksums) in header slots; multi-buffer lists."""
        self._resolve(ticket)
        ptrs, sizes = [], []
        for pos, slot in zip(keep, slots_of(header_runs)):
            self.header_pool.view(slot)[:] = codec.pack_header(
                self.layout.block_nbytes, ticket.checksums[pos], self.layout_digest,
                codec.digest16(ticket.keys[pos]), self.checksum_kind)
            segs = self.layout.segments(ticket.block_ids[pos])
            ptrs.append([self.header_pool.address(slot)] + [p for p, _ in segs])
            sizes.append([codec.HEADER_SIZE] + [n for _, n in segs])
        return ptrs, sizes

    @staticmethod
    def _resolve(ticket: SaveTicket) -> None:
        """GPU checksums → ``ticket.checksums`` (this thread waits for them, never vLLM's)."""
        if ticket.sums is not None and not ticket.checksums:
            ticket.ready.synchronize()
            ticket.checksums = _unsigned(ticket.sums)

    def device_sums(self, block_ids: Sequence[int], *, after: Any = None,
                    writers_done: bool = False) -> list[int]:
        """wsum64 of CUDA blocks, computed on the GPU (this thread waits for them)."""
        host, done = self.mover.checksums(list(block_ids), after=after,
                                          writers_done=writers_done)
        done.synchronize()
        return _unsigned(host)

    def block_sums(self, block_ids: Sequence[int], kinds: Sequence[int]) -> list[int]:
        """Checksums of blocks as they are now, where they are: CUDA blocks on the GPU
        (wsum64, after every copy queued so far), host blocks on the host (``kinds``)."""
        if self.layout.on_cuda:
            return self.device_sums(block_ids, writers_done=True)
        return [codec.checksum_segments(self.layout.segments(b), kind)
                for b, kind in zip(block_ids, kinds)]

    def intact(self, ticket: SaveTicket, positions: Sequence[int]) -> list[bool]:
        """Zero-copy: do these blocks' bytes still match the checksums taken at capture?"""
        if self.gpu_zero_copy:
            now = self.device_sums([ticket.block_ids[p] for p in positions])
            return [a == ticket.checksums[p] for a, p in zip(now, positions)]
        return [codec.checksum_segments(self.layout.segments(ticket.block_ids[p]))
                == ticket.checksums[p] for p in positions]

    def release(self, ticket: SaveTicket) -> None:
        if ticket.pool is not None and not ticket.done:
            ticket.done = True
            ticket.pool.release(ticket.runs)

    # ------------------------------------------------------------------ load
    def verify_slot(self, slot: int, key: str) -> str | None:
        """Why the value read into ``slot`` is not this key's block, or ``None``."""
        raw = self.load_pool.view(slot)
        return codec.verify(raw[:codec.HEADER_SIZE],
                            [(self.load_pool.address(slot) + codec.HEADER_SIZE,
                              self.layout.block_nbytes)],
                            layout_digest=self.layout_digest, key_digest=codec.digest16(key))
