"""Stable block keys: identical across processes and hash seeds, sensitive to what matters."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from mooncake_vllm.keys import (
    REGISTRY_PREFIX,
    DigestMemo,
    KeyNamespace,
    RequestExtras,
    block_key_digest,
    chunk_digests,
    chunk_hex_digests,
    chunk_keys,
    parse_registry_key,
)

NS = KeyNamespace("tiny-llama", "float32", "cpu:float32:L2:2x32x64", 32)
TOKENS = list(range(1000, 1000 + 32 * 4 + 7))


def test_only_full_chunks_get_keys() -> None:
    assert len(chunk_keys(NS, TOKENS)) == 4
    assert chunk_keys(NS, TOKENS[:31]) == []


def test_key_format_is_pinned() -> None:
    # The key format is a compatibility promise between releases and engines:
    # changing it silently empties every user's pool. Update only with a new prefix.
    keys = chunk_keys(NS, TOKENS)
    assert keys[0].startswith(NS.prefix() + "/") and len(keys[0]) == len("mcv/") + 16 + 1 + 32
    assert NS.describe() == "mcv1|model=tiny-llama|dtype=float32|layout=cpu:float32:L2:2x32x64|bs=32|tp=0/1|pp=0"
    assert keys[0] == "mcv/03d933aae2443d63/a7fead4f4f0456ddf99951c725d0983a"
    assert chunk_digests(TOKENS, 32)[0].hex() == "a7fead4f4f0456ddf99951c725d0983a"


def test_token_encoding_is_pinned_across_the_int64_range() -> None:
    # Each token hashes as 8 little-endian bytes: the values below were computed with the
    # array("q") encoding this replaced, so large vocabularies keep their keys too.
    tokens = [0, 1, 255, 256, 151_935, 2**31, 2**40 + 7, 2**63 - 1] * 4
    assert chunk_hex_digests(tokens, 16) == ["daf49ac9909ec35845303bbef57fa140",
                                              "fe8806fbfd18ff2bb89c0aa9c39dc928"]


def test_chain_depends_on_every_earlier_token() -> None:
    changed = list(TOKENS)
    changed[5] += 1
    a, b = chunk_keys(NS, TOKENS), chunk_keys(NS, changed)
    assert all(x != y for x, y in zip(a, b))
    tail_changed = TOKENS[:96] + [7] * 32
    assert chunk_keys(NS, tail_changed)[:3] == a[:3] and chunk_keys(NS, tail_changed)[3] != a[3]


@pytest.mark.parametrize("field", ["model_id", "dtype", "layout", "block_size", "tp_rank", "pp_rank"])
def test_namespace_fields_separate_keys(field: str) -> None:
    values = NS.__dict__ | {"tp_size": 2}
    base = KeyNamespace(**values)
    other = KeyNamespace(**(values | {field: {"block_size": 16, "tp_rank": 1, "pp_rank": 1}.get(
        field, "other")}))
    assert base.prefix() != other.prefix()


def test_extras_change_keys() -> None:
    plain = chunk_keys(NS, TOKENS)
    assert chunk_keys(NS, TOKENS, RequestExtras(lora_name="a")) != plain
    assert chunk_keys(NS, TOKENS, RequestExtras(cache_salt="s")) != plain
    mm = chunk_keys(NS, TOKENS, RequestExtras(mm_hashes=((40, 10, "img"),)))
    assert mm[0] == plain[0] and mm[1] != plain[1]  # only chunks from the item on change
    assert chunk_keys(NS, TOKENS, RequestExtras()) == plain


def test_a_memo_gives_the_same_digests_and_hashes_a_shared_prefix_once() -> None:
    memo = DigestMemo()
    plain = [d.hex() for d in chunk_digests(TOKENS, 32)]
    assert chunk_hex_digests(TOKENS, 32, memo=memo) == plain
    assert len(memo) == 4
    other = TOKENS[:64] + [9] * 64  # shares two chunks, then differs
    assert chunk_hex_digests(other, 32, memo=memo) == [d.hex() for d in chunk_digests(other, 32)]
    assert len(memo) == 6  # only the two new chunks were hashed
    salted = RequestExtras(cache_salt="s")  # the same tokens under another root: new entries
    assert chunk_hex_digests(TOKENS, 32, salted, memo) == [
        d.hex() for d in chunk_digests(TOKENS, 32, salted)] != plain
    mm = RequestExtras(mm_hashes=((40, 10, "img"),))
    assert chunk_hex_digests(TOKENS, 32, mm, memo) == [d.hex() for d in chunk_digests(TOKENS, 32, mm)]


def _vllm_hashes(tokens: list[int], block_size: int, seed: str = "") -> list[str]:
    """Chained block hashes as vLLM's prefix cache names a prompt's full blocks."""
    out, parent = [], seed
    for i in range(len(tokens) // block_size):
        parent = f"{parent}|{tokens[i * block_size:(i + 1) * block_size]}"
        out.append(parent)
    return out


def test_vllms_block_hashes_find_a_recent_prompts_shared_prefix_without_hashing_it() -> None:
    memo = DigestMemo()
    doc = list(range(5000, 5000 + 32 * 6))
    first, second = doc + [1] * 40, doc + [2] * 40
    assert chunk_hex_digests(first, 32, memo=memo, block_hashes=_vllm_hashes(first, 32)) == [
        d.hex() for d in chunk_digests(first, 32)]
    memo._entries.clear()  # what the second prompt does not hash again cannot come from here
    assert chunk_hex_digests(second, 32, memo=memo, block_hashes=_vllm_hashes(second, 32)) == [
        d.hex() for d in chunk_digests(second, 32)]
    assert len(memo) == 1  # only its own last chunk was hashed


@pytest.mark.parametrize("lie", ["same hashes, other tokens", "same hashes, other salt",
                                 "unhashable hashes", "too few hashes", "multimodal"])
def test_block_hashes_only_point_the_token_bytes_decide(lie: str) -> None:
    """vLLM's hash of a block is a locator, never trusted: a hash that names other tokens
    (a collision, another hash function), another chain root, or one that cannot be a key
    gives the digests the chain computes."""
    memo = DigestMemo()
    doc = list(range(7000, 7000 + 32 * 4))
    hashes: list = _vllm_hashes(doc, 32)
    chunk_hex_digests(doc, 32, memo=memo, block_hashes=hashes)
    memo._entries.clear()
    other, extras = list(doc), None
    if lie == "same hashes, other tokens":
        other[40] += 1
    elif lie == "same hashes, other salt":
        extras = RequestExtras(cache_salt="tenant-b")
    elif lie == "unhashable hashes":
        hashes = [[h] for h in hashes]
    elif lie == "too few hashes":
        hashes = hashes[:2]
    else:
        extras = RequestExtras(mm_hashes=((40, 10, "img"),))
    assert chunk_hex_digests(other, 32, extras, memo, hashes) == [
        d.hex() for d in chunk_digests(other, 32, extras)]


def test_recent_prompts_hold_at_most_the_memos_capacity_in_chunks() -> None:
    memo = DigestMemo(capacity=10)
    for n in range(6):
        tokens = [n] * (32 * 4)
        assert chunk_hex_digests(tokens, 32, memo=memo, block_hashes=_vllm_hashes(tokens, 32)) == [
            d.hex() for d in chunk_digests(tokens, 32)]
        assert memo.prompts._chunks <= 10
    assert len(memo.prompts._by_hash) <= 10


def test_a_full_memo_forgets_its_oldest_and_stays_exact() -> None:
    memo = DigestMemo(capacity=3)
    assert chunk_hex_digests(TOKENS, 32, memo=memo) == [d.hex() for d in chunk_digests(TOKENS, 32)]
    assert len(memo) == 3
    assert chunk_hex_digests(TOKENS, 32, memo=memo) == [d.hex() for d in chunk_digests(TOKENS, 32)]
    with pytest.raises(ValueError, match="capacity"):
        DigestMemo(capacity=0)
    assert DigestMemo.for_block_size(16).capacity == 1 << 16  # small chunks: the entry cap
    assert DigestMemo.for_block_size(128).capacity == (32 << 20) // (8 * 128 + 320)  # 32 MiB


def test_bad_namespaces_rejected() -> None:
    with pytest.raises(ValueError, match="block_size"):
        KeyNamespace("m", "f", "l", 0)
    with pytest.raises(ValueError, match="tp_rank"):
        KeyNamespace("m", "f", "l", 16, tp_rank=2, tp_size=2)


def test_identical_across_interpreters_and_hash_seeds() -> None:
    code = ("import json; from mooncake_vllm.keys import KeyNamespace, RequestExtras, chunk_keys;"
            "ns = KeyNamespace('m', 'bfloat16', 'nhd:bfloat16:L2:2x16x8x64', 16, 1, 2, 0);"
            "print(json.dumps([chunk_keys(ns, list(range(100)), RequestExtras('lora', 'salt')),"
            " hash('None')]))")
    outputs = []
    for seed in ("0", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout
        outputs.append(json.loads(out))
    assert outputs[0][1] != outputs[1][1]  # the seeds really differ for builtin hash()
    assert outputs[0][0] == outputs[1][0] == outputs[2][0]
    assert len(outputs[0][0]) == 6


def test_tenant_and_cache_prefix_compose() -> None:
    """Both join the namespace: sharing needs the same tenant AND the same prefix; the
    digest of a namespace without either is unchanged (existing pools keep their keys)."""
    combos = {(t, p): KeyNamespace(**(NS.__dict__ | {"tenant": t, "cache_prefix": p}))
              for t in ("", "a", "b") for p in ("", "w1", "w2")}
    assert len({ns.prefix() for ns in combos.values()}) == 9
    assert combos[("", "")].prefix() == NS.prefix() == "mcv/03d933aae2443d63"
    assert combos[("a", "w1")].describe().endswith("|bs=32|tp=0/1|pp=0|tenant=a|prefix=w1")
    assert combos[("", "w1")].describe().endswith("|pp=0|prefix=w1")


@pytest.mark.parametrize("field", ["tenant", "cache_prefix", "model_id"])
def test_separator_in_a_text_field_is_refused(field: str) -> None:
    # tenant "a|prefix=b" would otherwise describe (and hash) like tenant "a" + prefix "b"
    with pytest.raises(ValueError, match=field):
        KeyNamespace(**(NS.__dict__ | {field: "a|prefix=b"}))


def test_registry_key_names_its_namespace_and_nothing_else() -> None:
    ns = KeyNamespace(**(NS.__dict__ | {"tenant": "team-a", "cache_prefix": "w2", "tp_size": 2}))
    key = ns.registry_key()
    assert key.startswith(f"{REGISTRY_PREFIX}/{ns.digest()}/") and "|" not in key
    assert parse_registry_key(key) == ns
    forged = f"{REGISTRY_PREFIX}/{NS.digest()}/{key.rsplit('/', 1)[1]}"  # fields of another digest
    for bad in (forged, key[:-4], key + "!", chunk_keys(NS, TOKENS)[0], "mcv-ns/x", "other/key",
                f"{REGISTRY_PREFIX}/{ns.digest()}/bnVsbA"):  # base64 of "null"
        assert parse_registry_key(bad) is None, bad
    assert re.match(ns.pattern(), ns.prefix() + "/" + "0" * 32)
    assert not re.match(ns.pattern(), key) and not re.match(ns.pattern(), NS.prefix() + "/" + "0" * 32)


def test_block_key_digest() -> None:
    assert block_key_digest(chunk_keys(NS, TOKENS)[0]) == NS.digest()
    assert block_key_digest(f"{NS.prefix()}/tail/{'a' * 32}") == NS.digest()  # V0 tails belong too
    for other in (NS.registry_key(), "mcv/short/x", "mcv/03d933aae2443d63", "x/03d933aae2443d63/a"):
        assert block_key_digest(other) is None


def test_tp_shared_namespace_names_no_tp_rank_and_only_rank0_stores() -> None:
    ranks = [KeyNamespace("m", "float32", "hnc:float32:L2:1x16x576", 16, tp_rank=r, tp_size=2,
                          tp_shared=True) for r in (0, 1)]
    assert ranks[0].describe() == ranks[1].describe() == (
        "mcv1|model=m|dtype=float32|layout=hnc:float32:L2:1x16x576|bs=16|tp=shared|pp=0")
    assert ranks[0].prefix() == ranks[1].prefix()
    assert [n.stores for n in ranks] == [True, False]
    per_rank = [KeyNamespace("m", "float32", "hnc:float32:L2:1x16x576", 16, tp_rank=r, tp_size=2)
                for r in (0, 1)]
    assert per_rank[0].prefix() != per_rank[1].prefix() and all(n.stores for n in per_rank)
    assert ranks[0].prefix() not in {n.prefix() for n in per_rank}


def test_parse_reads_back_what_describe_wrote() -> None:
    for ns in (NS, KeyNamespace("m", "bf16", "hnc:bf16:L2:1x16x576", 16, 1, 2, 0, "t", "w1", True),
               KeyNamespace("m", "f", "l", 16, tp_rank=1, tp_size=2, pp_rank=1, tenant="a")):
        back = KeyNamespace.parse(ns.describe())
        assert back.prefix() == ns.prefix()
    with pytest.raises(ValueError, match="not a mooncake-vllm namespace"):
        KeyNamespace.parse("mcv1|model=m")
