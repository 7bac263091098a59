"""Staging slots: registered host memory cut into block-sized slots, taken as runs."""

from __future__ import annotations

import mmap

import pytest

from mooncake_vllm.store.slots import SlotPool, page_aligned_buffer, slots_of


def _pool(count: int = 6, slot: int = 128, pinned: bool = False) -> tuple[SlotPool, list]:
    registered: list[tuple[int, int]] = []
    pool = SlotPool(slot, count, pinned=pinned,
                    register=lambda ptr, n: registered.append((ptr, n)) or 0)
    return pool, registered


def test_host_slots_are_one_page_aligned_registered_buffer() -> None:
    pool, registered = _pool()
    assert registered == [(pool.ptr, 6 * 128)] and pool.registered
    assert pool.ptr % mmap.PAGESIZE == 0
    assert [pool.address(i) for i in range(3)] == [pool.ptr, pool.ptr + 128, pool.ptr + 256]
    buf, ptr = page_aligned_buffer(1000)
    assert len(buf) >= 1000 and ptr % mmap.PAGESIZE == 0


def test_a_refused_registration_is_reported() -> None:
    pool = SlotPool(64, 2, pinned=False, register=lambda ptr, n: -1)
    assert not pool.registered


def test_slots_are_taken_as_few_runs_and_never_twice() -> None:
    pool, _ = _pool()
    a = pool.take(2)
    b = pool.take(3)
    assert a == [(0, 2)] and b == [(2, 3)]
    assert pool.take(4) == [(5, 1)]  # fewer than asked: only one left
    assert pool.take(1) == []
    pool.release(b)
    assert slots_of(pool.take(5)) == [2, 3, 4]
    pool.release(a)
    assert pool.take(1) == [(0, 1)]


def test_a_view_is_the_slots_host_bytes() -> None:
    pool, _ = _pool()
    pool.view(1)[:4] = b"abcd"
    assert bytes(pool.rows[1, :4].numpy()) == b"abcd"
    assert len(pool.view(5)) == 128


@pytest.mark.gpu
def test_slots_released_after_a_cuda_event_come_back_once_it_completed() -> None:
    import torch

    pool, _ = _pool(count=2, pinned=True)
    runs = pool.take(2)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)  # keep the stream busy
        event = torch.cuda.Event()
        event.record(stream)
    pool.release(runs, after=event)
    if not event.query():
        assert pool.take(1) == []  # still copying: not free yet
    pool.settle()
    assert slots_of(pool.take(2)) == [0, 1]
