"""The load probe (store/probe.py): timed throw-away loads over every lane, nothing left behind.

Real master + holders on loopback; the late release of the slots is pure logic.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from mooncake_vllm.config import load_store_config
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.store import StoreClient
from mooncake_vllm.store.paths import StagingSizes
from mooncake_vllm.store.probe import PROBE_BLOCKS, PROBE_PREFIX, _release_after, probe_loads


def _layout(blocks: int = 8) -> tuple[list[np.ndarray], BlockLayout]:
    kv = [np.ones((blocks, 2, 16, 64), dtype=np.float32) for _ in range(2)]
    return kv, BlockLayout.from_kv_caches(kv)


@pytest.fixture
def client(module_local_stack: Any) -> Any:
    c = StoreClient.connect(load_store_config(module_local_stack.config_path))
    yield c
    c.close()


@pytest.mark.parametrize("lanes", [1, 3])
def test_the_probe_times_each_size_and_leaves_no_value_and_no_slot_behind(client: Any,
                                                                          lanes: int) -> None:
    kv, layout = _layout()
    client.register_layout(layout, clients=lanes)
    assert client.lanes == lanes
    before = [t.copy() for t in kv]
    samples = client.probe_loads(layout)
    assert [blocks for blocks, _ in samples] == list(PROBE_BLOCKS)
    assert all(0 < seconds < 5 for _, seconds in samples)
    paths = client._paths_for(layout)
    runs = paths.load_pool.take(paths.load_pool.count)
    assert sum(n for _, n in runs) == paths.load_pool.count  # every slot is free again
    paths.load_pool.release(runs)
    # its values are gone, and the KV cache was never touched
    assert client.transport.batch_exist([f"{PROBE_PREFIX}/x"]) == [0]
    assert client.remove_matching(f"^{PROBE_PREFIX}/") in (0, None)
    for t, old in zip(kv, before):
        assert np.array_equal(t, old)


def test_a_small_slot_pool_caps_the_probe_at_half_its_slots(client: Any) -> None:
    _, layout = _layout()
    client._staging = StagingSizes(load=10 * (layout.block_nbytes + 4096))
    client.register_layout(layout)
    count = client._paths_for(layout).load_pool.count
    samples = client.probe_loads(layout)
    assert samples and max(b for b, _ in samples) == count // 2


def test_the_probe_answers_nothing_while_the_pool_is_closed(client: Any) -> None:
    _, layout = _layout()
    client.register_layout(layout)
    client.transport.closed = True
    try:
        assert probe_loads(client.transport, client._paths_for(layout)) == []
    finally:
        client.transport.closed = False


def test_slots_of_a_get_still_running_come_back_only_when_it_returns() -> None:
    released: list[int] = []
    done: Future[Any] = Future()
    done.set_result(None)
    running: Future[Any] = Future()
    _release_after([done, running], lambda: released.append(1))
    assert released == []  # a late get could still write into them
    running.set_result(None)
    assert released == [1]
    _release_after([done], lambda: released.append(2))
    assert released == [1, 2]
