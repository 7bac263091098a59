"""Puts of a captured save (store/puts.py) on a REAL master + holders: batches striped
over lanes, exact counters, nothing sent while the pool is away."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

from mooncake_vllm.config import load_store_config
from mooncake_vllm.keys import KeyNamespace, chunk_keys
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.store import StoreClient, puts
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


def _count_lane_puts(client: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Batches put per lane, from here on."""
    used = [0] * len(client.transport.lanes)
    for lane in client.transport.lanes:
        def submit(*args: Any, _orig: Any = lane.saves.submit, _i: int = lane.index,
                   **kwargs: Any) -> Any:
            used[_i] += 1
            return _orig(*args, **kwargs)
        monkeypatch.setattr(lane.saves, "submit", submit)
    return used


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_a_save_striped_over_lanes_stores_each_block_once_byte_exact(
        client: Any, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kv, layout, keys = _kv(SHAPES[kind])
    client.register_layout(layout, clients=3)
    ids = list(range(30))
    ticket = client.prepare_save(keys[:30], layout, ids)
    assert ticket.snapshot is (kind == "snapshot")
    monkeypatch.setattr(puts, "LANE_BATCH_BYTES", 10 * client._paths_for(layout).slot_nbytes)
    used = _count_lane_puts(client, monkeypatch)
    assert client.commit_save(ticket) == 30
    assert used == [1, 1, 1], used  # 10 blocks on each lane
    stats = client.stats.snapshot()
    assert stats["blocks_put"] == 30 and stats["bytes_put"] == 30 * layout.block_nbytes
    assert client.put_blocks(keys[:30], layout, ids) == 0  # every key exists: none re-put
    assert client.stats.snapshot()["skipped_existing"] == 30
    before = [t.copy() for t in kv]
    assert client.get_blocks(keys[:10], layout, list(range(30, 40))) == [True] * 10
    for t, old in zip(kv, before):
        assert np.array_equal(t[30:40], old[:10])


def test_a_small_save_goes_to_one_lane_in_one_call(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's few new blocks: one hand-off in vLLM's process, not one per lane."""
    _, layout, keys = _kv(SHAPES["snapshot"])
    client.register_layout(layout, clients=3)
    assert 6 * client._paths_for(layout).slot_nbytes < puts.LANE_BATCH_BYTES
    used = _count_lane_puts(client, monkeypatch)
    assert client.put_blocks(keys[:6], layout, list(range(6))) == 6
    assert sorted(used) == [0, 0, 1], used
    assert client.get_blocks(keys[:6], layout, list(range(6, 12))) == [True] * 6


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


def test_a_hung_put_is_logged_while_it_runs_and_again_when_abandoned(
        local_stack: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Every holder SIGSTOPped, the master answering: the put hangs. After SLOW_PUT a line names
    its store client and size (counter puts_slow) while it still runs; at its deadline a second
    line says it was abandoned and saves are held back (before: both silent, only counters)."""
    caplog.set_level(logging.WARNING, logger="mooncake_vllm.store.transport")
    c = StoreClient.connect(load_store_config(local_stack.config_path))
    try:
        _, layout, keys = _kv(SHAPES["snapshot"])
        c.register_layout(layout)
        c.transport.op_timeout = 2.5
        for holder in local_stack.holders:
            os.kill(holder.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            assert c.put_blocks(keys[:4], layout, [0, 1, 2, 3]) == 0
            took = time.monotonic() - start
        finally:
            for holder in local_stack.holders:
                os.kill(holder.pid, signal.SIGCONT)
        stats = c.stats.snapshot()
        assert stats["puts_slow"] == 1 and stats["saves_abandoned"] == 4, stats
        assert stats["saves_held_back"] == 1 and c.healthy
        said = [r.getMessage() for r in caplog.records]
        assert any("a put of 4 blocks" in m and "store client 0 has not returned" in m for m in said), said
        assert any("gave no answer within" in m and "saves held back" in m for m in said), said
        assert 2.5 <= took < 5.0, took
    finally:
        time.sleep(1.0)  # the abandoned put returns once the holders run again
        c.close()


class _FullPool:
    """A store call refusing ``refuse`` keys per attempt with NO_AVAILABLE_HANDLE, then storing them."""

    def __init__(self, refusals: list[int]) -> None:
        self.refusals = refusals
        self.calls: list[list[str]] = []

    def __call__(self, keys: list[str], ptrs: list[Any], sizes: list[Any]) -> list[int]:
        self.calls.append(list(keys))
        refuse = self.refusals.pop(0) if self.refusals else 0
        return [-200 if i < refuse else 0 for i in range(len(keys))]


def _transport(waits: tuple[float, float, float] | None) -> Any:
    from types import SimpleNamespace

    from mooncake_vllm.stats import StoreStats

    return SimpleNamespace(full_waits=waits, closed=False, stats=StoreStats(strict=True))


def test_with_a_disk_tier_refused_keys_are_put_again_while_retries_make_progress() -> None:
    from mooncake_vllm.store.puts import _put_until_room

    keys = [f"k{i}" for i in range(6)]
    tier = _transport((0.001, 0.004, 0.02))
    put = _FullPool([4, 2, 2, 2])  # 2 stored, then none for a while, then all
    assert _put_until_room(tier, put, keys, keys, keys) == [0] * 6
    assert put.calls[1] == keys[:4] and put.calls[-1] == keys[:2]  # only the refused keys again
    assert tier.stats.snapshot()["put_retries_full"] == 4 + 2 + 2 + 2
    stalled = _FullPool([6] * 100)  # no progress: gives up after the patience (0.02 s of waits)
    assert _put_until_room(tier, stalled, keys, keys, keys) == [-200] * 6
    assert 2 < len(stalled.calls) < 10
    dram_only = _FullPool([6])  # no tier: one call, the refusals come back (the save is dropped)
    assert _put_until_room(_transport(None), dram_only, keys, keys, keys) == [-200] * 6
    assert len(dram_only.calls) == 1
