"""Config-derived namespaces: what the scheduler keys by must be what the workers hold.

The prediction is checked against a real vLLM CPU KV cache in test_connector.py
(the worker refuses to start on a mismatch); here: the pure parts.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mooncake_vllm.keys import KeyNamespace, RequestExtras
from mooncake_vllm.settings import ConnectorSettings
from mooncake_vllm.v1.namespace import (
    ExpectedLayout,
    RankNamespaces,
    check_layout,
    request_extras,
)
from mooncake_vllm.v1.namespace import rank_namespaces as _rank_namespaces


def rank_namespaces(vllm_config: SimpleNamespace, **kw: object) -> RankNamespaces:
    return _rank_namespaces(vllm_config, ConnectorSettings.from_vllm_config(vllm_config), **kw)


class _Model:
    model = "/models/tiny-llama/"
    dtype = "torch.float32"
    use_mla = False

    def get_head_size(self) -> int:
        return 32

    def get_num_kv_heads(self, parallel: SimpleNamespace) -> int:
        return max(1, 4 // parallel.tensor_parallel_size)

    def get_total_num_hidden_layers(self) -> int:
        return 6


def _config(tp: int = 1, pp: int = 1, **extra: object) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=_Model(),
        cache_config=SimpleNamespace(block_size=32, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        kv_transfer_config=SimpleNamespace(kv_role="kv_both", kv_connector_extra_config=dict(extra)))


def test_model_id_is_the_model_dir_name_unless_configured() -> None:
    assert ConnectorSettings.from_vllm_config(_config()).model_id == "tiny-llama"
    assert ConnectorSettings.from_vllm_config(_config(model_id="shared")).model_id == "shared"
    (ns,) = rank_namespaces(_config(model_id="shared")).namespaces
    assert ns.model_id == "shared"


def test_tenant_joins_every_rank_namespace() -> None:
    plain = rank_namespaces(_config(tp=2)).namespaces
    a = rank_namespaces(_config(tp=2), tenant="a").namespaces
    b = rank_namespaces(_config(tp=2), tenant="b").namespaces
    assert all(n.tenant == "a" for n in a)
    prefixes = [{n.prefix() for n in group} for group in (plain, a, b)]
    assert not (prefixes[0] & prefixes[1] or prefixes[0] & prefixes[2] or prefixes[1] & prefixes[2])


def test_cache_prefix_joins_every_rank_namespace_next_to_the_tenant() -> None:
    plain = rank_namespaces(_config(tp=2), tenant="a").namespaces
    prefixed = rank_namespaces(_config(tp=2, cache_prefix="w2"), tenant="a").namespaces
    assert all(n.cache_prefix == "w2" and n.tenant == "a" for n in prefixed)
    assert not {n.prefix() for n in plain} & {n.prefix() for n in prefixed}


def test_one_namespace_per_tp_and_pp_rank_without_dp() -> None:
    ranks = rank_namespaces(_config(tp=2, pp=2)).namespaces
    assert [(n.tp_rank, n.tp_size, n.pp_rank) for n in ranks] == [
        (0, 2, 0), (1, 2, 0), (0, 2, 1), (1, 2, 1)]
    assert len({n.prefix() for n in ranks}) == 4
    assert all("L3:" in n.layout and ":2x32x64" in n.layout for n in ranks)  # 6 layers / 2 stages
    (only,) = rank_namespaces(_config(tp=2, pp=2), only=(1, 1)).namespaces
    assert only == ranks[3]


def test_layout_variant_override_and_mismatch_message() -> None:
    (ns,) = rank_namespaces(_config(layout_variant="amx")).namespaces
    assert ns.layout.startswith("cpu:amx:float32:L6:")
    expected = ExpectedLayout("cpu", "vec", "float32", 6, (4, 32, 64))
    with pytest.raises(RuntimeError, match="cpu:vec:float32:L6:4x32x64"):
        check_layout(expected, SimpleNamespace(fingerprint="cpu:vec:float32:L5:4x32x64"))


def test_keys_for_is_rank_major() -> None:
    a = KeyNamespace("m", "f", "l", 4, 0, 2)
    b = KeyNamespace("m", "f", "l", 4, 1, 2)
    keys = RankNamespaces((a, b)).keys_for(["d1", "d2"])
    assert keys == [f"{a.prefix()}/d1", f"{a.prefix()}/d2", f"{b.prefix()}/d1", f"{b.prefix()}/d2"]


def test_request_extras_collects_lora_salt_and_multimodal_hashes() -> None:
    feature = SimpleNamespace(mm_position=SimpleNamespace(offset=5, length=10), mm_hash="h1",
                              identifier="id1")
    req = SimpleNamespace(lora_request=SimpleNamespace(lora_name="sql"), cache_salt="salt",
                          mm_features=[feature])
    assert request_extras(req) == RequestExtras("sql", "salt", ((5, 10, "h1"),))
    assert request_extras(SimpleNamespace()) == RequestExtras()


class _MlaModel(_Model):
    """A DeepSeek-V2-style model: one 576-wide latent per token, on every TP rank."""

    use_mla = True

    def get_head_size(self) -> int:
        return 576

    def get_num_kv_heads(self, parallel: SimpleNamespace) -> int:
        return 1


def _mla_config(tp: int = 2, pp: int = 1, dcp: int = 1) -> SimpleNamespace:
    cfg = _config(tp=tp, pp=pp)
    cfg.model_config = _MlaModel()
    cfg.parallel_config.decode_context_parallel_size = dcp
    return cfg


def test_mla_tp_ranks_share_one_namespace_and_only_rank0_stores() -> None:
    (sched,) = rank_namespaces(_mla_config(tp=2)).namespaces  # the scheduler looks up one set
    (rank0,) = rank_namespaces(_mla_config(tp=2), only=(0, 0)).namespaces
    (rank1,) = rank_namespaces(_mla_config(tp=2), only=(1, 0)).namespaces
    assert sched.prefix() == rank0.prefix() == rank1.prefix()
    assert "|tp=shared|" in rank1.describe()
    assert (rank0.stores, rank1.stores) == (True, False)
    # the fingerprint still names the bytes: the latent layout, not the CPU attention packing
    assert rank0.layout.endswith(":float32:L6:1x32x576") and rank0.layout.startswith(("hnc", "mla"))
    assert RankNamespaces((sched,)).keys_for(["ab"]) == [f"{sched.prefix()}/ab"]
    # per PP stage still its own namespace
    assert len(rank_namespaces(_mla_config(tp=2, pp=2)).namespaces) == 2


def test_mla_sharded_by_context_parallelism_keeps_per_rank_keys() -> None:
    ranks = rank_namespaces(_mla_config(tp=2, dcp=2)).namespaces
    assert len({n.prefix() for n in ranks}) == 2 and all(n.stores for n in ranks)


def test_non_mla_keeps_per_rank_keys() -> None:
    ranks = rank_namespaces(_config(tp=2)).namespaces
    assert len({n.prefix() for n in ranks}) == 2 and all(n.stores for n in ranks)
    assert all(not n.tp_shared for n in ranks)


class _ModelOfVllm011(_Model):
    """vLLM <= 0.11's ModelConfig: no get_total_num_hidden_layers, the HF field instead."""

    get_total_num_hidden_layers = None  # type: ignore[assignment]
    hf_text_config = SimpleNamespace(num_hidden_layers=6)


