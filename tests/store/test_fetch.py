"""Staged loads (store/fetch.py): fetch sizes, what a failed get counts, verified scatter.

Real master + holder on loopback for the data path; the size rule and the counting of
failure codes are pure logic.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from mooncake_vllm.config import load_store_config
from mooncake_vllm.keys import KeyNamespace, chunk_keys
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.stats import StoreStats
from mooncake_vllm.store import StoreClient
from mooncake_vllm.store.codes import Code
from mooncake_vllm.store.fetch import MAX_BATCH, MIN_FETCH, count_failed_get, fetch_size

_seed = itertools.count(100)


@pytest.mark.parametrize("count, slots, lanes", [(1, 64, 1), (40, 64, 1), (4000, 4096, 2),
                                                 (4000, 8, 1), (300, 600, 3)])
def test_fetch_size_keeps_two_fetches_in_flight_per_lane(count: int, slots: int,
                                                         lanes: int) -> None:
    size = fetch_size(count, slots, lanes)
    assert 1 <= size <= MAX_BATCH
    assert size <= max(1, slots // (2 * lanes))  # two in flight per lane always fit
    if slots // (2 * lanes) >= MIN_FETCH:
        assert size >= MIN_FETCH  # never tiny gets while the slots allow more


@pytest.mark.parametrize("code, counter", [
    (Code.OBJECT_NOT_FOUND, "misses"), (Code.LEASE_EXPIRED, "misses"), (0, "misses"),
    (4096, "corrupt"), (Code.INVALID_PARAMS, "corrupt"), (Code.TRANSFER_FAIL, "errors"),
    (RuntimeError("x"), "errors")])
def test_a_failed_get_counts_as_a_miss_a_foreign_size_or_an_error(code: Any,
                                                                  counter: str) -> None:
    transport = SimpleNamespace(stats=StoreStats(strict=True))
    count_failed_get(transport, code)  # type: ignore[arg-type]
    assert {k for k, v in transport.stats.snapshot().items() if v} == {counter}


@pytest.fixture
def client(module_local_stack: Any) -> Any:
    c = StoreClient.connect(load_store_config(module_local_stack.config_path))
    yield c
    c.close()


def _kv(blocks: int = 16) -> tuple[list[np.ndarray], BlockLayout]:
    rng = np.random.default_rng(next(_seed))
    kv = [rng.standard_normal((blocks, 2, 16, 64), dtype=np.float32) for _ in range(2)]
    return kv, BlockLayout.from_kv_caches(kv)


def test_only_present_verified_blocks_are_scattered_and_misses_are_counted(client: Any) -> None:
    kv, layout = _kv()
    client.register_layout(layout)
    base = 1_000_000 * next(_seed)
    keys = chunk_keys(KeyNamespace("fetch", "float32", layout.fingerprint, 16),
                      list(range(base, base + 16 * 4)))
    assert client.put_blocks([keys[0], keys[2]], layout, [0, 2]) == 2
    before = [t.copy() for t in kv]
    misses = client.stats.snapshot()["misses"]
    assert client.get_blocks(keys[:3], layout, [8, 9, 10]) == [True, False, True]
    assert client.stats.snapshot()["misses"] == misses + 1
    for t, old in zip(kv, before):
        assert np.array_equal(t[8], old[0]) and np.array_equal(t[10], old[2])
        assert np.array_equal(t[9], old[9])  # the missing block is left as it was
