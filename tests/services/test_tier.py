"""The pool's disk tier (services/tier.py, the put retry in store/puts.py) on a real master and
holder: values beyond DRAM spill to disk and stay verified hits; a value corrupted on disk is
a miss, counted."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from mooncake_vllm.checker import run_check
from mooncake_vllm.config import load_store_config
from mooncake_vllm.inventory import pool_tiers, scan_pool
from mooncake_vllm.keys import KeyNamespace, chunk_keys
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.services import DiskTier, LocalStack, ServiceError
from mooncake_vllm.store import StoreClient
from tests.conftest import TEST_CLIENT_TTL

DRAM = 16 << 20  # one holder's DRAM: a third of what the test puts
BLOCKS = 96  # 256 KiB each: 24 MiB of values


@pytest.fixture(scope="module", params=["mooncake_client", "python"])
def tiered(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """A pool of one holder (the wheel's mooncake_client, or `mooncake-vllm holder --ssd`)."""
    work = tmp_path_factory.mktemp("tier")
    stack = LocalStack(work, segment_size=DRAM, local_buffer_size=32 << 20, client_ttl=TEST_CLIENT_TTL,
                       holders=1, holder=request.param, disk=DiskTier(work / "ssd", 256 << 20)).start()
    yield stack
    stack.stop()


def _disk_only(stack: LocalStack, keys: list[str]) -> list[str]:
    """The keys the master says have only a disk replica (DRAM evicted them)."""
    assert stack.master is not None
    url = f"{stack.master.url}/batch_query_keys?keys={','.join(keys)}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        data = json.loads(resp.read())["data"]
    return [k for k in keys if data[k]["ok"] and not data[k]["values"] and data[k]["local_disk_values"]]


def test_values_beyond_dram_spill_to_disk_stay_verified_hits_and_a_corrupt_one_is_a_miss(
        tiered: LocalStack) -> None:
    config = load_store_config(tiered.config_path)
    assert config.ssd_offload and config.global_segment_size == 0  # what `up --ssd` writes
    rng = np.random.default_rng(30)
    kv = [rng.standard_normal((BLOCKS * 2, 2, 16, 1024), dtype=np.float32) for _ in range(2)]
    layout = BlockLayout.from_kv_caches(kv)
    keys = chunk_keys(KeyNamespace("tier", "float32", layout.fingerprint, 16), list(range(BLOCKS * 16)))
    with StoreClient.connect(config) as client:
        client.register_layout(layout)
        assert client.put_blocks(keys, layout, list(range(BLOCKS))) == BLOCKS  # 1.5x DRAM: none dropped
        time.sleep(2.5)  # two offload heartbeats: every value is on disk
        spilled = _disk_only(tiered, keys)
        assert len(spilled) >= BLOCKS // 3, "DRAM holds a third: the rest must be disk-only"
        assert client.get_blocks(keys, layout, list(range(BLOCKS, 2 * BLOCKS))) == [True] * BLOCKS
        for t in kv:
            assert np.array_equal(t[BLOCKS:], t[:BLOCKS])  # every value, DRAM or disk, intact
        assert tiered.master is not None  # `pool stats`: where the values are, both tiers' use
        entry = scan_pool(tiered.master.url).entries[keys[0].split("/")[1]]
        assert entry.keys == entry.on_disk == BLOCKS and entry.in_dram is not None and entry.in_dram < BLOCKS
        tiers = pool_tiers(tiered.master.url)
        assert tiers["disk_reads"] >= len(spilled) and tiers["dram_capacity_bytes"] == DRAM
        assert tiers["disk_used_bytes"] >= BLOCKS * layout.block_nbytes and tiers["dram_evicted_values"] > 0
        # corrupt one disk-only value in its file: a miss, counted, never served
        victim = _disk_only(tiered, keys)[0]
        files = [f for f in (tiered.workdir / "ssd").rglob("*") if f.is_file() and f.name.endswith(
            victim.replace("/", "_")) or f.name.endswith(victim.rsplit("/", 1)[-1])]
        assert files, f"no disk file for {victim}"
        data = bytearray(files[0].read_bytes())
        data[len(data) // 2] ^= 0xFF
        files[0].write_bytes(bytes(data))
        before = client.stats.snapshot()["corrupt"]
        assert client.get_blocks([victim], layout, [0]) == [False]
        assert client.stats.snapshot()["corrupt"] == before + 1
    assert tiered.alive()


def test_the_probe_finds_the_tier_the_config_asks_for(tiered: LocalStack) -> None:
    result, _ = run_check([tiered.config_path], target_vllm="0.32.0", target_mooncake="0.3.13.post1", probe=True)
    assert not {"MCV-W106", "MCV-W021", "MCV-E016"} & {f.id for f in result.findings}


def test_a_disk_tier_directory_that_is_not_ours_is_refused(tmp_path: Path) -> None:
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "data.bin").write_bytes(b"user data")
    with pytest.raises(ServiceError, match="not one of ours"):
        DiskTier(tmp_path, 1 << 30).holder_dir("h")
    assert (tmp_path / "h" / "data.bin").exists()
    ours = DiskTier(tmp_path, 1 << 30).holder_dir("g")
    (ours / "old").write_text("stale")
    assert not (DiskTier(tmp_path, 1 << 30).holder_dir("g") / "old").exists()  # a cache: emptied


def test_a_holder_takes_the_tier_from_its_config_where_it_means_something(tmp_path: Path) -> None:
    import argparse

    from mooncake_vllm.cli import holder

    cfg = tmp_path / "cfg.json"  # a pure client's config naming the holder's directory is refused
    cfg.write_text(json.dumps({"metadata_server": "P2PHANDSHAKE", "master_server_address": "127.0.0.1:1",
                               "global_segment_size": "0", "enable_ssd_offload": True,
                               "ssd_offload_path": "/nvme/mc"}))
    parser = argparse.ArgumentParser()
    holder.configure(parser)
    data = holder._settings(parser.parse_args(["--config", str(cfg), "--segment-size", "1GB"]))
    config = load_store_config(data)
    assert config.ssd_offload and config.ssd_offload_path == "/nvme/mc" and config.global_segment_size == 1 << 30
    flag = holder._settings(parser.parse_args(["--master", "h:1", "--metadata", "P2PHANDSHAKE", "--ssd", "d"]))
    assert load_store_config(flag).ssd_offload_path == str(Path("d").resolve())