def test_layers_come_from_the_hf_config_where_vllm_has_no_total_layers_method() -> None:
    old = _config(tp=2, pp=2)
    old.model_config = _ModelOfVllm011()
    assert [n.layout for n in rank_namespaces(old).namespaces] == \
        [n.layout for n in rank_namespaces(_config(tp=2, pp=2)).namespaces]


@pytest.mark.parametrize("release, fingerprint", [
    ("0.11.2", "hnd:cpu:float32:L6:2x32x4x32"),   # [2, B, H, N, D]: K and V apart
    ("0.22.0", "hnd:cpu:float32:L6:2x32x4x32"),
    ("0.23.0", "cpu:float32:L6:4x32x64"),         # [B, H, N, 2*D]
])
def test_cpu_prediction_follows_the_releases_cpu_kv_view(monkeypatch: pytest.MonkeyPatch,
                                                         release: str, fingerprint: str) -> None:
    from mooncake_vllm.compat import vllm_facts
    from mooncake_vllm.v1 import namespace

    monkeypatch.setattr(namespace, "_is_cpu_platform", lambda: True)
    monkeypatch.setattr(namespace, "installed_facts", lambda strict: vllm_facts(release, strict=strict))
    monkeypatch.setattr(namespace, "_cpu_isa", lambda *a: "")  # releases without an ISA choice
    assert namespace.expected_layout(_config()).fingerprint == fingerprint
