"""Pool inventory from a REAL mooncake_master's HTTP port (listing + sizes, never values)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mooncake_vllm.config import load_store_config
from mooncake_vllm.errors import StoreUnavailableError
from mooncake_vllm.inventory import scan_pool, splits
from mooncake_vllm.keys import KeyNamespace
from mooncake_vllm.services import LocalStack, free_port
from mooncake_vllm.store import StoreClient
from mooncake_vllm.store.namespaces import register_namespaces

NS16 = KeyNamespace("inv-llama", "float32", "cpu:float32:L2:2x16x64", 16)
NS32 = KeyNamespace("inv-llama", "float32", "cpu:float32:L2:2x32x64", 32)
TENANT = KeyNamespace("inv-llama", "float32", "cpu:float32:L2:2x32x64", 32, tenant="team-b")
LONE = KeyNamespace("inv-lone", "float32", "cpu:float32:L2:2x32x64", 32)
UNREGISTERED = KeyNamespace("inv-ghost", "float32", "cpu:float32:L2:2x32x64", 32)


@pytest.fixture(scope="module")
def pool(module_local_stack: LocalStack) -> Iterator[str]:
    with StoreClient.connect(load_store_config(module_local_stack.config_path)) as client:
        register_namespaces(client, [NS16, NS32, TENANT, LONE])
        for ns, n, size in ((NS16, 6, 100), (NS32, 3, 300), (TENANT, 2, 50), (UNREGISTERED, 4, 10)):
            for i in range(n):
                assert client.put_value(f"{ns.prefix()}/{i:032x}", b"x" * (size + i % 2))
        assert client.put_value("someone-else/key", b"y")
    assert module_local_stack.master is not None
    yield module_local_stack.master.url


def test_counts_and_exact_bytes(pool: str) -> None:
    inv = scan_pool(pool)
    assert not inv.truncated and inv.other_keys == 1
    by = {e.digest: e for e in inv.entries.values()}
    assert {d: by[d.digest()].keys for d in (NS16, NS32, TENANT, UNREGISTERED, LONE)} == {
        NS16: 6, NS32: 3, TENANT: 2, UNREGISTERED: 4, LONE: 0}
    assert by[NS16.digest()].namespace == NS16 and by[UNREGISTERED.digest()].namespace is None
    framed = 64 + len("x")  # every value: the 64-byte header, then the payload
    header = framed - 1
    assert by[NS16.digest()].bytes == 6 * (header + 100) + 3  # sizes come from the master
    assert by[LONE.digest()].bytes == 0 and not by[NS16.digest()].bytes_estimated
    doc = inv.as_dict()
    assert doc["namespaces"][0]["registered"] and doc["namespaces"][-1]["registered"] is False
    assert "age" in doc and doc["namespaces"][0]["age_s"] is None


def test_sampled_bytes_are_marked_estimated_and_listing_is_capped(pool: str) -> None:
    inv = scan_pool(pool, size_sample=2)
    e = inv.entries[NS16.digest()]
    assert e.bytes_estimated and abs(e.bytes - 6 * 164.5) <= 6
    cut = scan_pool(pool, max_keys=3, sizes=False)
    assert cut.truncated and cut.listed_keys == 3
    assert all(e.bytes is None for e in cut.entries.values())


def test_splits_name_the_differing_fields(pool: str) -> None:
    found = splits(scan_pool(pool, sizes=False))
    # inv-lone has one namespace, the ghost no fields, team-b's namespace is separated on purpose
    assert len(found) == 1 and found[0].model == "inv-llama" and found[0].keys == (6, 3)
    assert found[0].text() == ("2 namespaces for model inv-llama: differ in block_size (16 vs 32), layout "
                               "(cpu:float32:L2:2x16x64 vs cpu:float32:L2:2x32x64) — instances of these "
                               "never share KV [6 value(s) / 3 value(s)]")


def test_a_master_without_http_is_a_clear_error() -> None:
    with pytest.raises(StoreUnavailableError, match="--master-http"):
        scan_pool(f"127.0.0.1:{free_port()}", timeout=1)
