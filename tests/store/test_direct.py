"""Zero-copy loads (store/direct.py): straight into the KV blocks, verified in place.

Host KV runs here (real master + holders on loopback): a background load is
byte-exact without a staging slot, a value whose header or checksum is wrong is a
failed block (counted, recomputed by vLLM), and a get past its deadline is waited
for before the load reports (it may still write into the blocks). The CUDA data
path needs a GPU and a CUDA build of Mooncake (marked ``gpu``, skipped cleanly
elsewhere; the cross-path byte-exactness and refusal tests on every layout are in
``test_block_paths.py``).
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
import torch

from mooncake_vllm import codec
from mooncake_vllm.config import load_store_config
from mooncake_vllm.keys import KeyNamespace, chunk_keys
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.store import StoreClient, direct
from mooncake_vllm.store.direct import batch_size, get_direct
from mooncake_vllm.store.misses import miss_counts
from mooncake_vllm.store.slots import slots_of

_seed = itertools.count(300)


@pytest.fixture
def client(module_local_stack: Any) -> Any:
    c = StoreClient.connect(load_store_config(module_local_stack.config_path))
    yield c
    c.close()


def _keys(layout: BlockLayout, n: int) -> list[str]:
    base = 1_000_000 * next(_seed)
    return chunk_keys(KeyNamespace("direct", str(layout.dtype), layout.fingerprint,
                                   layout.block_size), list(range(base, base + layout.block_size * n)))


def _host_kv(seed: int, blocks: int = 12, layers: int = 3) -> list[np.ndarray]:
    """vLLM's CPU layout ``[blocks, kv_heads, block_size, 2*head]``: one segment per layer."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((blocks, 2, 16, 64), dtype=np.float32) for _ in range(layers)]


def test_gets_cut_a_load_into_pieces_per_lane_of_a_least_size() -> None:
    mib = 1 << 20
    # 4 per lane, at least 8 MiB (3 blocks of 3 MiB)
    assert [batch_size(n, lanes, 3 * mib) for n, lanes in ((1, 1), (62, 1), (62, 4), (9, 1))] == [
        3, 16, 4, 3]
    assert batch_size(10_000, 1, 64 << 10) == 256  # MAX_BATCH keys per Mooncake call


def test_host_background_loads_go_straight_into_the_blocks(client: Any) -> None:
    """Byte-exact into other blocks, untouched blocks untouched, and no staging slot used:
    with every load slot taken a staged load delivers nothing (the code before this path)."""
    kv = _host_kv(next(_seed))
    layout = BlockLayout.from_kv_caches(kv)
    client.register_layout(layout)
    paths = client._paths_for(layout)
    assert paths.direct_loads
    keys = _keys(layout, 4)
    assert client.put_blocks(keys, layout, [0, 1, 2, 3]) == 4
    before = [t.copy() for t in kv]
    held = paths.load_pool.take(paths.load_pool.count)
    try:
        assert client.get_blocks(keys, layout, [8, 11, 9, 10], background=True) == [True] * 4
        assert client.get_blocks(keys, layout, [4, 5, 6, 7]) == [False] * 4  # staged: no slot
    finally:
        paths.load_pool.release(held)
    for t, old in zip(kv, before):
        for src, dst in ((0, 8), (1, 11), (2, 9), (3, 10)):
            assert np.array_equal(t[dst], old[src])
        assert np.array_equal(t[:8], old[:8])
    assert client.stats.snapshot()["bytes_got"] >= 4 * layout.block_nbytes


def test_a_value_failing_its_checks_is_a_failed_block(client: Any) -> None:
    """A wrong checksum (bytes put under a key with another block's header checksum), a
    flipped payload byte, a truncated and a foreign value each fail; the good ones and a
    value framed with wsum64 (as CUDA KV frames) load. Failed blocks are counted as
    corrupt misses, and vLLM recomputes them."""
    kv = _host_kv(next(_seed))
    layout = BlockLayout.from_kv_caches(kv)
    client.register_layout(layout)
    keys = _keys(layout, 7)
    assert client.put_blocks(keys[:2], layout, [0, 1]) == 2
    store = client.store
    raw = bytes(store.get(keys[0]))
    payload = raw[codec.HEADER_SIZE:]
    digest = codec.digest16(layout.fingerprint)

    def framed(key: str, checksum: int, kind: int = codec.XXH3, body: bytes = payload) -> bytes:
        return codec.pack_header(len(payload), checksum, digest, codec.digest16(key), kind) + body

    wrong = codec.checksum_bytes(bytes(store.get(keys[1]))[codec.HEADER_SIZE:])
    flipped = payload[:999] + bytes([payload[999] ^ 0x10]) + payload[1000:]
    good = codec.checksum_bytes(payload)
    planted = {keys[2]: framed(keys[2], wrong),  # a wrong checksum
               keys[3]: framed(keys[3], good, body=flipped),  # a flipped byte
               keys[4]: framed(keys[4], good)[:-8],  # truncated
               keys[5]: raw,  # another key's value
               keys[6]: framed(keys[6], codec.checksum_bytes(payload, codec.WSUM64), codec.WSUM64)}
    for key, value in planted.items():
        assert store.put(key, value) == 0
    before = client.stats.snapshot()
    ok = client.get_blocks(keys, layout, [4, 5, 6, 7, 8, 9, 10], background=True)
    assert ok == [True, True, False, False, False, False, True]
    stats = client.stats.snapshot()
    # the truncated value may come back as an error code of the multi-buffer get (``errors``)
    assert stats["corrupt"] + stats.get("errors", 0) - before["corrupt"] - before.get(
        "errors", 0) >= 4
    assert miss_counts(stats).get("corrupt", 0) - miss_counts(before).get("corrupt", 0) >= 3
    for t in kv:
        assert np.array_equal(t[4], t[0]) and np.array_equal(t[5], t[1])
        assert np.array_equal(t[10], t[0])  # the wsum64 value holds block 0's bytes


