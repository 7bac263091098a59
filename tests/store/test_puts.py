"""Puts of a captured save (store/puts.py) on a REAL master + holders: batches striped
over lanes, exact counters, nothing sent while the pool is away."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from mooncake_vllm.config import load_store_config
from mooncake_vllm.keys import KeyNamespace, chunk_keys
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.store import StoreClient
from mooncake_vllm.store.puts import put_ticket

_seed = itertools.count(200)
#: (blocks, kv heads, block size, 2·head dim): per-layer pieces of 4 KiB (snapshot) and
#: 512 KiB (zero-copy)
SHAPES = {"snapshot": (40, 2, 16, 32), "zero-copy": (40, 2, 64, 1024)}


@pytest.fixture
def client(module_local_stack: Any) -> Any:
    c = StoreClient.connect(load_store_config(module_local_stack.config_path))
    yield c
    c.close()


def _kv(shape: tuple[int, ...]) -> tuple[list[np.ndarray], BlockLayout, list[str]]:
    rng = np.random.default_rng(next(_seed))
    kv = [rng.standard_normal(shape, dtype=np.float32) for _ in range(2)]
    layout = BlockLayout.from_kv_caches(kv)
    base = 1_000_000 * next(_seed)
    keys = chunk_keys(KeyNamespace("puts", "float32", layout.fingerprint, shape[2]),
                      list(range(base, base + shape[2] * shape[0])))
    return kv, layout, keys


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_a_save_striped_over_lanes_stores_each_block_once_byte_exact(client: Any,
                                                                     kind: str) -> None:
    kv, layout, keys = _kv(SHAPES[kind])
    client.register_layout(layout, clients=3)
    ids = list(range(30))
    ticket = client.prepare_save(keys[:30], layout, ids)
    assert ticket.snapshot is (kind == "snapshot")
    assert client.commit_save(ticket) == 30
    stats = client.stats.snapshot()
    assert stats["blocks_put"] == 30 and stats["bytes_put"] == 30 * layout.block_nbytes
    assert client.put_blocks(keys[:30], layout, ids) == 0  # every key exists: none re-put
    assert client.stats.snapshot()["skipped_existing"] == 30
    before = [t.copy() for t in kv]
    assert client.get_blocks(keys[:10], layout, list(range(30, 40))) == [True] * 10
    for t, old in zip(kv, before):
        assert np.array_equal(t[30:40], old[:10])


def test_nothing_is_put_while_the_breaker_is_open(client: Any) -> None:
    _, layout, keys = _kv(SHAPES["snapshot"])
    client.register_layout(layout)
    ticket = client.prepare_save(keys[:4], layout, [0, 1, 2, 3])
    client.transport.health.failed("test: pool away")
    try:
        assert put_ticket(client.transport, client._paths_for(layout), ticket, [0, 1, 2, 3]) == 0
        stats = client.stats.snapshot()
        assert stats["saves_skipped"] == 4 and stats["blocks_put"] == 0
    finally:
        client.discard(ticket)
