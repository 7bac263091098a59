"""bench/interference_engine.py: the bench devices it applies inside a reader's process."""

from __future__ import annotations

import pytest
import torch

from mooncake_vllm.config import load_store_config
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.services import LocalStack
from mooncake_vllm.store import StoreClient
from mooncake_vllm.store import client as store_client
from tests.scripts._load import load_script

engine = load_script("bench/interference_engine.py")


def _saved(stack: LocalStack, key: str) -> tuple[int, bool]:
    """Blocks a real client reports stored for one save under ``key``, and whether the pool has it."""
    client = StoreClient.connect(load_store_config(stack.config_path))
    try:
        kv = [torch.randn((2, 4, 16, 2, 64)) for _ in range(2)]
        layout = BlockLayout.from_kv_caches(kv)
        client.register_layout(layout)
        stored = client.put_blocks([key], layout, [1])
        return stored, client.exists([key]) == [True]
    finally:
        client.close()


def test_discarding_puts_captures_and_stores_nothing(module_local_stack: LocalStack,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_client, "put_ticket", store_client.put_ticket)  # restored after
    monkeypatch.delenv("MCV_BENCH_DISCARD_PUTS", raising=False)
    assert engine._discard_puts() is False
    assert _saved(module_local_stack, "interference-engine/kept") == (1, True)
    monkeypatch.setenv("MCV_BENCH_DISCARD_PUTS", "1")
    assert engine._discard_puts() is True
    assert _saved(module_local_stack, "interference-engine/discarded") == (0, False)


def test_the_bench_runs_ours_noput_with_the_discarding_reader() -> None:
    bench = load_script("bench/bench_gpu_interference.py")
    config, env = bench._mode_config("ours-noput")
    assert env == {"MCV_BENCH_DISCARD_PUTS": "1"}
    assert config is not None and config["kv_connector"] == "MooncakeStoreConnector"
