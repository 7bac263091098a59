"""V1 worker side: saves, loads and the delayed-free protocol.

Round trips run against a REAL master + holder (numpy arrays stand in for vLLM's
CPU KV cache: same ``[blocks, heads, block_size, 2*head]`` layout); the
save-completion bookkeeping is tested with a controllable fake client.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from mooncake_vllm.config import load_store_config
from mooncake_vllm.errors import UnsupportedVersionError
from mooncake_vllm.keys import KeyNamespace
from mooncake_vllm.store import SaveTicket
from mooncake_vllm.v1.client import SharedClient
from mooncake_vllm.v1.metadata import BlockJob, MooncakeConnectorMetadata
from mooncake_vllm.v1.namespace import ExpectedLayout
from mooncake_vllm.v1.telemetry import Telemetry
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

    def __init__(self, snapshot: bool = False, copy_running: bool | None = None) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.snapshot = snapshot
        self.copy_running = copy_running  # None: host KV (no fence); else a fake CUDA copy
        self.puts: list[list[str]] = []
        self.discarded: list[list[str]] = []
        self.fences: list[_Fence] = []
        self.deferred: list[bool] = []
        self.captures: list[list[str]] = []
        self.captured_blocks: list[list[int]] = []
        self.admissions: list[tuple[str, set[str]]] = []
        self.marked: list[list[str]] = []

    def register_layout(self, layout: Any, gpu_path: str = "auto", clients: int = 1) -> None:
        pass

    def saves_snapshot(self, layout: Any) -> bool:
        return self.snapshot

    def prepare_save(self, keys: list[str], layout: Any, block_ids: list[int], *,
                     defer_fence: bool = False, admission: str = "all",
                     always: Any = ()) -> SaveTicket:
        self.deferred.append(defer_fence)
        self.admissions.append((admission, set(always)))
        self.captures.append(list(keys))
        self.captured_blocks.append(list(block_ids))
        fence = None
        if self.copy_running is not None and defer_fence:
            fence = _Fence(self.copy_running)
            self.fences.append(fence)
        return SaveTicket(list(keys), list(block_ids), layout, snapshot=self.snapshot, fence=fence)

    def commit_save(self, ticket: SaveTicket) -> int:
        self.started.set()
        self.gate.wait(5)
        self.puts.append(list(ticket.keys))
        return len(ticket.keys)

    def discard(self, ticket: SaveTicket) -> None:
        self.discarded.append(list(ticket.keys))

    def mark_seen(self, keys: list[str]) -> None:
        self.marked.append(list(keys))


class _Fence:
    """Stands in for a CUDA snapshot's :class:`~mooncake_vllm.store.mover.CopyFence`."""

    def __init__(self, running: bool) -> None:
        self.running, self.orders = running, 0

    def order(self) -> bool:
        self.orders += 1
        return self.running if self.orders == 1 else False


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _save_meta(req_id: str, blocks: list[int]) -> MooncakeConnectorMetadata:
    return MooncakeConnectorMetadata(saves=[BlockJob(req_id, [f"{b:032x}" for b in blocks], blocks)])


