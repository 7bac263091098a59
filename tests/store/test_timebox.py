"""TimeBox: a busy worker is waited for within the caller's deadline, a hung one refuses.

The first test is pure logic (threads and events). The second shares one REAL
client between threads the way a single-process engine does (scheduler lookups,
the save thread, background namespace registration): concurrent callers must
queue, not be refused — a refusal opens the pool breaker and turns hits into misses.
"""

from __future__ import annotations

import threading
import time

import pytest

from mooncake_vllm.config import load_store_config
from mooncake_vllm.services import LocalStack
from mooncake_vllm.store import StoreClient
from mooncake_vllm.store.timebox import CallRejected, CallTimedOut, TimeBox


def test_a_busy_worker_is_waited_for_and_a_hung_one_refuses_after_the_deadline() -> None:
    box = TimeBox("t", 1)
    release = threading.Event()
    try:
        first = box.submit(release.wait)
        # a live call finishing within the second caller's deadline: the caller queues
        threading.Timer(0.2, release.set).start()
        assert box.run(2.0, lambda: "second") == "second"
        assert first.result(1) is True
        # a hung call: the next caller waits its own deadline, no longer, then is refused
        hang = threading.Event()
        box.submit(hang.wait)
        start = time.monotonic()
        with pytest.raises(CallRejected):
            box.run(0.3, lambda: None)
        assert 0.25 <= time.monotonic() - start < 1.5
        with pytest.raises(CallRejected):  # pipelined submits do not wait
            box.submit(lambda: None)
        hang.set()
        with pytest.raises(CallTimedOut):
            box.run(0.2, time.sleep, 2)
    finally:
        box.close()


def test_threads_sharing_a_real_client_queue_instead_of_opening_the_breaker(
        local_stack: LocalStack) -> None:
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