def test_an_open_breaker_loads_nothing_and_waits_for_nothing(client: Any) -> None:
    kv = [np.random.default_rng(next(_seed)).standard_normal((8, 2, 16, 64), dtype=np.float32)]
    layout = BlockLayout.from_kv_caches(kv)
    client.register_layout(layout)
    keys = _keys(layout, 3)
    assert client.put_blocks(keys, layout, [0, 1, 2]) == 3
    before = kv[0].copy()
    client.transport.health.failed("test: pool away")
    assert get_direct(client.transport, client._paths_for(layout), keys, [4, 5, 6], None) == [
        False] * 3
    assert np.array_equal(kv[0], before)
    assert client.stats.snapshot()["blocks_got"] == 0


@pytest.mark.gpu
def test_zero_copy_loads_are_byte_exact_into_other_blocks(client: Any) -> None:
    gen = torch.Generator().manual_seed(next(_seed))
    kv = [torch.randn((2, 12, 16, 2, 64), generator=gen).to("cuda") for _ in range(2)]
    layout = BlockLayout.from_kv_caches(kv)
    client.register_layout(layout, "zero_copy")
    if client.gpu_path(layout) != "zero_copy":
        pytest.skip("this Mooncake build cannot read GPU memory (no CUDA build)")
    keys = _keys(layout, 4)
    assert client.put_blocks(keys, layout, [0, 1, 2, 3]) == 4
    before = [t.clone() for t in kv]
    assert client.get_blocks(keys, layout, [8, 9, 10, 11], background=True) == [True] * 4
    torch.cuda.synchronize()
    for t, old in zip(kv, before):
        assert torch.equal(t[:, 8:12], old[:, 0:4]) and torch.equal(t[:, 4:8], old[:, 4:8])


def test_a_get_past_its_deadline_is_waited_for_then_direct_loads_stop(
        local_stack: Any, monkeypatch: Any) -> None:
    """A holder SIGSTOPped mid-load: the get passes its deadline but may still write into
    the blocks, so the load waits LATE_WAIT more for Mooncake to return before it reports;
    one that has not returned by then switches direct loads off (loads go through staging
    slots). The holder is then killed, which ends the abandoned get."""
    monkeypatch.setattr(direct, "LATE_WAIT", 1.5)
    c = StoreClient.connect(load_store_config(local_stack.config_path), timeout=5)
    try:
        kv = _host_kv(next(_seed), blocks=64, layers=2)
        layout = BlockLayout.from_kv_caches(kv)
        c.register_layout(layout)
        paths = c._paths_for(layout)
        keys = _keys(layout, 32)
        assert c.put_blocks(keys, layout, list(range(32))) == 32
        c.transport.op_timeout = 1.0
        deadline = c.transport.transfer_timeout(32 * paths.slot_nbytes)
        holder = local_stack.holders[0]
        os.kill(holder.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            got = c.get_blocks(keys, layout, list(range(32, 64)), background=True)
            took = time.monotonic() - start
        finally:  # a dead holder's connection fails the abandoned get at once (a resumed
            os.kill(holder.pid, signal.SIGKILL)  # one returns it only up to ~60 s later)
        assert not all(got)
        assert miss_counts(c.stats.snapshot()).get("load_timeout", 0) > 0
        assert took >= deadline + 1.5 - 0.1, (took, deadline)
        assert not paths.direct_loads
        until = time.monotonic() + 60  # close() with a call in flight may crash Mooncake
        while len(slots_of(held := paths.header_pool.take(paths.header_pool.count))) < (
                paths.header_pool.count) and time.monotonic() < until:
            paths.header_pool.release(held)
            time.sleep(0.2)
    finally:
        c.close()
