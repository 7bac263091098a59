"""tenant_id end to end: two tenants on ONE real pool never read each other's blocks.

Each side loads its own Mooncake config file (same master, different ``tenant_id``),
keys by the namespace that config gives, saves and loads through the real V1
worker logic; numpy arrays stand in for vLLM's CPU KV cache.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mooncake_vllm.config import load_store_config
from mooncake_vllm.keys import KeyNamespace
from mooncake_vllm.v1.client import SharedClient
from mooncake_vllm.v1.metadata import BlockJob, MooncakeConnectorMetadata
from mooncake_vllm.v1.namespace import ExpectedLayout
from mooncake_vllm.v1.worker import WorkerLogic

SHAPE = (8, 2, 4, 64)  # blocks, kv heads, block size, 2*head
EXPECTED = ExpectedLayout("cpu", "", "float32", 2, SHAPE[1:])
DIGESTS = [f"{0x7e4a17 + i:032x}" for i in range(3)]


def _cache(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"layer.{i}": rng.standard_normal(SHAPE, dtype=np.float32) for i in range(2)}


@pytest.fixture(scope="module")
def tenant_configs(module_local_stack: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = json.loads(Path(module_local_stack.config_path).read_text())
    out: dict[str, Path] = {}
    for tenant in ("", "team-a", "team-b"):
        path = tmp_path_factory.mktemp("tenant") / "mooncake_config.json"
        path.write_text(json.dumps({**base, "tenant_id": tenant} if tenant else base))
        out[tenant] = path
    return out


def _worker(config_path: Path, *, save: bool, prefix: str = "") -> tuple[WorkerLogic, SharedClient]:
    cfg = load_store_config(config_path)
    shared = SharedClient(cfg)
    assert shared.start() is not None
    ns = KeyNamespace("tenant-test", "float32", EXPECTED.fingerprint, SHAPE[2], tenant=cfg.tenant_id,
                      cache_prefix=prefix)
    return WorkerLogic(ns, EXPECTED, shared, can_load=not save, can_save=save), shared


def _save(config_path: Path, cache: dict[str, np.ndarray], prefix: str = "") -> None:
    saver, shared = _worker(config_path, save=True, prefix=prefix)
    try:
        saver.register_kv_caches(cache)
        saver.wait_for_save(MooncakeConnectorMetadata(saves=[BlockJob("s", DIGESTS, [1, 2, 3])]))
        deadline = time.monotonic() + 10
        while not saver.idle() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert saver.counters["saved_blocks"] == 3
    finally:
        saver.shutdown()
        shared.close()


def _load(config_path: Path, cache: dict[str, np.ndarray], prefix: str = "") -> set[int]:
    loader, shared = _worker(config_path, save=False, prefix=prefix)
    try:
        loader.register_kv_caches(cache)
        loader.start_load_kv(MooncakeConnectorMetadata(loads=[BlockJob("l", DIGESTS, [4, 5, 6])]))
        return loader.take_load_errors()
    finally:
        loader.shutdown()
        shared.close()


def test_two_tenants_never_share_blocks(tenant_configs: dict[str, Path]) -> None:
    src = _cache(1)
    _save(tenant_configs["team-a"], src)

    other, original = _cache(2), _cache(2)
    assert _load(tenant_configs["team-b"], other) == {4, 5, 6}  # every block a miss
    assert _load(tenant_configs[""], other) == {4, 5, 6}  # no tenant is not a wildcard
    for name in other:
        assert np.array_equal(other[name], original[name])  # nothing was written

    same = _cache(3)
    assert _load(tenant_configs["team-a"], same) == set()  # the same tenant does share
    for name in src:
        assert np.array_equal(same[name][4:7], src[name][1:4])


def test_cache_prefix_composes_with_the_tenant(tenant_configs: dict[str, Path]) -> None:
    """Sharing needs the same tenant AND the same cache_prefix, on one real pool."""
    src = _cache(4)
    _save(tenant_configs["team-b"], src, prefix="weights-v2")
    for tenant, prefix in (("team-b", ""), ("team-b", "weights-v1"), ("team-a", "weights-v2"),
                           ("", "weights-v2")):
        other, original = _cache(5), _cache(5)
        assert _load(tenant_configs[tenant], other, prefix) == {4, 5, 6}, (tenant, prefix)
        assert all(np.array_equal(other[n], original[n]) for n in other)
    same = _cache(6)
    assert _load(tenant_configs["team-b"], same, "weights-v2") == set()
    assert all(np.array_equal(same[n][4:7], src[n][1:4]) for n in src)
