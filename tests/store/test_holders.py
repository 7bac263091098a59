"""A hung holder costs only its blocks (store/holders.py): real master + two holders, one
SIGSTOPped mid-load. Before HolderGuard the load's deadline opened the pool's breaker and
every lookup of every block answered "miss" until a probe closed it."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np

from mooncake_vllm.config import load_store_config
from mooncake_vllm.keys import KeyNamespace, chunk_keys
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.store import StoreClient
from mooncake_vllm.store.misses import miss_counts


def test_a_hung_holder_is_suspended_and_the_pool_stays_open(local_stack: Any) -> None:
    client = StoreClient.connect(load_store_config(local_stack.config_path), timeout=5)
    blocks = 48
    kv = [np.random.default_rng(i).standard_normal((blocks, 2, 16, 64), dtype=np.float32) for i in range(2)]
    layout = BlockLayout.from_kv_caches(kv)
    client.register_layout(layout)
    keys = chunk_keys(KeyNamespace("holders", "float32", layout.fingerprint, 16), list(range(blocks * 16)))
    ids = list(range(blocks))
    try:
        assert client.put_blocks(keys, layout, ids) == blocks
        client.transport.op_timeout = 1.0  # transfer deadline 1 s + size/200 MB/s
        holder = local_stack.holders[0]
        os.kill(holder.pid, signal.SIGSTOP)
        try:
            first = client.get_blocks(keys, layout, ids)  # stalls on the hung holder's blocks
            assert not all(first)
            assert client.healthy, "one hung holder opened the whole pool's breaker"
            assert client.transport.holders.suspended, "the hung holder was not pinned down"
            assert client.exists(keys) == [True] * blocks  # lookups still served
            start = time.monotonic()
            again = client.get_blocks(keys, layout, ids)
            took = time.monotonic() - start
            assert took < 1.0, f"a load waited {took:.1f} s on a suspended holder"
            stop = again.index(False) if False in again else blocks
            assert all(again[:stop]) and not any(again[stop:])  # up to its first block
            assert client.healthy
        finally:
            os.kill(holder.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not all(client.get_blocks(keys, layout, ids)):
            assert time.monotonic() < deadline, "the resumed holder's blocks never loaded again"
            time.sleep(0.5)
        assert not client.transport.holders.suspended
        causes = miss_counts(client.stats.snapshot())
        assert causes.get("load_timeout", 0) > 0 and causes.get("holder_suspended", 0) > 0, causes
        assert "pool_away" not in causes and "breaker_open" not in causes, causes
    finally:
        client.close()
