"""Hybrid models: the connector serves one full-attention (or MLA) KV group, refuses the rest.

The groups are built from the REAL spec classes of the installed vLLM
(``vllm.v1.kv_cache_interface``), as vLLM hands them to the connector; the
engine-level proofs (a Gemma-2 style model hits token-identically, an
all-sliding-window model is refused at start) are in test_model_kinds.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mooncake_vllm.errors import UnsupportedModelError
from mooncake_vllm.v1.kv_groups import check_kv_cache_config, check_kv_caches, describe_groups

kvi = pytest.importorskip("vllm.v1.kv_cache_interface")


def _full(**kw: object) -> object:
    return kvi.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32,
                                 dtype=torch.float32, **kw)


def _config(*groups: tuple[list[str], object]) -> object:
    return kvi.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        kvi.KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec) for names, spec in groups])


def _layers(prefix: str, n: int) -> list[str]:
    return [f"model.layers.{i}.{prefix}" for i in range(n)]


def test_one_full_attention_or_mla_group_is_served() -> None:
    check_kv_cache_config(_config((_layers("attn", 4), _full())), model="m")
    mla = kvi.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
    check_kv_cache_config(_config((_layers("attn", 2), mla)), model="m")


def test_sliding_window_plus_full_groups_are_refused_with_their_names() -> None:
    sliding = kvi.SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=32,
                                    dtype=torch.float32, sliding_window=16)
    cfg = _config((_layers("full", 2), _full()), (_layers("local", 3), sliding))
    with pytest.raises(UnsupportedModelError) as err:
        check_kv_cache_config(cfg, model="gemma-tiny")
    msg = str(err.value)
    assert "'gemma-tiny'" in msg and "2 KV cache groups" in msg
    assert "group 0: FullAttentionSpec, 2 layer(s) (model.layers.0.full, model.layers.1.full)" in msg
    assert "group 1: SlidingWindowSpec, window 16, 3 layer(s)" in msg and "+1 more" in msg
    assert "Fix:" in msg


def test_mamba_hybrid_and_a_lone_sliding_group_are_refused() -> None:
    mamba = kvi.MambaSpec(block_size=16, shapes=((4, 8), (2, 4, 4)),
                          dtypes=(torch.float32, torch.float32))
    with pytest.raises(UnsupportedModelError, match="group 1: MambaSpec"):
        check_kv_cache_config(_config((_layers("attn", 1), _full()),
                                      (_layers("mixer", 3), mamba)), model="m")
    sliding = kvi.SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=32,
                                    dtype=torch.float32, sliding_window=8)
    with pytest.raises(UnsupportedModelError, match="its KV cache group is SlidingWindowSpec"):
        check_kv_cache_config(_config((_layers("attn", 4), sliding)), model="m")
    with pytest.raises(UnsupportedModelError, match="attention-free"):
        check_kv_cache_config(_config(), model="m")


def test_uniform_type_group_is_judged_by_its_layers() -> None:
    uniform = kvi.UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={
        "a": _full(), "b": kvi.FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=32,
                                                 dtype=torch.float32)})
    (group,) = describe_groups(_config((["a", "b"], uniform)))
    assert group.spec == "FullAttentionSpec" and group.supported


def test_without_a_kv_cache_config_the_layers_are_judged() -> None:
    cache = np.zeros((4, 2, 16, 64), dtype=np.float32)
    full, local = SimpleNamespace(sliding_window=None), SimpleNamespace(sliding_window=16)

    def cfg(**modules: object) -> SimpleNamespace:  # vLLM's static forward context
        return SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=modules))

    # full + sliding layers: vLLM allocated full pages for all (its hybrid manager is off)
    check_kv_caches({"l0": cache, "l1": cache}, cfg(l0=full, l1=local), model="m")
    with pytest.raises(UnsupportedModelError, match="all of its attention layers are sliding"):
        check_kv_caches({"l0": cache, "l1": cache}, cfg(l0=local, l1=local), model="m")
    with pytest.raises(UnsupportedModelError, match=r"state \(Mamba"):
        check_kv_caches({"l0": cache, "m1": [cache, cache]}, cfg(l0=full), model="m")


def test_vllm_turns_its_hybrid_manager_off_for_our_connector() -> None:
    """What the facts table says about the installed release, checked in its wheel."""
    from mooncake_vllm.compat import installed_vllm, vllm_facts
    from mooncake_vllm.v1.connector import MooncakeStoreConnector

    facts = vllm_facts(installed_vllm().version)
    assert facts.connector_hma == "off-unless-supports-hma"
    base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
    assert not issubclass(MooncakeStoreConnector, base.SupportsHMA)
