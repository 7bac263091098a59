"""Stable block keys: the same key for the same KV in every process, host, DP rank,
vLLM version and engine (V0 or V1), with no dependency on ``PYTHONHASHSEED``.

A key names one FULL chunk of ``block_size`` tokens::

    mcv/<namespace digest>/<chained chunk digest>

* The namespace digest covers what makes two blocks' bytes comparable: model id,
  dtype, KV layout fingerprint, block size, TP rank and size, PP rank. DP ranks
  share keys (they serve the same model with the same layout).
* The chunk digest chains ``blake2b(parent || extras || tokens as int64 LE)`` so a
  chunk's key depends on every token before it; request-level extras (LoRA,
  cache salt) seed the chain and multimodal hashes join the chunks they overlap.
"""

from __future__ import annotations

import hashlib
import os
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from mooncake_vllm.errors import UnsafeHashingError

__all__ = [
    "KEY_PREFIX",
    "KeyNamespace",
    "RequestExtras",
    "check_vllm_hash_determinism",
    "chunk_digests",
    "chunk_keys",
    "model_id",
]

KEY_PREFIX = "mcv"
_CHAIN_ROOT = b"mooncake-vllm/v1"
_DIGEST_SIZE = 16


@dataclass(frozen=True)
class RequestExtras:
    """Inputs besides token ids that change a request's KV."""

    lora_name: str | None = None
    cache_salt: str | None = None
    #: (offset, length, hash) of each multimodal item in the prompt
    mm_hashes: tuple[tuple[int, int, str], ...] = ()


@dataclass(frozen=True)
class KeyNamespace:
    """What must match for two stored blocks to be interchangeable."""

    model_id: str
    dtype: str
    layout: str
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, found {self.block_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")
        if self.pp_rank < 0:
            raise ValueError(f"pp_rank must not be negative, found {self.pp_rank}")

    def describe(self) -> str:
        """The human-readable namespace string the digest is taken of."""
        return (f"mcv1|model={self.model_id}|dtype={self.dtype}|layout={self.layout}"
                f"|bs={self.block_size}|tp={self.tp_rank}/{self.tp_size}|pp={self.pp_rank}")

    def prefix(self) -> str:
        """``mcv/<16 hex digits>``: the key prefix of this namespace."""
        digest = hashlib.blake2b(self.describe().encode(), digest_size=8).hexdigest()
        return f"{KEY_PREFIX}/{digest}"


def model_id(vllm_config: Any) -> str:
    """The namespace's model name, the same for V0 and V1 engines:
    ``kv_connector_extra_config["model_id"]`` or the last path component of the model."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    if extra.get("model_id"):
        return str(extra["model_id"])
    return PurePath(str(vllm_config.model_config.model).rstrip("/")).name


def _token_bytes(tokens: Sequence[int]) -> bytes:
    arr = array("q", tokens)
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        arr.byteswap()
    return arr.tobytes()


def _root(extras: RequestExtras | None) -> bytes:
    h = hashlib.blake2b(_CHAIN_ROOT, digest_size=_DIGEST_SIZE)
    if extras is not None:
        if extras.lora_name:
            h.update(b"\x00lora=" + extras.lora_name.encode())
        if extras.cache_salt:
            h.update(b"\x00salt=" + extras.cache_salt.encode())
    return h.digest()


def _chunk_extras(extras: RequestExtras | None, start: int, end: int) -> bytes:
    if extras is None or not extras.mm_hashes:
        return b""
    parts = [
        f"{offset}:{length}:{mm_hash}".encode()
        for offset, length, mm_hash in extras.mm_hashes
        if offset < end and offset + length > start
    ]
    return b"\x00mm=" + b",".join(parts) if parts else b""


def chunk_digests(
    token_ids: Sequence[int], block_size: int, extras: RequestExtras | None = None
) -> list[bytes]:
    """Chained digests of every full chunk of ``token_ids`` (the tail is left out)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, found {block_size}")
    full = len(token_ids) // block_size
    data = _token_bytes(token_ids[: full * block_size])
    parent = _root(extras)
    width = 8 * block_size
    digests: list[bytes] = []
    for i in range(full):
        h = hashlib.blake2b(parent, digest_size=_DIGEST_SIZE)
        h.update(_chunk_extras(extras, i * block_size, (i + 1) * block_size))
        h.update(data[i * width:(i + 1) * width])
        parent = h.digest()
        digests.append(parent)
    return digests


def chunk_keys(
    ns: KeyNamespace, token_ids: Sequence[int], extras: RequestExtras | None = None
) -> list[str]:
    """The store key of every full chunk of ``token_ids`` in namespace ``ns``."""
    prefix = ns.prefix()
    return [f"{prefix}/{d.hex()}" for d in chunk_digests(token_ids, ns.block_size, extras)]


_SEED_FIX = ("set PYTHONHASHSEED=0 in every instance's environment before it starts "
             "(setting it inside a running process is too late)")


def check_vllm_hash_determinism(
    vllm_version: str, hash_algorithm: str | None = None, env: Mapping[str, str] | None = None
) -> None:
    """Refuse setups whose vLLM block hashes differ between processes.

    Only matters where vLLM's OWN block hashes name stored data (e.g. sharing a
    pool with vLLM's in-tree connector); mooncake-vllm's keys never depend on them.
    Raises :class:`UnsafeHashingError` with the exact fix.
    """
    from mooncake_vllm.compat.versions import vllm_facts

    env = os.environ if env is None else env
    facts = vllm_facts(vllm_version)
    algo = hash_algorithm or facts.default_hash_algorithm
    seed = env.get("PYTHONHASHSEED")
    seeded = seed is not None and seed != "random"
    where = f"vLLM {facts.version} with --prefix-caching-hash-algo {algo}"
    if algo == "builtin" and sys.version_info < (3, 12):
        raise UnsafeHashingError(
            f"{where}: builtin hash(None) depends on object addresses on CPython "
            f"{sys.version_info.major}.{sys.version_info.minor}, so hashes differ between "
            f"processes even with PYTHONHASHSEED; start vLLM with --prefix-caching-hash-algo sha256")
    mode = facts.v1_hash_seed
    if mode == "unstable":
        raise UnsafeHashingError(f"{where}: block hashes are per-process in this release; "
                                 f"upgrade vLLM (0.10.2+ hashes with sha256) or use "
                                 f"mooncake-vllm's own keys")
    if mode == "inverted" and seed is not None:
        raise UnsafeHashingError(
            f"{where}: this release draws a random root hash exactly when PYTHONHASHSEED IS "
            f"set (found PYTHONHASHSEED={seed!r}); unset it in every instance's environment")
    needs_seed = mode == "seed-required" or (mode == "deterministic" and algo.startswith("xxhash"))
    if needs_seed and not seeded:
        found = "unset" if seed is None else f"PYTHONHASHSEED={seed!r}"
        raise UnsafeHashingError(f"{where}: block hashes differ per process unless every "
                                 f"instance shares one PYTHONHASHSEED ({found}); {_SEED_FIX}")
