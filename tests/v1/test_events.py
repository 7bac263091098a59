"""Pool KV events: what workers observe in a REAL pool, and the events the scheduler makes of it.

The worker side runs against a real master + holder (numpy arrays as the CPU KV
cache, as in ``test_worker.py``); the scheduler side is pure logic over vLLM's
own event classes. The whole path through a real server's publisher is tested
in ``test_telemetry.py``.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
from vllm.distributed.kv_events import BlockRemoved, BlockStored

try:  # how vLLM publishes a block hash in its own events
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as published
except ImportError:  # older releases (0.9.x): BlockHash tuples, published as their hash_value

    def published(block_hash: Any) -> Any:
        return getattr(block_hash, "hash_value", block_hash)


from mooncake_vllm.config import load_store_config
from mooncake_vllm.keys import KeyNamespace
from mooncake_vllm.v1.client import SharedClient
from mooncake_vllm.v1.events import (
    POOL_MEDIUM,
    REMOVED,
    STORED,
    PoolKVEvents,
    SchedulerEvents,
    WorkerEvents,
)
from mooncake_vllm.v1.metadata import BlockJob, MooncakeConnectorMetadata
from mooncake_vllm.v1.metrics import Meter, MeteredSource, worker_counters
from mooncake_vllm.v1.namespace import ExpectedLayout
from mooncake_vllm.v1.worker import WorkerLogic

SHAPE = (16, 2, 4, 64)  # blocks, kv heads, block size, 2*head
EXPECTED = ExpectedLayout("cpu", "", "float32", 2, SHAPE[1:])
BS = SHAPE[2]


def _request(req_id: str, n_blocks: int) -> SimpleNamespace:
    tokens = list(range(100, 100 + n_blocks * BS + 1))
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, lora_request=None,
                           block_hashes=[bytes([i]) * 32 for i in range(n_blocks)])


def _scheduled(req: SimpleNamespace, digests: list[str]) -> dict[str, Any]:
    return {req.request_id: SimpleNamespace(request=req, digests=digests)}


def test_a_block_is_stored_once_every_rank_has_it_and_named_by_vllms_hash() -> None:
    req = _request("r", 3)
    digests = [f"{i:032x}" for i in range(3)]
    events = SchedulerEvents(BS, world=2)
    events.planned(MooncakeConnectorMetadata(saves=[BlockJob("r", digests[1:], [7, 8])]),
                   _scheduled(req, digests))
    events.received(PoolKVEvents([("tp0-pp0", STORED, d) for d in digests[1:]]))
    assert events.take_events() == []  # rank 1 has not saved them yet
    events.received(PoolKVEvents([("tp1-pp0", STORED, digests[2])]))
    (stored,) = events.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [published(req.block_hashes[2])]  # as vLLM publishes its own
    assert stored.parent_block_hash == published(req.block_hashes[1])
    assert stored.token_ids == req.prompt_token_ids[2 * BS:3 * BS]
    assert (stored.medium, stored.block_size, stored.lora_id) == (POOL_MEDIUM, BS, None)
    events.received(PoolKVEvents([("tp1-pp0", REMOVED, digests[1]), ("tp0-pp0", REMOVED, "f" * 32)]))
    (removed,) = events.take_events()  # the unknown digest is nobody's block: no event
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == [published(req.block_hashes[1])] and removed.medium == POOL_MEDIUM
    assert events.take_events() == []


def test_events_containers_merge_like_vllms_output_aggregator() -> None:
    a = PoolKVEvents([("tp0-pp0", STORED, "a")])
    b = PoolKVEvents([("tp1-pp0", STORED, "a")])
    a.add_events(b.get_all_events())
    a.increment_workers(b.get_number_of_workers())
    assert a.get_number_of_workers() == 2 and len(a.get_all_events()) == 2
    a.clear_events()
    assert a.get_all_events() == []


def _idle(w: WorkerLogic, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not w.idle():
        assert time.monotonic() < deadline, "saves did not finish"
        time.sleep(0.01)


def test_worker_reports_what_the_pool_holds_and_what_it_lost(module_local_stack: Any) -> None:
    pool = SharedClient(load_store_config(module_local_stack.config_path))
    assert pool.start() is not None, "the test pool did not accept a client"
    rng = np.random.default_rng(7)
    cache = {f"layer.{i}": rng.standard_normal(SHAPE, dtype=np.float32) for i in range(2)}
    ns = KeyNamespace(f"events-test-{time.monotonic_ns()}", "float32", EXPECTED.fingerprint, BS)
    meter, seen = Meter("tp0-pp0"), WorkerEvents("tp0-pp0")
    worker = WorkerLogic(ns, EXPECTED, MeteredSource(pool, meter, seen), can_load=True,
                         can_save=True)
    try:
        worker.register_kv_caches(cache)
        digests = [f"{i:032x}" for i in range(3)]
        worker.wait_for_save(MooncakeConnectorMetadata(saves=[BlockJob("s", digests, [1, 2, 3])]))
        _idle(worker)
        taken = seen.take()
        assert taken is not None and taken.get_all_events() == [("tp0-pp0", STORED, d) for d in digests]
        nbytes = worker.layout.block_nbytes
        stats = meter.take(worker_counters(worker, pool.get()))
        assert stats is not None
        assert {k: v for k, v in stats.data["counters"].items()} == {
            "saved_blocks": 3, "saved_bytes": 3 * nbytes}
        assert len(stats.data["latency"]["save"]) == 1

        gone = f"{ns.prefix()}/{digests[1]}"
        pool.get().transport.remove(gone)  # the pool lost one block (evicted, or another tenant's clear)
        worker.start_load_kv(MooncakeConnectorMetadata(loads=[BlockJob("l", digests, [5, 6, 7])]))
        assert worker.take_load_errors() == {6}
        taken = seen.take()
        assert taken is not None and taken.get_all_events() == [("tp0-pp0", REMOVED, digests[1])]
        stats = meter.take(worker_counters(worker, pool.get()))
        assert stats is not None and stats.data["counters"] == {
            "loaded_blocks": 2, "loaded_bytes": 2 * nbytes, "failed_blocks": 1}
        assert len(stats.data["latency"]["load"]) == 1
        assert seen.take() is None and meter.take(worker_counters(worker, pool.get())) is None
    finally:
        worker.shutdown(timeout=2)
        pool.close()
