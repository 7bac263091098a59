"""Misses caused by an error (store/misses.py): counted by cause, each cause logged with its fix.

Real master + holders on loopback: a breaker opened by a SIGSTOPped master, a holder
SIGSTOPped mid-load (transfer deadline), a holder killed (its segment lost).
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import numpy as np
import pytest

from mooncake_vllm.config import load_store_config
from mooncake_vllm.keys import KeyNamespace, chunk_keys
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.store import StoreClient
from mooncake_vllm.store.codes import Code
from mooncake_vllm.store.fetch import failed_get_cause
from mooncake_vllm.store.misses import MISS_CAUSES, miss_counts


@pytest.mark.parametrize("code, cause", [
    (Code.OBJECT_NOT_FOUND, ""), (0, ""), (Code.TRANSFER_FAIL, "lost_segment"),
    (Code.SEGMENT_NOT_FOUND, "lost_segment"), (4096, "corrupt"), (RuntimeError("x"), "load_error"),
    (-1, "load_error")])
def test_an_absent_value_is_no_error_a_lost_holder_is(code: Any, cause: str) -> None:
    assert failed_get_cause(code) == cause
    assert cause == "" or cause in MISS_CAUSES


def _filled(stack: Any, blocks: int = 32) -> tuple[StoreClient, BlockLayout, list[str], list[np.ndarray]]:
    client = StoreClient.connect(load_store_config(stack.config_path), timeout=5)
    kv = [np.random.default_rng(i).standard_normal((blocks, 2, 16, 64), dtype=np.float32)
          for i in range(2)]
    layout = BlockLayout.from_kv_caches(kv)
    client.register_layout(layout)
    keys = chunk_keys(KeyNamespace("misses", "float32", layout.fingerprint, 16),
                      list(range(blocks * 16)))
    assert client.put_blocks(keys, layout, list(range(blocks))) == blocks
    return client, layout, keys, kv  # kv: the registered memory, alive as long as the client


def test_an_away_master_is_counted_by_cause_with_the_fix(
        local_stack: Any, caplog: pytest.LogCaptureFixture) -> None:
    client, layout, keys, _kv = _filled(local_stack)
    try:
        master = local_stack.master
        os.kill(master.pid, signal.SIGSTOP)
        try:
            with caplog.at_level(logging.WARNING, logger="mooncake_vllm"):
                assert client.exists(keys) == [False] * len(keys)  # lookup_failed: the breaker opens
                assert client.exists(keys) == [False] * len(keys)  # pool_away: nothing asked
                assert client.exists(keys) == [False] * len(keys)
                assert not any(client.get_blocks(keys, layout, list(range(len(keys)))))  # breaker_open
        finally:
            os.kill(master.pid, signal.SIGCONT)
        causes = miss_counts(client.stats.snapshot())
        assert causes == {"lookup_failed": len(keys), "pool_away": 2 * len(keys),
                          "breaker_open": len(keys)}, causes
        lines = [r.getMessage() for r in caplog.records if "pool miss(es) caused by" in r.getMessage()]
        assert any("caused by pool_away" in m and "Fix: check that mooncake_master at" in m for m in lines)
        assert len([m for m in lines if "caused by pool_away" in m]) == 1  # once per interval
        assert all("Fix:" in m for m in lines)
    finally:
        client.close()
