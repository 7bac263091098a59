"""``save_admission``: "repeat" stores a block the second time it is saved, against a REAL pool."""

from __future__ import annotations

import numpy as np
import pytest

from mooncake_vllm.config import load_store_config
from mooncake_vllm.keys import KeyNamespace, chunk_keys, seen_key
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.services import LocalStack
from mooncake_vllm.store import StoreClient


@pytest.fixture
def client(module_local_stack: LocalStack):  # noqa: ANN201
    c = StoreClient.connect(load_store_config(module_local_stack.config_path))
    yield c
    c.close()


def _layout(seed: int, blocks: int = 8) -> tuple[list[np.ndarray], BlockLayout]:
    rng = np.random.default_rng(seed)
    kv = [rng.standard_normal((blocks, 2, 32, 64), dtype=np.float32) for _ in range(2)]
    return kv, BlockLayout.from_kv_caches(kv)


def _keys(layout: BlockLayout, first_token: int, n: int) -> list[str]:
    ns = KeyNamespace("admission", "float32", layout.fingerprint, 32)
    return chunk_keys(ns, list(range(first_token, first_token + 32 * n)))


def test_seen_key_stays_in_the_namespace_and_is_never_a_chunk_key() -> None:
    key = "mcv/0123456789abcdef/" + "ab" * 16
    assert seen_key(key) == "mcv/0123456789abcdef/seen/" + "ab" * 16
    with pytest.raises(ValueError, match="not a chunk key"):
        seen_key("no-slash")


def test_a_first_save_leaves_marks_and_the_second_stores_the_blocks(
        client: StoreClient, module_local_stack: LocalStack) -> None:
    kv, layout = _layout(1)
    client.register_layout(layout)
    keys = _keys(layout, 10_000, 3)
    assert client.put_blocks(keys, layout, [0, 1, 2], admission="repeat") == 0
    assert client.exists(keys) == [False] * 3  # no KV yet
    assert client.exists([seen_key(k) for k in keys]) == [True] * 3
    stats = client.stats.snapshot()
    assert stats["saves_first_seen"] == 3 and stats["seen_marks_put"] == 3
    assert client.get_blocks(keys, layout, [5, 6, 7]) == [False] * 3  # a mark is never KV

    # another instance saves the same prefix: it is stored now
    other = StoreClient.connect(load_store_config(module_local_stack.config_path))
    try:
        kv2, layout2 = _layout(1)
        other.register_layout(layout2)
        assert other.put_blocks(keys, layout2, [0, 1, 2], admission="repeat") == 3
        assert other.stats.snapshot().get("saves_first_seen", 0) == 0
    finally:
        other.close()
    assert client.get_blocks(keys, layout, [5, 6, 7]) == [True] * 3
    assert all(np.array_equal(t[5:8], t[0:3]) for t in kv)


def test_always_keys_and_the_default_store_at_the_first_save(client: StoreClient) -> None:
    _, layout = _layout(2)
    client.register_layout(layout)
    keys = _keys(layout, 20_000, 3)
    ticket = client.prepare_save(keys, layout, [0, 1, 2], admission="repeat", always={keys[1]})
    assert client.commit_save(ticket) == 1  # the hand-off's block only
    assert client.exists(keys) == [False, True, False]
    assert client.exists([seen_key(k) for k in keys]) == [True, False, True]
    fresh = _keys(layout, 30_000, 2)
    assert client.put_blocks(fresh, layout, [3, 4]) == 2  # "all": today's behaviour
    assert client.exists([seen_key(k) for k in fresh]) == [False, False]


def test_an_unknown_admission_is_refused(client: StoreClient) -> None:
    _, layout = _layout(3)
    client.register_layout(layout)
    with pytest.raises(ValueError, match="save admission 'twice'"):
        client.prepare_save(_keys(layout, 40_000, 1), layout, [0], admission="twice")


def test_marks_decided_before_capture_leave_no_kv_and_admit_the_next_save(
        client: StoreClient) -> None:
    """V1's scheduler decides first sightings before capturing (v1/admission.py): the save
    thread puts only their marks; the next save of those blocks stores them."""
    _, layout = _layout(4)
    client.register_layout(layout)
    keys = _keys(layout, 50_000, 2)
    before = client.stats.snapshot()
    client.mark_seen(keys)
    client.mark_seen([])  # nothing to put: no call
    after = client.stats.snapshot()
    assert after["saves_first_seen"] - before.get("saves_first_seen", 0) == 2
    assert after["seen_marks_put"] - before.get("seen_marks_put", 0) == 2
    assert client.exists(keys) == [False, False]
    assert client.exists([seen_key(k) for k in keys]) == [True, True]
    assert client.put_blocks(keys, layout, [0, 1], admission="repeat") == 2
