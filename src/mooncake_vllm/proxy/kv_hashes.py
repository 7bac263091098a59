"""A prompt's block hashes computed the way the target vLLM computes them.

vLLM (>= 0.10.2) hashes block ``i`` as ``hash_fn((parent, tuple(tokens_i), extra_keys))``
with ``parent`` = the previous block's hash, or ``NONE_HASH = hash_fn(seed)`` for the
first block. Which ``hash_fn`` and which seed come from the facts table
(``default_hash_algorithm``, ``hash_algorithms``, ``v1_hash_seed``): where the seed is
per-process (unset ``PYTHONHASHSEED`` on releases that need it, xxhash without it)
no outside process can predict the hashes and :func:`hasher_for` says why.

The guess is checked against the instances' own events: a ``BlockStored`` whose
first block has no parent names its tokens, so :meth:`PromptHasher.matches` can
recompute its hashes exactly (:func:`detect`). Prompts with extra keys (LoRA,
multimodal, ``cache_salt``) hash differently; the policy does not predict them.
vLLM >= 0.32 publishes ``extra_keys`` per block, ``[None, None, ...]`` when there are
none: :func:`has_extra_keys` is the one test for "this event has extra keys".
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_vllm.compat.versions import vllm_facts
from mooncake_vllm.proxy.kv_index import norm_hash

__all__ = ["ALGORITHMS", "PromptHasher", "detect", "has_extra_keys", "hash_function", "hasher_for"]

#: vLLM's ``DEFAULT_NONE_HASH_SEED`` (releases whose ``v1_hash_seed`` is ``deterministic``)
DEFAULT_SEED = "vllm-none-hash"
ALGORITHMS: tuple[str, ...] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def _pickled(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(value: Any) -> bytes:
    import cbor2

    return cbor2.dumps(value, canonical=True)


def _xxh(data: bytes) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(data)


def hash_function(name: str) -> Callable[[Any], bytes]:
    """vLLM's ``get_hash_fn_by_name`` without importing vLLM; ``ValueError`` for others."""
    fns: dict[str, Callable[[Any], bytes]] = {
        "sha256": lambda v: hashlib.sha256(_pickled(v)).digest(),
        "sha256_cbor": lambda v: hashlib.sha256(_cbor(v)).digest(),
        "xxhash": lambda v: _xxh(_pickled(v)),
        "xxhash_cbor": lambda v: _xxh(_cbor(v)),
    }
    try:
        return fns[name]
    except KeyError:
        raise ValueError(f"hash algorithm {name!r} is not one the proxy can compute "
                         f"(one of {', '.join(ALGORITHMS)})") from None


def has_extra_keys(event: Mapping[str, Any]) -> bool:
    """Whether a ``BlockStored`` event's blocks were hashed with extra keys: ``extra_keys``
    absent, None, empty or all None (vLLM 0.32: one entry per block) means none."""
    keys = event.get("extra_keys")
    if keys is None:
        return False
    if isinstance(keys, (list, tuple)):
        return any(k is not None for k in keys)
    return True


@dataclass(frozen=True)
class PromptHasher:
    """Block hashes of token sequences for one algorithm and seed."""

    algorithm: str
    seed: str

    def _fn(self) -> Callable[[Any], bytes]:
        return hash_function(self.algorithm)

    def raw_hashes(self, tokens: Sequence[int], block_size: int,
                   parent: bytes | None = None) -> list[bytes]:
        """Full-block hashes (bytes, as vLLM keeps them) of ``tokens``."""
        fn = self._fn()
        prev = parent if parent else fn(self.seed)
        out: list[bytes] = []
        for start in range(0, len(tokens) - block_size + 1, block_size):
            prev = fn((prev, tuple(tokens[start:start + block_size]), None))
            out.append(prev)
        return out

    def block_hashes(self, tokens: Sequence[int], block_size: int) -> list[int]:
        """Normalised (:func:`norm_hash`) full-block hashes of a prompt."""
        return [norm_hash(h) for h in self.raw_hashes(tokens, block_size)]

    def matches(self, event: Mapping[str, Any]) -> bool | None:
        """Whether this hasher reproduces a ``BlockStored`` event; None when it cannot tell
        (a parent hash: only the first blocks of a prompt can be recomputed, or extra keys)."""
        if event.get("parent_block_hash") is not None or has_extra_keys(event) or event.get("lora_name"):
            return None
        size, tokens, published = event.get("block_size"), event.get("token_ids"), event.get("block_hashes")
        if not isinstance(size, int) or size <= 0 or not tokens or not published:
            return None
        ours = self.block_hashes(tokens, size)
        return ours[: len(published)] == [norm_hash(h) for h in published]


def hasher_for(vllm_version: str, env: Mapping[str, str],
               algorithm: str | None = None) -> tuple[list[PromptHasher], str]:
    """The hashers that may match instances of ``vllm_version`` (default algorithm first),
    or ``([], why)`` when their hashes cannot be predicted from outside."""
    facts = vllm_facts(vllm_version, strict=False)
    seed = env.get("PYTHONHASHSEED")
    mode = facts.v1_hash_seed
    names = [algorithm] if algorithm else [facts.default_hash_algorithm,
                                           *(a for a in facts.hash_algorithms if a != facts.default_hash_algorithm)]
    names = [n for n in names if n in ALGORITHMS]
    where = f"vLLM {facts.version}"
    if not facts.sha256_kv_events and any(n.startswith("sha256") for n in names):
        names = [n for n in names if not n.startswith("sha256")]
        if not names:
            return [], (f"{where} publishes KV events only for its builtin block hash, which no other "
                        "process can reproduce (its sha256 hashes are 256-bit ints its event publisher "
                        "cannot send: the publisher stops); kv_aware needs vLLM >= 0.10.2")
    if not names:
        return [], f"{where} hashes blocks with {facts.default_hash_algorithm!r}, which no other process can reproduce"
    if mode in ("unstable", "inverted"):
        return [], f"{where} draws its block-hash seed per process"
    out: list[PromptHasher] = []
    for name in names:
        if seed is not None:
            out.append(PromptHasher(name, seed))
        elif mode == "deterministic" and not name.startswith("xxhash"):
            out.append(PromptHasher(name, DEFAULT_SEED))
    if not out:
        return [], (f"{where} seeds its block hashes per process unless PYTHONHASHSEED is set "
                    "(PYTHONHASHSEED is unset for the proxy); set the same PYTHONHASHSEED for the "
                    "proxy and every instance")
    return out, ""


def detect(hashers: Sequence[PromptHasher], event: Mapping[str, Any]) -> PromptHasher | None | bool:
    """The first hasher that reproduces ``event``; None if the event cannot tell,
    False if it can and none matches."""
    verdicts = [h.matches(event) for h in hashers]
    if all(v is None for v in verdicts):
        return None
    for h, v in zip(hashers, verdicts):
        if v:
            return h
    return False
