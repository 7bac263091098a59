"""Registered staging memory cut into block-sized slots: ``header || block bytes``.

One slot holds one stored value exactly as it travels, so every value moves as
one contiguous buffer (Mooncake's fastest path). Slots live in host memory that
Mooncake has registered: page-aligned anonymous memory, or pinned (page-locked)
memory when the KV cache is on a GPU, so device↔host copies run asynchronously.

A slot is handed back only when nothing can touch it any more: after the
Mooncake call that used it has returned (also one abandoned at its deadline),
and after any device copy that reads it has completed (``release(after=event)``).
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Run", "SlotPool", "page_aligned_buffer", "slots_of"]

#: (first slot, count): slots that are adjacent in memory
Run = tuple[int, int]


def page_aligned_buffer(nbytes: int) -> tuple[mmap.mmap, int]:
    """Anonymous memory on pages of its own, and its address.

    Mooncake refuses to register two regions that share a page ("does not support
    overlapped memory region"), so buffers we register never come from malloc.
    """
    buf = mmap.mmap(-1, max(nbytes, 1))
    return buf, ctypes.addressof(ctypes.c_char.from_buffer(buf))


class SlotPool:
    """``count`` slots of ``slot_nbytes`` in one registered buffer, as a torch tensor."""

    def __init__(self, slot_nbytes: int, count: int, *, pinned: bool,
                 register: Callable[[int, int], Any]) -> None:
        import torch

        self.slot_nbytes = slot_nbytes
        self.count = max(1, count)
        nbytes = self.slot_nbytes * self.count
        if pinned:
            self.memory = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._keep: Any = None
        else:
            self._keep, _ptr = page_aligned_buffer(nbytes)
            self.memory = torch.frombuffer(self._keep, dtype=torch.uint8, count=nbytes)
        self.ptr = int(self.memory.data_ptr())
        self.rows = self.memory.view(self.count, self.slot_nbytes)
        self._bytes = memoryview(self._keep if self._keep is not None
                                 else self.memory.numpy()).cast("B")
        self.registered = register(self.ptr, nbytes) == 0
        self._free = bytearray(b"\x01") * self.count
        self._deferred: list[tuple[Any, list[Run]]] = []
        self._lock = threading.Lock()

    def address(self, slot: int) -> int:
        return self.ptr + slot * self.slot_nbytes

    def view(self, slot: int) -> memoryview:
        """Host bytes of one slot (never device memory)."""
        return self._bytes[slot * self.slot_nbytes:(slot + 1) * self.slot_nbytes]

    def take(self, n: int) -> list[Run]:
        """Up to ``n`` free slots, as few runs as possible (may be fewer than ``n``)."""
        runs: list[Run] = []
        with self._lock:
            self._reclaim()
            left, i = n, 0
            while left > 0 and i < self.count:
                if not self._free[i]:
                    i += 1
                    continue
                start = i
                while i < self.count and self._free[i] and i - start < left:
                    self._free[i] = 0
                    i += 1
                runs.append((start, i - start))
                left -= i - start
        return runs

    def release(self, runs: list[Run], after: Any = None) -> None:
        """Hand slots back, at once or once ``after`` (a CUDA event) has completed."""
        with self._lock:
            if after is not None and not after.query():
                self._deferred.append((after, runs))
                return
            self._give(runs)

    def _give(self, runs: list[Run]) -> None:
        for start, count in runs:
            self._free[start:start + count] = b"\x01" * count

    def _reclaim(self) -> None:
        keep = []
        for event, runs in self._deferred:
            if event.query():
                self._give(runs)
            else:
                keep.append((event, runs))
        self._deferred = keep

    def settle(self) -> None:
        """Wait for every deferred device copy (shutdown, tests)."""
        with self._lock:
            for event, runs in self._deferred:
                event.synchronize()
                self._give(runs)
            self._deferred = []


def slots_of(runs: list[Run]) -> list[int]:
    """Every slot index of ``runs``, in order."""
    return [s for start, count in runs for s in range(start, start + count)]
