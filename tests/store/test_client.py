"""StoreClient against a REAL master + metadata + holder (mooncake_client) on loopback."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mooncake_vllm import codec
from mooncake_vllm.config import load_store_config
from mooncake_vllm.keys import KeyNamespace, chunk_keys
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.services import LocalStack
from mooncake_vllm.store import StoreClient

WRITER = """
import sys, numpy as np
from mooncake_vllm.config import load_store_config
from mooncake_vllm.keys import KeyNamespace, chunk_keys
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.store import StoreClient
client = StoreClient.connect(load_store_config(sys.argv[1]))
kv = [np.random.default_rng(7 + i).standard_normal((16, 2, 32, 64), dtype=np.float32) for i in range(2)]
layout = BlockLayout.from_kv_caches(kv)
client.register_layout(layout)
keys = chunk_keys(KeyNamespace("m", "float32", layout.fingerprint, 32), list(range(160)))
print(client.put_blocks(keys, layout, [3, 4, 5, 6, 7]))
np.save(sys.argv[2], np.stack([t[3:8] for t in kv]))
client.close()
"""


def _layout(blocks: int = 16) -> tuple[list[np.ndarray], BlockLayout]:
    kv = [np.zeros((blocks, 2, 32, 64), dtype=np.float32) for _ in range(2)]
    return kv, BlockLayout.from_kv_caches(kv)


@pytest.fixture
def client(module_local_stack: LocalStack):  # noqa: ANN201
    c = StoreClient.connect(load_store_config(module_local_stack.config_path))
    yield c
    c.close()


def _keys(layout: BlockLayout, tokens: list[int], model: str = "m") -> list[str]:
    return chunk_keys(KeyNamespace(model, "float32", layout.fingerprint, 32), tokens)


def test_blocks_put_by_one_process_read_bit_exact_by_another(
        module_local_stack: LocalStack, client: StoreClient, tmp_path: Path) -> None:
    ref = tmp_path / "ref.npy"
    out = subprocess.run([sys.executable, "-c", WRITER, str(module_local_stack.config_path), str(ref)],
                         env=module_local_stack.env() | {"PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "5"
    kv, layout = _layout()
    client.register_layout(layout)
    keys = _keys(layout, list(range(160)))
    assert client.longest_prefix(keys) == 5
    assert client.longest_prefix(keys + _keys(layout, list(range(1, 33)))) == 5
    assert client.get_blocks(keys, layout, [9, 10, 11, 12, 13]) == [True] * 5
    assert np.array_equal(np.stack([t[9:14] for t in kv]), np.load(ref))
    stats = client.stats.snapshot()
    assert stats["blocks_got"] == 5 and stats["bytes_got"] == 5 * layout.block_nbytes


def test_put_never_overwrites_and_skips_existing(client: StoreClient) -> None:
    kv, layout = _layout()
    client.register_layout(layout)
    keys = _keys(layout, list(range(500, 564)))
    kv[0][0] = 1.0
    assert client.put_blocks(keys[:1], layout, [0]) == 1
    kv[0][0] = 2.0
    assert client.put_blocks(keys[:1], layout, [0]) == 0
    assert client.stats.snapshot()["skipped_existing"] == 1
    assert client.get_blocks(keys[:1], layout, [1]) == [True]
    assert float(kv[0][1].max()) == 1.0


def test_corrupt_truncated_and_foreign_values_are_misses(client: StoreClient) -> None:
    kv, layout = _layout()
    client.register_layout(layout)
    kv[1][2] = 3.5
    keys = _keys(layout, list(range(900, 900 + 32 * 4)))
    assert client.put_blocks(keys, layout, [2, 2, 2, 2]) == 4
    raw = client.store.get(keys[0])
    assert len(raw) == codec.HEADER_SIZE + layout.block_nbytes
    store = client.store
    # same key, valid header, one payload bit flipped
    assert store.upsert(keys[1], raw[:200] + bytes([raw[200] ^ 1]) + raw[201:]) == 0
    # same key, truncated
    assert store.upsert(keys[2], raw[: len(raw) // 2]) == 0
    # the right bytes for another key
    assert store.upsert(keys[3], raw) == 0
    kv[1][5] = -1.0
    assert client.get_blocks(keys, layout, [5, 5, 5, 5])[1:] == [False, False, False]
    assert client.stats.snapshot()["corrupt"] >= 2
    # a value of another layout (different fingerprint) under its own namespace is a miss
    other_kv = [np.zeros((16, 4, 32, 32), dtype=np.float32) for _ in range(2)]
    other = BlockLayout.from_kv_caches(other_kv, kind="cpu", variant="amx")
    client.register_layout(other)
    foreign_key = _keys(other, list(range(900, 932)))[0]
    assert store.upsert(foreign_key, raw) == 0
    assert client.get_blocks([foreign_key], other, [0]) == [False]


def test_small_values_round_trip_and_detect_damage(client: StoreClient) -> None:
    assert client.put_value("mcv-test/value", b"tail bytes")
    assert client.get_value("mcv-test/value") == b"tail bytes"
    assert client.get_value("mcv-test/absent") is None
    raw = client.store.get("mcv-test/value")
    client.store.upsert("mcv-test/value", raw[:-1] + b"X")
    assert client.get_value("mcv-test/value") is None


def test_an_audits_query_never_waits_for_the_worker_of_vllms_lookups(client: StoreClient) -> None:
    """The scheduler's audits ask from their own thread on their own time box: a lookup of
    vLLM's thread that holds the lookup box's one worker does not hold them (nor they it)."""
    assert client.put_value("mcv-test/audited", b"x")
    release = threading.Event()
    busy = client.transport.lookups.submit(release.wait, 5.0)  # the lookup worker, taken
    try:
        started = time.monotonic()
        assert client.audit_exists(["mcv-test/audited", "mcv-test/never"]) == [True, False]
        assert time.monotonic() - started < 0.9  # under the lookup box's 1 s wait for a worker
    finally:
        release.set()
        client.transport.lookups.result(busy, 5.0)
    assert client.exists(["mcv-test/audited"]) == [True]
    client.transport.admits = lambda: False  # type: ignore[method-assign] - the pool away
    assert client.audit_exists(["mcv-test/audited"]) is None  # unknown, not lost
    assert client.exists(["mcv-test/audited"]) == [False]  # a lookup's miss


def test_prometheus_rendering(client: StoreClient) -> None:
    client.exists(["a", "b"])
    text = client.stats.render_prometheus()
    assert "mooncake_vllm_store_lookups_total 1" in text
    assert 'mooncake_vllm_store_latency_seconds_count{op="exists"} 1' in text


def test_master_killed_mid_run_serves_misses_without_stalls(local_stack: LocalStack) -> None:
    client = StoreClient.connect(load_store_config(local_stack.config_path))
    kv, layout = _layout()
    client.register_layout(layout)
    keys = _keys(layout, list(range(3000, 3000 + 32 * 3)))
    assert client.put_blocks(keys, layout, [1, 2, 3]) == 3
    local_stack.master.kill()
    timings = []
    for _ in range(5):
        t0 = time.monotonic()
        assert client.longest_prefix(keys) == 0
        assert client.get_blocks(keys, layout, [4, 5, 6]) == [False] * 3
        timings.append(time.monotonic() - t0)
    assert max(timings[1:]) < 0.5, timings  # only the first call may pay a timeout
    assert client.stats.snapshot()["circuit_open"] >= 1
    t0 = time.monotonic()
    client.close()
    assert time.monotonic() - t0 < 5.5  # close is time-boxed (5 s) even with the master gone
