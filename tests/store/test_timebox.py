"""TimeBox: a busy worker makes a call wait (within its deadline), a stuck one refuses it.

Pure logic over threads and sleeps, plus one REAL client shared by threads (the
real pool's hung-master case is tests/store/test_health.py): a call of another thread that is merely in flight
must never read as "the pool is away" (that opened the circuit breaker whenever
a save, a load and a lookup overlapped).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from mooncake_vllm.config import load_store_config
from mooncake_vllm.errors import CallRejected, CallTimedOut
from mooncake_vllm.services import LocalStack
from mooncake_vllm.store import StoreClient
from mooncake_vllm.store.timebox import TimeBox


@pytest.fixture
def box() -> Iterator[TimeBox]:
    b = TimeBox("t", 1)
    yield b
    b.close()


def _busy(box: TimeBox, seconds: float) -> threading.Thread:
    started = threading.Event()

    def hold() -> None:
        box.run(10.0, lambda: (started.set(), time.sleep(seconds)))

    t = threading.Thread(target=hold)
    t.start()
    assert started.wait(5)
    return t


def test_a_call_waits_for_a_worker_busy_with_another_threads_call(box: TimeBox) -> None:
    t = _busy(box, 0.2)
    t0 = time.monotonic()
    assert box.run(2.0, lambda: 42) == 42
    assert 0.05 < time.monotonic() - t0 < 1.5
    t.join()


def test_a_worker_stuck_past_the_callers_deadline_refuses_within_that_deadline(box: TimeBox) -> None:
    t = _busy(box, 1.0)
    t0 = time.monotonic()
    with pytest.raises(CallRejected, match="all workers busy"):
        box.run(0.3, lambda: 1)
    assert 0.25 < time.monotonic() - t0 < 0.9
    with pytest.raises(CallRejected):
        box.submit(lambda: 1)  # no wait asked: refused at once
    t.join()


def test_the_deadline_covers_the_wait_and_the_call(box: TimeBox) -> None:
    t = _busy(box, 0.3)
    t0 = time.monotonic()
    with pytest.raises(CallTimedOut):
        box.run(0.5, time.sleep, 0.5)  # 0.3 s waiting + 0.5 s running > 0.5 s
    assert time.monotonic() - t0 < 0.9
    t.join()


def test_threads_sharing_a_real_client_queue_instead_of_opening_the_breaker(
        local_stack: LocalStack) -> None:
    """One REAL client shared by threads, as in a single-process engine (scheduler
    lookups, the save thread, namespace registration, hand-off markers)."""
    client = StoreClient.connect(load_store_config(local_stack.config_path))
    errors: list[BaseException] = []

    def hammer() -> None:
        try:
            for i in range(40):
                client.exists([f"mcv/timebox/{threading.get_ident()}/{i}"])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=hammer) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        snap = client.stats.snapshot()
        assert not errors
        assert snap.get("rejected", 0) == 0 and snap.get("timeouts", 0) == 0, snap
        assert client.healthy
    finally:
        client.close()


def test_spare_workers_take_over_from_abandoned_calls_and_stay_bounded() -> None:
    """A call abandoned at its deadline hands its slot on (its worker stays held): the next
    call runs at once, up to ``spare`` abandoned calls; past that the box refuses again."""
    box = TimeBox("spare", 1, spare=1)
    release = threading.Event()
    try:
        with pytest.raises(CallTimedOut):
            box.run(0.1, release.wait)  # hung: abandoned, its slot handed on
        assert box.run(1.0, lambda: 7) == 7  # served by the spare worker
        with pytest.raises(CallTimedOut):
            box.run(0.1, release.wait)  # a second hung call: no spare left for it
        with pytest.raises(CallRejected):
            box.run(0.2, lambda: 8)  # both workers held: refused, not queued
        release.set()
        deadline = time.monotonic() + 5
        while True:  # once the hung calls return, the box serves again
            try:
                assert box.run(1.0, lambda: 9) == 9
                break
            except CallRejected:
                assert time.monotonic() < deadline
        assert box.run(1.0, lambda: 10) == 10
    finally:
        release.set()
        box.close()


@pytest.mark.parametrize("grace", [0.0, 0.5])
def test_a_box_with_a_grace_looks_once_more_before_abandoning_a_call(grace: float) -> None:
    """The waiter woke past the deadline (a stalled process or machine) while the call needed
    a moment more: with a grace it gets that moment; without, it is abandoned at once."""
    b = TimeBox("t", 1, grace=grace)
    try:
        fut = b.submit(time.sleep, 0.2)
        start = time.monotonic()
        if grace:
            assert b.result(fut, 0.05) is None and b.answered_in_grace == 1
        else:
            with pytest.raises(CallTimedOut):
                b.result(fut, 0.05)
            assert time.monotonic() - start < 0.15
        hung = b.submit(time.sleep, 2.0, wait=3.0)
        start = time.monotonic()
        with pytest.raises(CallTimedOut):  # a call that stays hung is abandoned after the grace
            b.result(hung, 0.05)
        assert time.monotonic() - start < 0.05 + grace + 0.1
    finally:
        b.close()


def test_drain_waits_for_every_running_call_abandoned_ones_too() -> None:
    b = TimeBox("d", 1, spare=1)
    release = threading.Event()
    with pytest.raises(CallTimedOut):
        b.run(0.05, release.wait, 5)  # abandoned at its deadline, still running
    assert not b.drain(0.05)
    release.set()
    assert b.drain(2.0)
    b.close()
    assert b.drain(0.0)
