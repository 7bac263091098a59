"""The V0 connector driven by REAL vLLM V0 batch objects against a REAL Mooncake pool.

Runs inside an old-vLLM env (see conftest.py): real ``ModelInputForGPUWithSamplingMetadata``
and ``FlashAttentionMetadata`` and GPU-layout KV tensors, on the CPU and (``dev``
fixture, marked ``gpu``) on CUDA, a real
mooncake_master + holder, and the V1 worker logic for the cross-engine cases.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from .v0_inputs import flash_caches, prefill_input, v0_config

BS, LAYERS, HEADS, HEAD = 16, 2, 2, 32
NUM_BLOCKS = 32
HIDDEN = 64


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(n)]


@pytest.fixture
def stack_env(module_local_stack, monkeypatch):
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(module_local_stack.config_path))
    for k, v in module_local_stack.env().items():
        monkeypatch.setenv(k, v)
    return module_local_stack


def _connector(**kw):
    from mooncake_vllm.v0.connector import MooncakeStoreConnector

    return MooncakeStoreConnector(0, 0, v0_config(BS, **kw))


def _tokens_kv(caches, table, n):
    """K and V of the first n tokens of a sequence with block table ``table``, all layers."""
    out = []
    for kv in caches:
        flat = kv.view(2, -1, HEADS, HEAD)
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
        out.append(flat[:, slots])
    return torch.stack(out)


def test_v0_producer_then_v0_consumer_bypasses_with_exact_kv(stack_env, dev) -> None:
    prompts = [_prompt(1, 40), _prompt(2, 35)]  # 2 full blocks + 8 tail, 2 full + 3 tail
    prod_tables = [[3, 7, 11], [20, 4, 9]]
    cons_tables = [[30, 1, 2], [5, 6, 8]]  # different physical blocks on the consumer
    producer, consumer = _connector(), _connector()
    try:
        src = flash_caches(LAYERS, NUM_BLOCKS, BS, HEADS, HEAD, fill="randn", seed=7, device=dev)
        batch = prefill_input(prompts, prod_tables, BS, device=dev)
        # seeded like the caches: the [cpu] and [cuda] runs share the pool and the keys, and a
        # key names one set of bytes (a put of a stored key is skipped)
        hidden = torch.randn(75, HIDDEN, generator=torch.Generator().manual_seed(11)).to(dev)
        producer.send_kv_caches_and_hidden_states(None, batch, src, hidden)

        dst = flash_caches(LAYERS, NUM_BLOCKS, BS, HEADS, HEAD, device=dev)
        out, bypass, _ = consumer.recv_kv_caches_and_hidden_states(
            None, prefill_input(prompts, cons_tables, BS, device=dev), dst)
        assert bypass is True
        counted = consumer.store.stats.snapshot()
        assert (counted["hits"], counted["misses"], counted["blocks_got"]) == (4, 0, 4)
        for i, p in enumerate(prompts):
            assert torch.equal(_tokens_kv(dst, cons_tables[i], len(p)),
                               _tokens_kv(src, prod_tables[i], len(p)))
        assert out.shape == (75, HIDDEN)
        assert torch.equal(out[39], hidden[39]) and torch.equal(out[74], hidden[74])
        untouched = set(range(NUM_BLOCKS)) - {b for t in cons_tables for b in t}
        assert all(float(kv[:, b].abs().sum()) == 0.0 for kv in dst for b in untouched)
    finally:
        producer.close()
        consumer.close()


def test_no_handoff_race_on_v0_every_block_is_stored_when_send_returns(stack_env) -> None:
    """V0 needs no hand-off (issue 18): vLLM calls ``send_kv_caches_and_hidden_states``
    inside the forward pass and answers only after it returns, and the connector stores
    synchronously there (no save thread). So when the prefill's answer reaches the proxy,
    every key is already in the pool: a decode looking up at that instant finds all."""
    from mooncake_vllm.keys import chunk_keys

    prompt = _prompt(77, 70)  # 4 full blocks + 6 tail (a seed no other test of this module uses)
    producer, consumer = _connector(), _connector()
    try:
        batch = prefill_input([prompt], [[1, 2, 3, 4, 5]], BS)
        src = flash_caches(LAYERS, NUM_BLOCKS, BS, HEADS, HEAD, fill="randn", seed=9)
        producer.send_kv_caches_and_hidden_states(None, batch, src, torch.randn(70, HIDDEN))
        # no save thread (V1's is "mcv-save"): nothing can still be on its way
        assert not [t for t in threading.enumerate() if t.name == "mcv-save"]
        keys = chunk_keys(producer.namespace, prompt)
        assert len(keys) == 4 and producer.store.exists(keys) == [True] * 4  # no wait, no retry
        _, bypass, _ = consumer.recv_kv_caches_and_hidden_states(
            None, prefill_input([prompt], [[6, 7, 8, 9, 10]], BS),
            flash_caches(LAYERS, NUM_BLOCKS, BS, HEADS, HEAD))
        assert bypass is True
    finally:
        producer.close()
        consumer.close()


def test_partial_hit_loads_nothing_and_recomputes(stack_env, dev) -> None:
    known, unknown = _prompt(11, 33), _prompt(12, 33)
    producer, consumer = _connector(), _connector()
    try:
        src = flash_caches(LAYERS, NUM_BLOCKS, BS, HEADS, HEAD, fill="randn", seed=3, device=dev)
        producer.send_kv_caches_and_hidden_states(
            None, prefill_input([known], [[1, 2, 3]], BS, device=dev), src, torch.randn(33, HIDDEN, device=dev))
        dst = flash_caches(LAYERS, NUM_BLOCKS, BS, HEADS, HEAD, device=dev)
        out, bypass, model_input = consumer.recv_kv_caches_and_hidden_states(
            None, prefill_input([known, unknown], [[4, 5, 6], [7, 8, 9]], BS, device=dev), dst)
        assert (out, bypass) == (None, False)
        assert all(float(kv.abs().sum()) == 0.0 for kv in dst)  # nothing written
        counted = consumer.store.stats.snapshot()  # the known prompt's 2 blocks, the other's 2
        assert (counted["hits"], counted["misses"], counted["blocks_got"]) == (2, 2, 0)
        # the known prompt alone is a full hit
        _out, bypass, _ = consumer.recv_kv_caches_and_hidden_states(
            None, prefill_input([known], [[4, 5, 6]], BS, device=dev), dst)
        assert bypass is True
    finally:
        producer.close()
        consumer.close()


def test_prefix_cached_sequences_are_never_keyed(stack_env, dev) -> None:
    """A sequence whose batch slice does not start at token 0 is neither saved nor served."""
    prompt = _prompt(21, 48)
    producer = _connector()
    try:
        src = flash_caches(LAYERS, NUM_BLOCKS, BS, HEADS, HEAD, fill="randn", seed=5, device=dev)
        batch = prefill_input([prompt], [[1, 2, 3]], BS, context_lens=[16], device=dev)
        producer.send_kv_caches_and_hidden_states(None, batch, src, torch.randn(32, HIDDEN, device=dev))
        from mooncake_vllm.keys import chunk_keys

        assert producer.namespace is not None
        assert not any(producer.store.exists(chunk_keys(producer.namespace, prompt)))
        out, bypass, _ = producer.recv_kv_caches_and_hidden_states(None, batch, src)
        assert bypass is False
    finally:
        producer.close()


def test_different_model_is_a_miss(stack_env, dev) -> None:
    prompt = _prompt(31, 32)
    producer, other = _connector(model="/m/model-a"), _connector(model="/m/model-b")
    try:
        src = flash_caches(LAYERS, NUM_BLOCKS, BS, HEADS, HEAD, fill="randn", seed=9, device=dev)
        producer.send_kv_caches_and_hidden_states(
            None, prefill_input([prompt], [[1, 2]], BS, device=dev), src, torch.randn(32, HIDDEN, device=dev))
        dst = flash_caches(LAYERS, NUM_BLOCKS, BS, HEADS, HEAD, device=dev)
        _out, bypass, _ = other.recv_kv_caches_and_hidden_states(
            None, prefill_input([prompt], [[3, 4]], BS, device=dev), dst)
        assert bypass is False
    finally:
        producer.close()
        other.close()


# ---------------------------------------------------------------- cross-engine: V0 -> V1
def _v1_worker(stack, kind: str, caches, model_id: str):
    from mooncake_vllm.config import load_store_config
    from mooncake_vllm.keys import KeyNamespace
    from mooncake_vllm.v1.client import shared_client
    from mooncake_vllm.v1.namespace import ExpectedLayout
    from mooncake_vllm.v1.worker import WorkerLogic

    shape = (2, BS, HEADS, HEAD) if kind == "nhd" else (HEADS, BS, 2 * HEAD)
    expected = ExpectedLayout(kind, "", "float32", LAYERS, shape)
    ns = KeyNamespace(model_id=model_id, dtype="float32", layout=expected.fingerprint, block_size=BS)
    source = shared_client(load_store_config(stack.config_path))
    assert source.start() is not None
    worker = WorkerLogic(ns, expected, source, can_load=True, can_save=False)
    worker.register_kv_caches({f"layers.{i}.attn": t for i, t in enumerate(caches)})
    return worker, source


def _v1_load(worker, prompt, block_ids):
    from mooncake_vllm.keys import chunk_digests
    from mooncake_vllm.v1.metadata import BlockJob, MooncakeConnectorMetadata

    digests = [d.hex() for d in chunk_digests(prompt, BS)]
    worker.start_load_kv(MooncakeConnectorMetadata(loads=[BlockJob("r", digests, list(block_ids))]))
    return worker.take_load_errors()


def test_v0_saved_blocks_load_bit_exact_through_v1_worker(stack_env, dev) -> None:
    prompt = _prompt(41, 50)  # 3 full blocks
    producer = _connector(model="/models/shared-llama")
    try:
        src = flash_caches(LAYERS, NUM_BLOCKS, BS, HEADS, HEAD, fill="randn", seed=13, device=dev)
        producer.send_kv_caches_and_hidden_states(
            None, prefill_input([prompt], [[9, 2, 17, 5]], BS, device=dev), src, torch.randn(50, HIDDEN, device=dev))
        v1_caches = flash_caches(LAYERS, NUM_BLOCKS, BS, HEADS, HEAD, device=dev)  # V1 GPU flash layout
        worker, source = _v1_worker(stack_env, "nhd", v1_caches, "shared-llama")
        try:
            errors = _v1_load(worker, prompt, [20, 21, 22])
            assert errors == set()
            for layer in range(LAYERS):
                for v0_block, v1_block in zip([9, 2, 17], [20, 21, 22]):
                    assert torch.equal(v1_caches[layer][:, v1_block], src[layer][:, v0_block])
        finally:
            worker.shutdown()
            source.close()
    finally:
        producer.close()


def test_v0_blocks_are_a_miss_for_v1_with_cpu_layout(stack_env, dev) -> None:
    prompt = _prompt(51, 32)
    producer = _connector(model="/models/shared-llama")
    try:
        src = flash_caches(LAYERS, NUM_BLOCKS, BS, HEADS, HEAD, fill="randn", seed=17, device=dev)
        producer.send_kv_caches_and_hidden_states(
            None, prefill_input([prompt], [[3, 4]], BS, device=dev), src, torch.randn(32, HIDDEN, device=dev))
        cpu_caches = [torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * HEAD, device=dev) for _ in range(LAYERS)]
        worker, source = _v1_worker(stack_env, "cpu", cpu_caches, "shared-llama")
        try:
            assert _v1_load(worker, prompt, [1, 2]) == {1, 2}
            assert all(float(t.abs().sum()) == 0.0 for t in cpu_caches)
        finally:
            worker.shutdown()
            source.close()
    finally:
        producer.close()


def test_missing_or_unreadable_config_is_one_clear_error(monkeypatch, tmp_path) -> None:
    from mooncake_vllm.errors import ConfigError

    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    with pytest.raises(ConfigError) as info:
        _connector()
    assert "MOONCAKE_CONFIG_PATH" in str(info.value) and "master_server_address" in str(info.value)
    missing = tmp_path / "nope.json"
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(missing))
    with pytest.raises(ConfigError) as info:
        _connector()
    assert str(missing) in str(info.value)


@pytest.mark.parametrize(("extra", "field"), [
    ({"model_idd": "m"}, "kv_connector_extra_config"),
    ({"load_failure_policy": "ignore"}, "kv_connector_extra_config.load_failure_policy"),
    ({"connect_timeout": 0}, "kv_connector_extra_config.connect_timeout"),
])
def test_extra_config_typos_v1_rejects_are_rejected_on_v0(extra, field, monkeypatch) -> None:
    from mooncake_vllm.errors import ConfigError

    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)  # refused before any config is read
    with pytest.raises(ConfigError) as info:
        _connector(extra=extra)
    assert field in info.value.fields


def test_v0_keys_by_cache_prefix_and_registers_its_namespace(stack_env) -> None:
    import time

    from mooncake_vllm.keys import KeyNamespace, chunk_keys

    prompt = _prompt(61, 32)
    producer = _connector(model="/models/prefixed-llama", extra={"cache_prefix": "w2"})
    try:
        src = flash_caches(LAYERS, NUM_BLOCKS, BS, HEADS, HEAD, fill="randn", seed=19)
        producer.send_kv_caches_and_hidden_states(
            None, prefill_input([prompt], [[3, 4]], BS), src, torch.randn(32, HIDDEN))
        ns = producer.namespace
        assert ns is not None and ns.cache_prefix == "w2" and ns.describe().endswith("|prefix=w2")
        plain = KeyNamespace(**(ns.__dict__ | {"cache_prefix": ""}))
        wanted = [*chunk_keys(ns, prompt), ns.registry_key(), *chunk_keys(plain, prompt)]
        deadline = time.monotonic() + 20  # registered off the engine's path; a loaded box may time a lookup out
        while (found := producer.store.exists(wanted)) != [True, True, True, False, False]:
            assert time.monotonic() < deadline, (found, producer.store.stats.snapshot())
            time.sleep(0.1)
    finally:
        producer.close()


def test_mla_tp_ranks_store_once_under_one_namespace(stack_env) -> None:
    """TP=2 MLA on V0: both ranks key by one namespace (tp=shared); only rank 0 puts."""
    from vllm.attention.backends.flash_attn import FlashAttentionMetadata

    from mooncake_vllm.keys import chunk_keys
    from mooncake_vllm.v0.connector import MooncakeStoreConnector

    mla_meta = type("MLACommonMetadata", (FlashAttentionMetadata,), {})  # the class name decides
    prompt = _prompt(61, 40)  # 2 full blocks
    gen = torch.Generator().manual_seed(23)
    caches = [torch.randn(NUM_BLOCKS, BS, 72, generator=gen) for _ in range(LAYERS)]
    ranks = [MooncakeStoreConnector(r, r, v0_config(BS, model="/m/mla-v0", tp_size=2))
             for r in (0, 1)]
    try:
        for rank in reversed(ranks):  # rank 1 first: it must not store anything
            batch = prefill_input([prompt], [[6, 3, 9]], BS)
            batch.attn_metadata.__class__ = mla_meta
            rank.send_kv_caches_and_hidden_states(None, batch, caches, torch.randn(40, HIDDEN))
            if rank is ranks[1]:
                assert rank.store.stats.snapshot()["blocks_put"] == 0
        ns0, ns1 = ranks[0].namespace, ranks[1].namespace
        assert ns0.prefix() == ns1.prefix() and "|tp=shared|" in ns0.describe()
        assert (ns0.stores, ns1.stores) == (True, False)
        keys = chunk_keys(ns0, prompt)
        assert len(keys) == 2 and all(ranks[1].store.exists(keys))
        assert ranks[0].store.stats.snapshot()["blocks_put"] == 2
    finally:
        for rank in ranks:
            rank.close()