def _wait_idle(w: WorkerLogic, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not w.idle():
        assert time.monotonic() < deadline, "saves did not finish"
        time.sleep(0.01)


@pytest.fixture
def workers() -> Any:
    """Collects WorkerLogic objects and shuts each down (no save thread leaks)."""
    made: list[WorkerLogic] = []
    yield made.append
    for w in made:
        w.shutdown(timeout=2)


def test_only_jobs_that_ask_are_admitted_on_the_save_thread(workers: Any) -> None:
    client = _GatedClient(snapshot=True)
    client.gate.set()
    w = WorkerLogic(_ns("admit"), EXPECTED, _Source(client), can_load=True, can_save=True)
    workers(w)
    w.register_kv_caches(_cache(0))
    asks, plain, refill = ([f"{b:032x}" for b in blocks] for blocks in ([1, 2], [3], [4]))
    w.wait_for_save(MooncakeConnectorMetadata(
        saves=[BlockJob("a", asks, [1, 2], ask_admission=True), BlockJob("p", plain, [3]),
               BlockJob("r", refill, [4], unheld=True)]))
    _wait_idle(w)
    held, unheld = client.admissions  # the step's held saves in one capture, the refill apart
    assert held == ("repeat", set(w.keys(plain)))  # a job that does not ask is always stored
    assert unheld == ("all", set())  # no job of it asks: no set built on vLLM's thread
    assert client.captures[0] == w.keys(asks) + w.keys(plain)


def test_first_sightings_are_marked_in_order_with_no_capture(workers: Any) -> None:
    client = _GatedClient(snapshot=True)
    w = WorkerLogic(_ns("marks"), EXPECTED, _Source(client), can_load=True, can_save=True)
    workers(w)
    w.register_kv_caches(_cache(0))
    first = [f"{b:032x}" for b in (7, 8)]
    w.wait_for_save(MooncakeConnectorMetadata(saves=[BlockJob("s", [f"{9:032x}"], [9])]))
    w.wait_for_save(MooncakeConnectorMetadata(marks=first))
    assert client.captures == [w.keys([f"{9:032x}"])]  # the marks captured nothing
    assert client.marked == []  # behind the save the gate holds
    client.gate.set()
    _wait_idle(w)
    assert client.marked == [w.keys(first)]


def test_finished_only_after_saves_and_only_for_saving_requests(workers: Any) -> None:
    client = _GatedClient()
    w = WorkerLogic(_ns("gate"), EXPECTED, _Source(client), can_load=True, can_save=True)
    workers(w)
    w.register_kv_caches(_cache(0))
    w.wait_for_save(_save_meta("a", [1, 2]))
    assert w.get_finished({"a", "never-saved"})[0] == set()  # save still in flight
    client.gate.set()
    _wait_idle(w)
    assert w.get_finished(set())[0] == {"a"}  # reported once, on a later call
    assert w.get_finished({"a"})[0] == set()
    assert len(client.puts) == 1


def test_snapshot_saves_free_the_blocks_at_once(workers: Any) -> None:
    client = _GatedClient(snapshot=True)
    w = WorkerLogic(_ns("snap"), EXPECTED, _Source(client), can_load=True, can_save=True)
    workers(w)
    w.register_kv_caches(_cache(0))
    w.wait_for_save(_save_meta("s", [1, 2]))
    assert w.get_finished({"s"})[0] == {"s"}  # the put has not even started
    client.gate.set()
    _wait_idle(w)
    assert client.puts == [[f"{w.prefix}/{b:032x}" for b in (1, 2)]]


def _fenced_meta(req_id: str, blocks: list[int], preempted: set[str] | None = None,
                 reported: bool = True) -> MooncakeConnectorMetadata:
    meta = _save_meta(req_id, blocks)
    meta.preempted_req_ids, meta.preemptions_reported = set(preempted or ()), reported
    return meta


@contextlib.contextmanager
def _fenced_worker(tag: str, workers: Any, copy_running: bool) -> Iterator[tuple[WorkerLogic,
                                                                                 _GatedClient]]:
    """A worker over a client whose CUDA snapshot copies are fake fences; saves drained after."""
    client = _GatedClient(snapshot=True, copy_running=copy_running)
    w = WorkerLogic(_ns(tag), EXPECTED, _Source(client), can_load=True, can_save=True)
    workers(w)
    w.register_kv_caches(_cache(0))
    yield w, client
    client.gate.set()
    _wait_idle(w)


def test_cuda_snapshot_copies_are_fenced_only_when_vllm_may_reuse_the_blocks(workers: Any) -> None:
    with _fenced_worker("fence", workers, copy_running=True) as (w, client):
        _fences_ordered_on_free_and_preemption(w, client)


def _fences_ordered_on_free_and_preemption(w: WorkerLogic, client: _GatedClient) -> None:
    w.wait_for_save(_fenced_meta("f", [1, 2]))
    w.wait_for_save(_fenced_meta("g", [3]))
    f, g = client.fences
    assert client.deferred == [True, True] and (f.orders, g.orders) == (0, 0)
    assert w.get_finished(set())[0] == set()  # both still running: nothing ordered
    assert (f.orders, g.orders) == (0, 0)
    assert w.get_finished({"f"})[0] == {"f"}  # f's blocks are freed: vLLM waits for its copy
    assert (f.orders, g.orders) == (1, 0)
    w.handle_preemptions({"g"})  # g's blocks go back to vLLM before this step's forward
    assert g.orders == 1
    w.start_load_kv(_fenced_meta("h", [], preempted={"g"}))  # already ordered: not again
    assert g.orders == 1
    assert w.counters["copy_fences"] == 2 and w.counters["copy_fences_waited"] == 2


def test_a_steps_snapshot_saves_are_one_capture_and_one_put(workers: Any) -> None:
    """Snapshots: one capture per step, whatever the requests (a CUDA capture costs vLLM's
    thread its launches and events per call); the shared copy fences every request."""
    with _fenced_worker("batch", workers, copy_running=True) as (w, client):
        meta = _fenced_meta("a", [1, 2])
        meta.saves.append(BlockJob("b", [f"{3:032x}"], [3]))
        w.wait_for_save(meta)
        assert client.captures == [[f"{w.prefix}/{b:032x}" for b in (1, 2, 3)]]
        (fence,) = client.fences
        assert w.counters["save_jobs"] == 2 and w.counters["copy_fences"] == 1
        assert w.get_finished({"a"})[0] == {"a"} and fence.orders == 1  # the first free orders it
        assert w.get_finished({"b"})[0] == {"b"}  # ordered again: a no-op, not a second wait
        assert w.counters["copy_fences_waited"] == 1
        client.gate.set()
        _wait_idle(w)
        assert client.puts == [[f"{w.prefix}/{b:032x}" for b in (1, 2, 3)]]


def test_a_key_two_requests_of_a_step_computed_is_captured_once(workers: Any) -> None:
    """One prompt twice in a burst: both requests computed its chunks; one copy is put."""
    with _fenced_worker("dup", workers, copy_running=False) as (w, client):
        meta = _fenced_meta("a", [1, 2])
        meta.saves.append(BlockJob("b", [f"{1:032x}", f"{7:032x}"], [5, 7]))  # chunk 1 again
        w.wait_for_save(meta)
        assert client.captures == [[f"{w.prefix}/{d:032x}" for d in (1, 2, 7)]]
        assert client.captured_blocks == [[1, 2, 7]]  # chunk 1 from its first request's block


def test_held_saves_are_captured_per_request(workers: Any) -> None:
    """Checksums of blocks kept until the put: each request's hold ends with its own put."""
    client = _GatedClient(snapshot=False)
    w = WorkerLogic(_ns("per-req"), EXPECTED, _Source(client), can_load=True, can_save=True)
    workers(w)
    w.register_kv_caches(_cache(0))
    meta = _save_meta("a", [1])
    meta.saves.append(BlockJob("b", [f"{2:032x}"], [2]))
    w.wait_for_save(meta)
    assert len(client.captures) == 2
    client.gate.set()
    _wait_idle(w)
    assert w.get_finished({"a", "b"})[0] == {"a", "b"}


def test_without_reported_preemptions_the_copy_is_fenced_at_capture(workers: Any) -> None:
    with _fenced_worker("fence-old", workers, copy_running=True) as (w, client):
        w.wait_for_save(_fenced_meta("o", [1], reported=False))  # vLLM < 0.14: no preempted ids
        assert client.deferred == [False] and client.fences == []
        assert w.counters["copy_fences"] == 0


def test_a_preempted_requests_copy_is_fenced_before_the_next_forward(workers: Any) -> None:
    """Releases that call no ``handle_preemptions`` still start each forward with the loads."""
    with _fenced_worker("fence-pre", workers, copy_running=False) as (w, client):
        w.wait_for_save(_fenced_meta("p", [4]))
        w.start_load_kv(_fenced_meta("q", [], preempted={"p"}))
        assert client.fences[0].orders == 1
        assert w.counters["copy_fences_waited"] == 0  # the copy was done: vLLM did not wait


def test_preemption_cancels_queued_saves_and_waits_bounded(workers: Any) -> None:
    client = _GatedClient()
    w = WorkerLogic(_ns("pre"), EXPECTED, _Source(client), can_load=True, can_save=True,
                    preempt_wait=0.2)
    workers(w)
    w.register_kv_caches(_cache(0))
    w.wait_for_save(_save_meta("p", [3]))
    assert client.started.wait(5)  # taken by the save thread, waits at the gate
    w.wait_for_save(_save_meta("p", [4]))  # queued behind it
    t0 = time.monotonic()
    w.handle_preemptions({"p"})
    assert time.monotonic() - t0 < 1.0  # never the old 30 s drain
    client.gate.set()
    _wait_idle(w)
    assert w.counters["cancelled_jobs"] == 1
    assert client.discarded == [[f"{w.prefix}/{4:032x}"]]  # block 4 was never put


def test_hung_pool_releases_finished_blocks_within_the_deadline(workers: Any) -> None:
    client, clock = _GatedClient(), _Clock()
    w = WorkerLogic(_ns("hung"), EXPECTED, _Source(client), can_load=True, can_save=True,
                    save_deadline=30.0, clock=clock)
    workers(w)
    w.register_kv_caches(_cache(0))
    w.wait_for_save(_save_meta("h", [5]))
    assert w.get_finished({"h"})[0] == set()
    clock.now += 29.0
    assert w.get_finished(set())[0] == set()
    clock.now += 1.5
    assert w.get_finished(set())[0] == {"h"}
    assert w.counters["holds_expired"] == 1
    client.gate.set()


def test_full_queue_drops_saves_instead_of_blocking(workers: Any) -> None:
    client = _GatedClient()
    w = WorkerLogic(_ns("full"), EXPECTED, _Source(client), can_load=True, can_save=True,
                    queue_size=1)
    workers(w)
    w.register_kv_caches(_cache(0))
    t0 = time.monotonic()
    for i in range(5):
        w.wait_for_save(_save_meta(f"r{i}", [i]))
    assert time.monotonic() - t0 < 1.0
    assert w.counters["dropped_jobs"] >= 3
    assert len(client.discarded) == w.counters["dropped_jobs"]
    client.gate.set()


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


def _saved(pool: SharedClient, workers: Any, ns: KeyNamespace, src: dict[str, np.ndarray],
           digests: list[str], blocks: list[int]) -> WorkerLogic:
    """A saving worker that has put ``blocks`` of ``src`` under ``digests`` (request "s")."""
    saver = WorkerLogic(ns, EXPECTED, pool, can_load=False, can_save=True)
    workers(saver)
    saver.register_kv_caches(src)
    saver.wait_for_save(MooncakeConnectorMetadata(saves=[BlockJob("s", digests, blocks)]))
    _wait_idle(saver, 10)
    return saver


def test_round_trip_through_a_real_pool(pool: SharedClient, workers: Any) -> None:
    src, dst = _cache(1), _cache(2)
    before = {name: t.copy() for name, t in dst.items()}
    ns = _ns("rt")
    digests = [f"{i:032x}" for i in range(3)]
    saver = _saved(pool, workers, ns, src, digests, [5, 6, 7])
    assert saver.counters["saved_blocks"] == 3
    assert saver.get_finished({"s"})[0] == {"s"}

    loader = WorkerLogic(ns, EXPECTED, pool, can_load=True, can_save=False)
    workers(loader)
    loader.register_kv_caches(dst)
    missing = f"{99:032x}"
    loader.start_load_kv(MooncakeConnectorMetadata(
        loads=[BlockJob("l", [*digests, missing], [1, 2, 3, 4])]))
    assert loader.take_load_errors() == {4}
    for name in src:
        assert np.array_equal(dst[name][1:4], src[name][5:8])
        # the missing block was left as it was, every other block untouched too
        assert np.array_equal(dst[name][4:], before[name][4:])
        assert np.array_equal(dst[name][0], before[name][0])


def test_a_worker_built_on_its_telemetrys_source_is_metered(pool: SharedClient,
                                                            workers: Any) -> None:
    """The connector builds Telemetry first and hands the worker its metered source."""
    ns = _ns("metered")
    telemetry = Telemetry(pool, SimpleNamespace(), worker=ns)
    saver = WorkerLogic(ns, EXPECTED, telemetry.source, can_load=True, can_save=True)
    telemetry.attach_worker(saver)
    workers(saver)
    saver.register_kv_caches(_cache(3))
    digests = [f"{i:032x}" for i in range(2)]
    saver.wait_for_save(MooncakeConnectorMetadata(saves=[BlockJob("s", digests, [1, 2])]))
    _wait_idle(saver, 10)
    saver.start_load_kv(MooncakeConnectorMetadata(loads=[BlockJob("l", digests, [3, 4])]))
    stats = telemetry.take_stats()
    assert stats is not None and telemetry.meter.who == "tp0-pp0"
    assert stats.data["counters"]["saved_blocks"] == 2
    assert stats.data["counters"]["loaded_blocks"] == 2
    assert set(stats.data["latency"]) == {"save", "load"}


#: a cache whose per-layer block pieces (512 KiB) are saved zero-copy, not coalesced
BIG = (8, 2, 64, 1024)


@contextlib.contextmanager
def _slow_commit(client: Any) -> Iterator[tuple[threading.Event, threading.Event]]:
    """``client``'s puts wait for the gate: ``(started, gate)``."""
    gate, started = threading.Event(), threading.Event()
    real_commit = client.commit_save
    client.commit_save = lambda t: (started.set(), gate.wait(5), real_commit(t))[2]  # slow pool
    try:
        yield started, gate
    finally:
        del client.commit_save


def _load_back(pool: SharedClient, workers: Any, ns: KeyNamespace, expected: ExpectedLayout,
               shape: tuple[int, ...], digests: list[str]) -> tuple[dict[str, np.ndarray], set[int]]:
    """Load ``digests`` into blocks 1.. of a zeroed cache: ``(cache, blocks that failed)``."""
    dst = {f"layer.{i}": np.zeros(shape, dtype=np.float32) for i in range(2)}
    loader = WorkerLogic(ns, expected, pool, can_load=True, can_save=False)
    workers(loader)
    loader.register_kv_caches(dst)
    blocks = list(range(1, len(digests) + 1))
    loader.start_load_kv(MooncakeConnectorMetadata(loads=[BlockJob("l", digests, blocks)]))
    return dst, loader.take_load_errors()


@pytest.mark.parametrize("shape", [BIG, SHAPE], ids=["zero-copy", "snapshot"])
def test_a_block_reused_before_its_save_ran_is_never_served(pool: SharedClient, workers: Any,
                                                             shape: tuple[int, ...]) -> None:
    """Preempted, given up on, blocks reused, then the put runs: never the new bytes.

    Zero-copy: the late put reads the new occupant's bytes, which no longer match
    the checksum taken at capture: refused on load and removed by the writer.
    Snapshot: the put stores the bytes captured right after the forward pass.
    """
    expected = ExpectedLayout("cpu", "", "float32", 2, shape[1:])
    rng = np.random.default_rng(3)
    src = {f"layer.{i}": rng.standard_normal(shape, dtype=np.float32) for i in range(2)}
    original = {name: t[[6, 7]].copy() for name, t in src.items()}
    ns = KeyNamespace(f"worker-test-late-{shape[2]}", "float32", expected.fingerprint, shape[2])
    saver = WorkerLogic(ns, expected, pool, can_load=False, can_save=True, preempt_wait=0.1)
    workers(saver)
    saver.register_kv_caches(src)
    client = pool.get()
    digests = [f"{0xfeed00 + shape[2] + i:032x}" for i in range(2)]
    with _slow_commit(client) as (started, gate):
        saver.wait_for_save(MooncakeConnectorMetadata(saves=[BlockJob("v", digests, [6, 7])]))
        assert started.wait(5)  # the put is under way when the preemption comes
        saver.handle_preemptions({"v"})  # gives up after preempt_wait; vLLM reuses 6 and 7
        for t in src.values():
            t[6:8] = 7.0  # the new occupant's KV
        gate.set()
        _wait_idle(saver, 10)
    dst, errors = _load_back(pool, workers, ns, expected, shape, digests)
    for t in dst.values():
        assert not np.any(t[1:3] == 7.0)  # never the new occupant's bytes
    if shape == BIG:
        assert errors == {1, 2}
        assert not any(client.exists(saver.keys(digests)))  # removed, not left to trip on
        assert client.stats.snapshot()["save_raced"] >= 2
    else:
        assert errors == set()
        for name, t in dst.items():
            assert np.array_equal(t[1:3], original[name])


def test_background_load_is_reported_received_with_failed_blocks(pool: SharedClient,
                                                                 workers: Any) -> None:
    src, dst = _cache(11), _cache(12)
    ns = _ns("bg")
    digests = [f"{0xb6000 + i:032x}" for i in range(3)]
    _saved(pool, workers, ns, src, digests, [2, 3, 4])
    loader = WorkerLogic(ns, EXPECTED, pool, can_load=True, can_save=False)
    workers(loader)
    loader.register_kv_caches(dst)
    missing = f"{0xb6fff:032x}"
    job = BlockJob("r", [*digests, missing], [9, 10, 11, 12], background=True)
    loader.start_load_kv(MooncakeConnectorMetadata(loads=[job]))
    received: set[str] = set()
    deadline = time.monotonic() + 10
    while not received:
        assert time.monotonic() < deadline, "background load never reported"
        freed, received = loader.get_finished(set())
        assert freed == set()
        time.sleep(0.01)
    assert received == {"r"}
    assert loader.take_load_errors() == {12}
    for name in src:
        assert np.array_equal(dst[name][9:12], src[name][2:5])
    assert loader.get_finished(set()) == (set(), set())  # reported once


@contextlib.contextmanager
def _gated_loader(pool: SharedClient, workers: Any, tag: str,
                  seed: int) -> Iterator[tuple[WorkerLogic, threading.Event, threading.Event]]:
    """A loading worker whose background loads start (``started``) and then wait for ``gate``."""
    loader = WorkerLogic(_ns(tag), EXPECTED, pool, can_load=True, can_save=False)
    workers(loader)
    loader.register_kv_caches(_cache(seed))
    client = pool.get()
    gate, started = threading.Event(), threading.Event()
    real_get = client.get_blocks
    client.get_blocks = lambda *a, **k: (started.set(), gate.wait(5), real_get(*a, **k))[2]
    try:
        yield loader, gate, started
    finally:
        del client.get_blocks


def test_aborted_while_loading_is_freed_only_after_the_load(pool: SharedClient,
                                                            workers: Any) -> None:
    with _gated_loader(pool, workers, "abort", 13) as (loader, gate, started):
        job = BlockJob("x", [f"{0xab:032x}"], [3], background=True)
        loader.start_load_kv(MooncakeConnectorMetadata(loads=[job]))
        assert started.wait(5)
        # vLLM aborts it; the scheduler kept its blocks and says so in the next step
        loader.start_load_kv(MooncakeConnectorMetadata(delayed_loads={"x"}))
        assert loader.get_finished({"x"}) == (set(), set())  # the load still writes
        gate.set()
        deadline = time.monotonic() + 10
        freed: set[str] = set()
        while not freed:
            assert time.monotonic() < deadline
            freed, received = loader.get_finished(set())
            assert received == set()  # never "received" for a request vLLM finished
            time.sleep(0.01)
        assert freed == {"x"}


#: MLA's latent cache ``[blocks, 1, block_size, kv_lora_rank + rope]``, one copy per TP rank
MLA_SHAPE = (8, 1, 4, 576)
MLA = ExpectedLayout("hnc", "", "float32", 2, MLA_SHAPE[1:], heads_first=True, mla=True)


def test_mla_tp_ranks_share_keys_rank0_puts_rank1_reads(pool: SharedClient, workers: Any) -> None:
    """TP=2 MLA: both ranks key by one namespace; only rank 0 stores, rank 1 loads it."""
    rng = np.random.default_rng(7)
    src = {f"layer.{i}": rng.standard_normal(MLA_SHAPE, dtype=np.float32) for i in range(2)}
    rank1_src = {name: t.copy() for name, t in src.items()}  # identical KV on rank 1
    ns0, ns1 = (KeyNamespace("worker-test-mla", "float32", MLA.fingerprint, 4, tp_rank=r,
                             tp_size=2, tp_shared=True) for r in (0, 1))
    assert ns0.prefix() == ns1.prefix() and ns0.stores and not ns1.stores
    digests = [f"{i + 500:032x}" for i in range(2)]
    rank0 = WorkerLogic(ns0, MLA, pool, can_load=True, can_save=True)
    rank1 = WorkerLogic(ns1, MLA, pool, can_load=True, can_save=True)
    for w, cache in ((rank0, src), (rank1, rank1_src)):
        workers(w)
        w.register_kv_caches(cache)
        w.wait_for_save(MooncakeConnectorMetadata(saves=[BlockJob("s", digests, [2, 3])]))
        _wait_idle(w, 10)
    assert rank0.counters["saved_blocks"] == 2
    assert rank1.counters["save_jobs"] == rank1.counters["saved_blocks"] == 0  # never puts
    assert rank1.get_finished({"s"})[0] == {"s"}  # ... yet frees the blocks like rank 0
    assert rank0.get_finished({"s"})[0] == {"s"}

    dst = {name: np.zeros(MLA_SHAPE, dtype=np.float32) for name in src}
    reader = WorkerLogic(ns1, MLA, pool, can_load=True, can_save=False)
    workers(reader)
    reader.register_kv_caches(dst)
    reader.start_load_kv(MooncakeConnectorMetadata(loads=[BlockJob("l", digests, [5, 6])]))
    assert reader.take_load_errors() == set()
    for name in src:
        assert np.array_equal(dst[name][5:7], src[name][2:4])


def test_an_idle_step_waits_briefly_for_a_running_load_and_a_busy_one_never(
        pool: SharedClient, workers: Any) -> None:
    """A step that scheduled nothing blocks in get_finished (at most IDLE_STEP_WAIT) so the
    loader thread gets the GIL; a step with work never waits there."""
    from mooncake_vllm.v1.worker import IDLE_STEP_WAIT

    with _gated_loader(pool, workers, "idle", 14) as (loader, gate, started):
        loader.start_load_kv(MooncakeConnectorMetadata(
            loads=[BlockJob("w", [f"{0xac:032x}"], [3], background=True)]))
        assert started.wait(5)
        waits: list[float] = []
        real_wait_for = loader._cond.wait_for
        loader._cond.wait_for = lambda pred, timeout=None: (waits.append(timeout),
                                                            real_wait_for(pred, timeout))[1]
        assert loader.get_finished(set()) == (set(), set())  # a busy step: no wait
        assert waits == []
        loader.start_load_kv(MooncakeConnectorMetadata(idle_step=True))
        t0 = time.monotonic()
        assert loader.get_finished(set()) == (set(), set())  # idle: waited, load still gated
        assert waits == [IDLE_STEP_WAIT] and time.monotonic() - t0 >= IDLE_STEP_WAIT * 0.9
        # the load ends during an idle step's wait: reported by that very step
        threading.Timer(0.001, gate.set).start()
        deadline = time.monotonic() + 10
        received: set[str] = set()
        while not received:
            assert time.monotonic() < deadline
            _, received = loader.get_finished(set())
        assert received == {"w"}


def test_a_step_is_timed_from_binding_its_metadata_not_from_start_load_kv(workers: Any) -> None:
    """vLLM >= 0.32 calls start_load_kv after launching the forward (no synchronous loads):
    timing from it measured ~50 us steps on the CPU engine, and the claim policy then found
    recomputing free. The step runs between binding the metadata and wait_for_save."""
    client = _GatedClient()
    w = WorkerLogic(_ns("timer"), EXPECTED, _Source(client), can_load=True, can_save=True)
    workers(w)
    w.register_kv_caches(_cache(0))
    meta = MooncakeConnectorMetadata(step_work=(512.0, 131072.0, 512.0))
    w.step_bound(meta)
    time.sleep(0.05)  # the forward pass
    w.start_load_kv(meta)  # after the forward, as vLLM 0.32 does
    w.wait_for_save(meta)
    perf = w.timer.take()
    assert perf is not None and len(perf["steps"]) == 1
    tokens, work, reach, seconds = perf["steps"][0]
    assert (tokens, work, reach) == (512.0, 131072.0, 512.0) and seconds >= 0.045


def _probe_samples(w: WorkerLogic, timeout: float = 10.0) -> list[list[float]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        taken = w.timer.take()
        if taken and taken["loads"]:
            return taken["loads"]
        time.sleep(0.05)
    return []


def test_a_host_kv_worker_never_probes_the_pool(pool: SharedClient, workers: Any) -> None:
    w = WorkerLogic(_ns("probe-host"), EXPECTED, pool, can_load=True, can_save=False,
                    load_probe=True)
    workers(w)
    w.register_kv_caches(_cache(3))
    w.start_load_kv(MooncakeConnectorMetadata(probe_loads=True))  # nor when the scheduler asks
    assert _probe_samples(w, timeout=1.0) == []  # its first real loads measure the pool


class _ProbeClient:
    """``probe_loads`` that blocks until released, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()

    def probe_loads(self, layout: Any) -> list[tuple[int, float]]:
        self.calls += 1
        self.release.wait(10)
        return [(16, 0.02)]


def test_the_scheduler_asks_a_probing_worker_for_one_probe_at_a_time() -> None:
    """While the claim policy declines, the scheduler asks for a background probe
    (``metadata.probe_loads``): a worker that probes runs one (never two at once), reports
    its loads and that it probes; one that does not probe ignores the ask."""
    client = _ProbeClient()
    w = WorkerLogic(_ns("probe-ask"), EXPECTED, _Source(client), can_load=True, can_save=False,
                    load_probe=True)
    w.layout = SimpleNamespace()  # type: ignore[assignment]  (what register_kv_caches sets)
    ask = MooncakeConnectorMetadata(probe_loads=True)
    w.start_load_kv(ask)
    assert client.calls == 0  # the timer says this worker does not probe (host KV)
    w.timer.probes = True  # as register_kv_caches sets it for CUDA KV with the probe on
    w.start_load_kv(ask)
    w.start_load_kv(ask)  # asked again while it runs
    client.release.set()
    samples = _probe_samples(w, timeout=5.0)
    assert client.calls == 1 and samples == [[16.0 * SHAPE[2], 0.02]]
    w.timer.load_done(16, 0.01)
    assert w.timer.take() == {"steps": [], "loads": [[16.0, 0.01]], "probes": True}
    w.start_load_kv(ask)  # the first one is over: another may run
    deadline = time.monotonic() + 5
    while client.calls < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.calls == 2
    time.sleep(0.1)  # that one is over too
    w._loading["r"] = 1  # a background load of ours in flight: its slots are not competed for
    w.start_load_kv(ask)
    w._loading.clear()
    w.start_load_kv(MooncakeConnectorMetadata(probe_loads=True, loads=[BlockJob("s", ["d"], [0])]))
    assert w.take_load_errors() == {0}  # (this fake client loads nothing)
    time.sleep(0.1)
    assert client.calls == 2


@pytest.mark.gpu
def test_a_cuda_kv_worker_seeds_the_load_model_with_a_probe(pool: SharedClient,
                                                            workers: Any) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    caches = {name: torch.from_numpy(t).cuda() for name, t in _cache(4).items()}
    before = {name: t.clone() for name, t in caches.items()}
    for load_probe, tag in ((False, "probe-off"), (True, "probe-on")):
        w = WorkerLogic(_ns(tag), EXPECTED, pool, can_load=True, can_save=False,
                        load_probe=load_probe)
        workers(w)
        w.register_kv_caches(caches)
        samples = _probe_samples(w, timeout=10.0 if load_probe else 1.0)
        if not load_probe:
            assert samples == []
            continue
        assert [int(t) for t, _ in samples] == [n * SHAPE[2] for n in (16, 32, 64)]
        assert all(s > 0 for _, s in samples)
        w.start_load_kv(MooncakeConnectorMetadata(probe_loads=True))  # asked while declining
        assert [int(t) for t, _ in _probe_samples(w)] == [n * SHAPE[2] for n in (16, 32, 64)]
    torch.cuda.synchronize()
    for name, t in caches.items():  # the probe never wrote into the KV cache
        assert torch.equal(t, before[name])


def test_a_refill_from_vllms_prefix_cache_is_fenced_at_capture_and_holds_nothing(
        workers: Any) -> None:
    """Blocks no request holds (:mod:`~mooncake_vllm.v1.refill`): vLLM may reuse them from the
    next step on, so the copy is ordered at capture and nothing waits for a free."""
    with _fenced_worker("refill", workers, copy_running=True) as (w, client):
        meta = _fenced_meta("r", [1])
        meta.saves.append(BlockJob("mcv-refill-1", [f"{9:032x}"], [9], unheld=True))
        w.wait_for_save(meta)
        assert client.deferred == [True, False] and len(client.fences) == 1
        client.gate.set()
        _wait_idle(w)
        assert w.get_finished({"r"})[0] == {"r"}
        assert "mcv-refill-1" not in w._tracked  # vLLM never reports it finished: no leak


@pytest.mark.parametrize("shape", [BIG, SHAPE], ids=["zero-copy", "snapshot"])
def test_a_refilled_block_vllm_reuses_before_its_put_is_never_served(
        pool: SharedClient, workers: Any, shape: tuple[int, ...]) -> None:
    """A refill reads a block of vLLM's prefix cache that nobody holds; vLLM gives it to a
    new request while the put waits: the pool never serves the new occupant's bytes."""
    expected = ExpectedLayout("cpu", "", "float32", 2, shape[1:])
    rng = np.random.default_rng(4)
    src = {f"layer.{i}": rng.standard_normal(shape, dtype=np.float32) for i in range(2)}
    original = {name: t[[3]].copy() for name, t in src.items()}
    ns = KeyNamespace(f"worker-test-refill-{shape[2]}", "float32", expected.fingerprint, shape[2])
    saver = WorkerLogic(ns, expected, pool, can_load=False, can_save=True)
    workers(saver)
    saver.register_kv_caches(src)
    digests = [f"{0xbeef00 + shape[2]:032x}"]
    with _slow_commit(pool.get()) as (started, gate):
        meta = MooncakeConnectorMetadata(saves=[BlockJob("mcv-refill-1", digests, [3],
                                                         unheld=True)])
        meta.preemptions_reported = True
        saver.wait_for_save(meta)
        assert started.wait(5)
        for t in src.values():
            t[3] = 5.0  # the next step gave block 3 to a new request
        gate.set()
        _wait_idle(saver, 10)
    dst, errors = _load_back(pool, workers, ns, expected, shape, digests)
    for name, t in dst.items():
        assert not np.any(t[1] == 5.0)  # never the new occupant's bytes
        if not errors:
            assert np.array_equal(t[1:2], original[name])
    assert errors == ({1} if shape == BIG else set())
