"""Namespaces in a REAL pool: registration, and a clear that removes exactly one namespace."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mooncake_vllm.config import load_store_config
from mooncake_vllm.inventory import scan_pool
from mooncake_vllm.keys import KeyNamespace
from mooncake_vllm.services import LocalStack
from mooncake_vllm.store import StoreClient
from mooncake_vllm.store.namespaces import clear_namespaces, register_namespaces

BASE = KeyNamespace("ns-test", "float32", "cpu:float32:L2:2x32x64", 32, 0, 2)


def _ns(**kw: object) -> KeyNamespace:
    return KeyNamespace(**(BASE.__dict__ | kw))


@pytest.fixture(scope="module")
def client(module_local_stack: LocalStack) -> Iterator[StoreClient]:
    c = StoreClient.connect(load_store_config(module_local_stack.config_path))
    yield c
    c.close()


def _listed(stack: LocalStack) -> dict[str, int]:
    """Values per namespace digest, and registered digests (-1 if no value), per the master's listing
    (never a lookup: a loaded box may time one out, and a lookup grants leases)."""
    assert stack.master is not None
    return {d: e.keys if e.keys else -1 if e.namespace else 0
            for d, e in scan_pool(stack.master.url, sizes=False).entries.items()}


def _plant(client: StoreClient, ns: KeyNamespace, n: int) -> list[str]:
    keys = [f"{ns.prefix()}/{i:032x}" for i in range(n)]
    assert all(client.put_value(k, b"kv") for k in keys)
    return keys


def test_clear_removes_one_engines_ranks_and_nothing_else(client: StoreClient,
                                                         module_local_stack: LocalStack) -> None:
    mine = [_ns(), _ns(tp_rank=1)]  # one TP=2 engine: two rank namespaces
    others = [_ns(tenant="team-b"), _ns(cache_prefix="w2"), _ns(block_size=16), _ns(model_id="other")]
    assert register_namespaces(client, mine + others) == 6
    planted = {ns: _plant(client, ns, 5) for ns in mine + others}
    client.exists(planted[mine[0]])  # leases granted by a lookup do not protect them
    assert clear_namespaces(client, mine) == 10
    listed = _listed(module_local_stack)
    # mine: no value left, still registered (-1); every other namespace keeps its 5 values
    assert {ns.digest(): listed.get(ns.digest()) for ns in planted} == {
        ns.digest(): -1 if ns in mine else 5 for ns in planted}
    assert clear_namespaces(client, mine) == 0  # idempotent


def test_registration_is_idempotent_and_off_path(client: StoreClient) -> None:
    ns = _ns(model_id="reg-test")
    assert register_namespaces(client, [ns]) == 1
    assert register_namespaces(client, [ns]) == 1  # already there: first writer wins, still "registered"
    assert register_namespaces(client, [_ns(model_id="reg-bg")], background=True) is None


def test_without_a_client_or_a_pool_nothing_happens(module_local_stack: LocalStack,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    assert clear_namespaces(None, [BASE]) is None
    closed = StoreClient.connect(load_store_config(module_local_stack.config_path))
    closed.close()
    assert closed.remove_matching(BASE.pattern()) is None
    assert clear_namespaces(closed, [BASE]) is None
    assert "pool clear" in caplog.text  # the fallback is named
