"""Stable block keys: the same key for the same KV in every process, host, DP rank,
vLLM version and engine (V0 or V1), with no dependency on ``PYTHONHASHSEED``.

A key names one FULL chunk of ``block_size`` tokens::

    mcv/<namespace digest>/<chained chunk digest>

* The namespace digest covers what makes two blocks' bytes comparable: model id,
  dtype, KV layout fingerprint, block size, TP rank and size, PP rank. DP ranks
  share keys (they serve the same model with the same layout). A ``tenant_id``
  (Mooncake config) joins the namespace, so two tenants never read each other's
  blocks; it composes with the per-request cache salt, which seeds the chain.
* The chunk digest chains ``blake2b(parent || extras || tokens as int64 LE)`` so a
  chunk's key depends on every token before it; request-level extras (LoRA,
  cache salt) seed the chain and multimodal hashes join the chunks they overlap.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePath

__all__ = [
    "HANDOFF_PARAM",
    "KEY_PREFIX",
    "KeyNamespace",
    "RequestExtras",
    "chunk_digests",
    "chunk_keys",
    "handoff_key",
    "model_id",
]

KEY_PREFIX = "mcv"
#: the entry of vLLM's ``kv_transfer_params`` that carries a prefill → decode hand-off
HANDOFF_PARAM = "mooncake_vllm_handoff"
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
    #: ``tenant_id`` of the Mooncake config; "" = no tenant (keys as before tenants existed)
    tenant: str = ""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, found {self.block_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")
        if self.pp_rank < 0:
            raise ValueError(f"pp_rank must not be negative, found {self.pp_rank}")

    def describe(self) -> str:
        """The human-readable namespace string the digest is taken of."""
        text = (f"mcv1|model={self.model_id}|dtype={self.dtype}|layout={self.layout}"
                f"|bs={self.block_size}|tp={self.tp_rank}/{self.tp_size}|pp={self.pp_rank}")
        return f"{text}|tenant={self.tenant}" if self.tenant else text

    def prefix(self) -> str:
        """``mcv/<16 hex digits>``: the key prefix of this namespace."""
        digest = hashlib.blake2b(self.describe().encode(), digest_size=8).hexdigest()
        return f"{KEY_PREFIX}/{digest}"


def handoff_key(prefix: str, handoff_id: str) -> str:
    """The marker a prefill worker publishes once every block of hand-off ``handoff_id``
    in namespace ``prefix`` (:meth:`KeyNamespace.prefix`) is committed: ``mcv/<ns>/handoff/<id>``.
    Chunk keys are ``mcv/<ns>/<32 hex>``, so the two never collide."""
    if not handoff_id or not all(c in "0123456789abcdef" for c in handoff_id):
        raise ValueError(f"a hand-off id is lowercase hex, found {handoff_id!r}")
    return f"{prefix}/handoff/{handoff_id}"


def model_id(model: str, configured: str | None = None) -> str:
    """The namespace's model name, the same for V0 and V1 engines: ``configured``
    (``kv_connector_extra_config["model_id"]``) or the last path component of ``model``."""
    if configured:
        return str(configured)
    return PurePath(str(model).rstrip("/")).name


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
