"""StoreClient against a REAL master + metadata + holder (mooncake_client) on loopback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mooncake_vllm import codec
from mooncake_vllm.config import load_store_config
from mooncake_vllm.errors import StoreUnavailableError
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


def test_prometheus_rendering(client: StoreClient) -> None:
    client.exists(["a", "b"])
    text = client.stats.render_prometheus()
    assert "mooncake_vllm_store_lookups_total 1" in text
    assert 'mooncake_vllm_store_latency_seconds_count{op="exists"} 1' in text


def _config(tmp_path: Path, master: str, metadata: str) -> Path:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"metadata_server": metadata, "master_server_address": master,
                                "global_segment_size": "0", "local_buffer_size": "16MB",
                                "protocol": "tcp", "device_name": ""}))
    return path


def test_dead_master_fails_fast_with_clear_error(
        module_local_stack: LocalStack, tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=f"no Mooncake master at 127.0.0.1:{port}"):
        StoreClient.connect(load_store_config(_config(tmp_path, f"127.0.0.1:{port}",
                                                      module_local_stack.metadata_url)))
    assert time.monotonic() - start < 2  # a refused port is known at once


def test_hung_master_fails_within_timeout(module_local_stack: LocalStack, tmp_path: Path) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:  # accepts and never answers
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            StoreClient.connect(load_store_config(_config(
                tmp_path, f"127.0.0.1:{server.getsockname()[1]}", module_local_stack.metadata_url)),
                timeout=4.0)
        assert time.monotonic() - start < 4.5  # the 4 s time-box, not Mooncake's own retries
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        server.close()


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


def test_redis_metadata_goes_through_the_bridge(
        mooncake_master, redis_server: str, workdir: Path, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    """A seed-style config with redis:// metadata works with the PyPI wheel (no exit 134)."""
    holder_cfg = _config(workdir, mooncake_master.address, redis_server)
    data = json.loads(holder_cfg.read_text()) | {"global_segment_size": "64MB"}
    holder_cfg.write_text(json.dumps(data))
    with caplog.at_level("WARNING"):
        holder = StoreClient.connect(load_store_config(holder_cfg))
    assert any("redis" in r.getMessage() for r in caplog.records)
    try:
        assert holder.put_value("mcv-test/redis", b"via the bridge")
        reader = StoreClient.connect(load_store_config(_config(
            workdir, mooncake_master.address, redis_server)))
        assert reader.get_value("mcv-test/redis") == b"via the bridge"
        reader.close()
        import redis as redis_lib

        keys = redis_lib.Redis.from_url(redis_server).keys("mooncake/*")
        assert any(k.startswith(b"mooncake/ram/") for k in keys)  # entries live in redis
    finally:
        holder.close()
