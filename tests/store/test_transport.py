"""Lanes: several Mooncake store clients in one process, transfers striped over them.

Real master + several holders on loopback; the same data tests run on CUDA tensors
(marked ``gpu``). The lane-assignment test uses a recording stand-in for Mooncake:
pure logic (which keys go to which client), never the only test of striping.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mooncake_vllm.config import load_store_config
from mooncake_vllm.keys import KeyNamespace, chunk_keys
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.services import LocalStack
from mooncake_vllm.store import StoreClient
from mooncake_vllm.store.fetch import MIN_FETCH, fetch_size

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
_count = itertools.count()


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with LocalStack(tmp_path_factory.mktemp("lanes"), segment_size=256 << 20,
                    local_buffer_size=32 << 20, holders=3) as stack:
        yield stack


def _kv(device: str, blocks: int = 48) -> tuple[list[torch.Tensor], BlockLayout]:
    gen = torch.Generator().manual_seed(next(_count))
    kv = [torch.randn((2, blocks, 16, 2, 64), generator=gen).to(device) for _ in range(2)]
    return kv, BlockLayout.from_kv_caches(kv)


def _keys(layout: BlockLayout, n: int) -> list[str]:
    base = 1_000_000 * next(_count)
    return chunk_keys(KeyNamespace("lanes", "float32", layout.fingerprint, 16),
                      list(range(base, base + 16 * n)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clients", [1, 3])
def test_striped_saves_and_loads_are_byte_exact_across_holders(pool: LocalStack, device: str,
                                                                clients: int) -> None:
    client = StoreClient.connect(load_store_config(pool.config_path))
    try:
        kv, layout = _kv(device)
        client.register_layout(layout, clients=clients)
        assert client.lanes == clients
        keys = _keys(layout, 40)
        assert client.put_blocks(keys, layout, list(range(40))) == 40
        before = [t.clone() for t in kv]
        for t in kv:
            t[:, 40:48].zero_()
        # blocks 0..7 get keys 32..39 (other physical blocks); 40..47 get keys 0..7
        assert client.get_blocks(keys[32:40] + keys[:8], layout,
                                 list(range(8)) + list(range(40, 48))) == [True] * 16
        for t, ref in zip(kv, before):
            assert torch.equal(t[:, 0:8], ref[:, 32:40])
            assert torch.equal(t[:, 40:48], ref[:, 0:8])
            assert torch.equal(t[:, 8:40], ref[:, 8:40])  # untouched blocks untouched
        where = {client.store.get_replica_desc(k)[0].get_memory_descriptor()
                 .buffer_descriptor.transport_endpoint for k in keys}
        assert len(where) == 3, where  # the master spread the values over every holder
        stats = client.stats.snapshot()
        assert stats["blocks_put"] == 40 and stats["blocks_got"] == 16
        assert stats.get("timeouts", 0) == stats.get("corrupt", 0) == 0
    finally:
        client.close()


def test_a_lane_that_cannot_open_leaves_fewer_lanes_with_one_warning(
        pool: LocalStack, caplog: pytest.LogCaptureFixture) -> None:
    from mooncake.store import MooncakeDistributedStore

    made = []

    def factory() -> Any:
        made.append(1)
        if len(made) == 3:
            raise OSError("no more transfer engines")
        return MooncakeDistributedStore()

    caplog.set_level(logging.WARNING, logger="mooncake_vllm")
    client = StoreClient.connect(load_store_config(pool.config_path), store_factory=factory)
    try:
        kv, layout = _kv("cpu", blocks=8)
        client.register_layout(layout, clients=4)
        assert client.lanes == 2
        lines = [r.getMessage() for r in caplog.records if "store clients" in r.getMessage()]
        assert len(lines) == 1 and "opened 2 of 4" in lines[0], lines
        keys = _keys(layout, 4)
        assert client.put_blocks(keys, layout, [0, 1, 2, 3]) == 4
        assert client.get_blocks(keys, layout, [4, 5, 6, 7]) == [True] * 4
    finally:
        client.close()


def test_a_dead_holder_costs_only_its_share(tmp_path: Path) -> None:
    with LocalStack(tmp_path, segment_size=96 << 20, local_buffer_size=16 << 20, holders=2,
                    client_ttl=2) as stack:
        client = StoreClient.connect(load_store_config(stack.config_path))
        try:
            kv, layout = _kv("cpu", blocks=40)
            client.register_layout(layout, clients=2)
            keys = _keys(layout, 20)
            assert client.put_blocks(keys, layout, list(range(20))) == 20
            where = [client.store.get_replica_desc(k)[0].get_memory_descriptor()
                     .buffer_descriptor.transport_endpoint for k in keys]
            assert len(set(where)) == 2, where
            stack.holders[1].kill()
            got = client.get_blocks(keys, layout, list(range(20, 40)))
            # all of one holder's blocks load, none of the dead one's
            by_holder = {w: {ok for ok, w2 in zip(got, where) if w2 == w} for w in set(where)}
            assert sorted(map(sorted, by_holder.values())) == [[False], [True]], by_holder
        finally:
            client.close()


class _Recorder:
    """Stands in for one Mooncake client: records the keys each lane was asked for."""

    def __init__(self, name: str, calls: list[tuple[str, int]]) -> None:
        self.name, self.calls = name, calls

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        self.calls.append((self.name, len(keys)))
        return [-704] * len(keys)  # OBJECT_NOT_FOUND: nothing is scattered


def test_fetches_alternate_over_lanes_with_two_in_flight_each() -> None:
    from mooncake_vllm.store.fetch import get_staged
    from mooncake_vllm.store.transport import Lane

    calls: list[tuple[str, int]] = []

    class Paths:
        class load_pool:  # noqa: N801 - shaped like SlotPool
            count = 512

            @staticmethod
            def take(n: int) -> list[tuple[int, int]]:
                return [(0, n)]

            @staticmethod
            def release(runs: Any, after: Any = None) -> None:
                return None

            @staticmethod
            def address(slot: int) -> int:
                return slot

        slot_nbytes = 64

    class FakeTransport:  # only the names fetch.py reads
        lookup_timeout, lanes = 1.0, [Lane(_Recorder(f"lane{i}", calls), i) for i in range(3)]

        class stats:  # noqa: N801
            @staticmethod
            def add(*a: Any) -> None: ...

            @staticmethod
            def observe(*a: Any) -> None: ...

        class holders:  # noqa: N801 - no holder suspended
            @staticmethod
            def usable(keys: Any) -> int:
                return len(keys)

        class failures:  # noqa: N801
            @staticmethod
            def warn(*a: Any) -> bool:
                return False

        config = SimpleNamespace(master_server_address="127.0.0.1:1")

        @staticmethod
        def admits() -> bool:
            return True

        @staticmethod
        def transfer_timeout(n: int) -> float:
            return 5.0

        @staticmethod
        def note_failures(*a: Any) -> list[int]:
            return []

    t = FakeTransport()
    n = 240
    assert get_staged(t, Paths, [f"k{i}" for i in range(n)], list(range(n)), None, False) \
        == [False] * n
    step = fetch_size(n, 512, 3)
    assert step == max(MIN_FETCH, -(-n // 12))
    assert sum(c for _, c in calls) == n
    assert [name for name, _ in calls[:3]] == ["lane0", "lane1", "lane2"] or \
        sorted(name for name, _ in calls[:3]) == ["lane0", "lane1", "lane2"]
    per_lane = {name: sum(c for nm, c in calls if nm == name) for name in ("lane0", "lane1", "lane2")}
    assert max(per_lane.values()) - min(per_lane.values()) <= step
    for lane in t.lanes:
        lane.close()


def test_a_late_marker_poll_opens_no_breaker_but_a_late_lookup_does() -> None:
    """Pure logic over a stand-in store whose calls hang: the hand-off waiter asks again, so
    its lateness is no outage (the lookup right after the wait must not find the pool shut)."""
    import threading as _threading

    from mooncake_vllm.config import load_store_config as _load

    release = _threading.Event()

    class Hanging:
        def batch_is_exist(self, keys: list[str]) -> list[int]:
            release.wait(5)
            return [0] * len(keys)

        def close(self) -> None:
            release.set()

    config = _load({"metadata_server": "P2PHANDSHAKE", "master_server_address": "127.0.0.1:1",
                    "global_segment_size": "0", "local_buffer_size": "16MB", "protocol": "tcp"})
    client = StoreClient(Hanging(), config, lookup_timeout=0.2)
    try:
        assert client.take_markers(["mcv/x/handoff/1"]) == [None]
        assert client.stats.snapshot()["timeouts"] == 1 and client.healthy
        release.set()
        release.clear()
        assert client.exists(["k"]) == [False]  # waits on the same hung call's box
        assert not client.healthy  # a lookup past its box is an outage
    finally:
        release.set()
        client.close()


def test_close_never_closes_a_store_client_under_a_call_still_running_in_it() -> None:
    """CI, vllm 0.8.5 contract env: a connector closed while its namespace registration's put
    still ran in the store client segfaulted the process. A call that returns within the
    close's deadline is waited for; one that does not leaves the client unclosed."""
    import threading
    import time

    from mooncake_vllm.store.transport import Transport

    class Store:
        def __init__(self) -> None:
            self.release = threading.Event()
            self.closed_while_busy: list[bool] = []
            self.busy = False

        def put(self, key: str, value: bytes) -> int:
            self.busy = True
            self.release.wait(5)
            self.busy = False
            return 0

        def close(self) -> int:
            self.closed_while_busy.append(self.busy)
            return 0

    config: Any = SimpleNamespace(master_server_address="127.0.0.1:1", ssd_offload=False)
    for returns_in_time in (True, False):
        store = Store()
        t = Transport(store, config, op_timeout=0.3)
        worker = threading.Thread(target=t.run, args=(t.control, 5.0, store.put, "k", b"v"))
        worker.start()
        while not store.busy:
            time.sleep(0.005)
        if returns_in_time:
            threading.Timer(0.1, store.release.set).start()
        t.close()
        assert store.closed_while_busy == ([False] if returns_in_time else [])
        store.release.set()
        worker.join(5)
