"""V1 worker side: saves, loads and the delayed-free protocol.

Round trips run against a REAL master + holder (numpy arrays stand in for vLLM's
CPU KV cache: same ``[blocks, heads, block_size, 2*head]`` layout); the
save-completion bookkeeping is tested with a controllable fake client.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from mooncake_vllm.config import load_store_config
from mooncake_vllm.errors import UnsupportedVersionError
from mooncake_vllm.keys import KeyNamespace
from mooncake_vllm.v1.client import SharedClient
from mooncake_vllm.v1.metadata import BlockJob, MooncakeConnectorMetadata
from mooncake_vllm.v1.namespace import ExpectedLayout
from mooncake_vllm.v1.worker import WorkerLogic

SHAPE = (16, 2, 4, 64)  # blocks, kv heads, block size, 2*head
EXPECTED = ExpectedLayout("cpu", "", "float32", 2, SHAPE[1:])


def _cache(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"layer.{i}": rng.standard_normal(SHAPE, dtype=np.float32) for i in range(2)}


def _ns(tag: str) -> KeyNamespace:
    return KeyNamespace(f"worker-test-{tag}", "float32", EXPECTED.fingerprint, SHAPE[2])


class _Source:
    def __init__(self, client: Any) -> None:
        self.client = client

    def get(self) -> Any:
        return self.client

    def on_connect(self, cb: Any) -> None:
        if self.client is not None:
            cb(self.client)


class _GatedClient:
    """Fake pool client whose puts wait for a gate (to observe in-flight saves)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.puts: list[list[str]] = []

    def register_layout(self, layout: Any) -> None:
        pass

    def put_blocks(self, keys: list[str], layout: Any, block_ids: list[int]) -> int:
        self.gate.wait(5)
        self.puts.append(list(keys))
        return len(keys)


def _save_meta(req_id: str, blocks: list[int]) -> MooncakeConnectorMetadata:
    return MooncakeConnectorMetadata(saves=[BlockJob(req_id, [f"{b:032x}" for b in blocks], blocks)])


def test_finished_only_after_saves_and_only_for_saving_requests() -> None:
    client = _GatedClient()
    w = WorkerLogic(_ns("gate"), EXPECTED, _Source(client), can_load=True, can_save=True)
    w.register_kv_caches(_cache(0))
    w.wait_for_save(_save_meta("a", [1, 2]))
    assert w.get_finished({"a", "never-saved"}) == set()  # save still in flight
    client.gate.set()
    deadline = time.monotonic() + 5
    while not w.idle() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.get_finished(set()) == {"a"}  # reported once, on a later call
    assert w.get_finished({"a"}) == set()
    assert len(client.puts) == 1
    w.shutdown()


def test_preemption_waits_for_pending_saves() -> None:
    client = _GatedClient()
    w = WorkerLogic(_ns("pre"), EXPECTED, _Source(client), can_load=True, can_save=True)
    w.register_kv_caches(_cache(0))
    w.wait_for_save(_save_meta("p", [3]))
    threading.Timer(0.3, client.gate.set).start()
    t0 = time.monotonic()
    w.handle_preemptions({"p"})
    assert time.monotonic() - t0 >= 0.25 and w.idle()
    w.shutdown()


def test_full_queue_drops_saves_instead_of_blocking() -> None:
    client = _GatedClient()
    w = WorkerLogic(_ns("full"), EXPECTED, _Source(client), can_load=True, can_save=True,
                    queue_size=1)
    w.register_kv_caches(_cache(0))
    t0 = time.monotonic()
    for i in range(5):
        w.wait_for_save(_save_meta(f"r{i}", [i]))
    assert time.monotonic() - t0 < 1.0
    assert w.counters["dropped_jobs"] >= 3
    client.gate.set()
    w.shutdown()


def test_layout_mismatch_is_refused() -> None:
    w = WorkerLogic(_ns("bad"), ExpectedLayout("cpu", "", "float32", 3, SHAPE[1:]),
                    _Source(None), can_load=True, can_save=True)
    with pytest.raises(UnsupportedVersionError, match="L3"):
        w.register_kv_caches(_cache(0))


def test_no_pool_means_every_planned_load_fails() -> None:
    w = WorkerLogic(_ns("nopool"), EXPECTED, _Source(None), can_load=True, can_save=True)
    w.register_kv_caches(_cache(0))
    w.start_load_kv(MooncakeConnectorMetadata(loads=[BlockJob("r", ["00" * 16], [4])]))
    assert w.take_load_errors() == {4}
    assert w.take_load_errors() == set()


@pytest.fixture(scope="module")
def pool(module_local_stack: Any) -> Any:
    shared = SharedClient(load_store_config(module_local_stack.config_path))
    assert shared.start() is not None
    yield shared
    shared.close()


def test_round_trip_through_a_real_pool(pool: SharedClient) -> None:
    src, dst = _cache(1), _cache(2)
    ns = _ns("rt")
    saver = WorkerLogic(ns, EXPECTED, pool, can_load=False, can_save=True)
    saver.register_kv_caches(src)
    digests = [f"{i:032x}" for i in range(3)]
    saver.wait_for_save(MooncakeConnectorMetadata(saves=[BlockJob("s", digests, [5, 6, 7])]))
    deadline = time.monotonic() + 10
    while not saver.idle() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert saver.counters["saved_blocks"] == 3
    assert saver.get_finished({"s"}) == {"s"}
    saver.shutdown()

    loader = WorkerLogic(ns, EXPECTED, pool, can_load=True, can_save=False)
    loader.register_kv_caches(dst)
    missing = f"{99:032x}"
    loader.start_load_kv(MooncakeConnectorMetadata(
        loads=[BlockJob("l", [*digests, missing], [1, 2, 3, 4])]))
    assert loader.take_load_errors() == {4}
    for name in src:
        assert np.array_equal(dst[name][1:4], src[name][5:8])
    assert not np.array_equal(dst["layer.0"][4], src["layer.0"][4])
