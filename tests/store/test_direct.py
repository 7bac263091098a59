"""GPU zero-copy loads (store/direct.py): straight into the KV blocks, verified on the GPU.

The CUDA data path needs a GPU and a CUDA build of Mooncake (marked ``gpu``, skipped
cleanly elsewhere; the cross-path byte-exactness and refusal tests on every layout are
in ``test_block_paths.py``). What runs on the CPU: an open breaker sends nothing.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

from mooncake_vllm.config import load_store_config
from mooncake_vllm.keys import KeyNamespace, chunk_keys
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.store import StoreClient
from mooncake_vllm.store.direct import get_direct

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
