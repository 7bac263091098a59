"""Stable block keys: the same key for the same KV in every process, host, DP rank,
vLLM version and engine (V0 or V1), with no dependency on ``PYTHONHASHSEED``.

A key names one FULL chunk of ``block_size`` tokens::

    mcv/<namespace digest>/<chained chunk digest>

* The namespace digest covers what makes two blocks' bytes comparable: model id,
  dtype, KV layout fingerprint, block size, TP rank and size, PP rank. DP ranks
  share keys (they serve the same model with the same layout). Where every TP
  rank holds the same bytes (MLA's latent KV: ``tp_shared``) the namespace names
  no TP rank or size: the block is stored once, by TP rank 0, and every rank
  reads the same key. A ``tenant_id``
  (Mooncake config) joins the namespace, so two tenants never read each other's
  blocks; it composes with the per-request cache salt, which seeds the chain. A
  ``cache_prefix`` (``kv_connector_extra_config``, as in vLLM's in-tree store
  connector) joins it after the tenant: the same tenant with another prefix (e.g.
  another weights version) never shares blocks either.
* A namespace registers itself under ``mcv-ns/<digest>/<fields as base64url JSON>``
  (:meth:`KeyNamespace.registry_key`): a pool listing alone names every namespace
  present and its fields (``mooncake-vllm pool namespaces``) without reading a value.
* The chunk digest chains ``blake2b(parent || extras || tokens as int64 LE)`` so a
  chunk's key depends on every token before it; request-level extras (LoRA,
  cache salt) seed the chain and multimodal hashes join the chunks they overlap.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import sys
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import PurePath

__all__ = [
    "KEY_PREFIX",
    "REGISTRY_PREFIX",
    "KeyNamespace",
    "RequestExtras",
    "DigestMemo",
    "block_key_digest",
    "chunk_digests",
    "chunk_hex_digests",
    "chunk_keys",
    "model_id",
    "parse_registry_key",
    "seen_key",
]

KEY_PREFIX = "mcv"
#: where namespaces register themselves (never matched by a block-key pattern)
REGISTRY_PREFIX = "mcv-ns"
#: any value of a namespace: ``mcv/<digest>/<chunk>`` or V0's ``mcv/<digest>/tail/<prompt>``
_NAMESPACE_KEY = re.compile(r"mcv/([0-9a-f]{16})/.+", re.DOTALL)
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
    #: ``cache_prefix`` of ``kv_connector_extra_config``; "" = none
    cache_prefix: str = ""
    #: every TP rank holds identical KV (MLA): one key for all ranks, stored by rank 0
    tp_shared: bool = False

    def __post_init__(self) -> None:
        for name in ("model_id", "tenant", "cache_prefix"):
            if "|" in getattr(self, name) or not getattr(self, name).isprintable():
                # "|" separates the described fields: a tenant "a|prefix=b" would share
                # the digest of tenant "a" with prefix "b"
                raise ValueError(f"{name} must be printable text without '|', "
                                 f"found {getattr(self, name)!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, found {self.block_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")
        if self.pp_rank < 0:
            raise ValueError(f"pp_rank must not be negative, found {self.pp_rank}")

    def describe(self) -> str:
        """The human-readable namespace string the digest is taken of."""
        tp = "shared" if self.tp_shared else f"{self.tp_rank}/{self.tp_size}"
        text = (f"mcv1|model={self.model_id}|dtype={self.dtype}|layout={self.layout}"
                f"|bs={self.block_size}|tp={tp}|pp={self.pp_rank}")
        if self.tenant:
            text += f"|tenant={self.tenant}"
        return f"{text}|prefix={self.cache_prefix}" if self.cache_prefix else text

    def digest(self) -> str:
        """16 hex digits naming this namespace (blake2b of :meth:`describe`)."""
        return hashlib.blake2b(self.describe().encode(), digest_size=8).hexdigest()

    @classmethod
    def parse(cls, text: str) -> KeyNamespace:
        """The namespace a :meth:`describe` string names (as logged at start)."""
        head, *parts = text.split("|")
        fields = dict(part.split("=", 1) for part in parts if "=" in part)
        if head != "mcv1" or not {"model", "dtype", "layout", "bs", "tp", "pp"} <= set(fields):
            raise ValueError(f"not a mooncake-vllm namespace description: {text!r}")
        shared = fields["tp"] == "shared"
        rank, size = (0, 1) if shared else (int(n) for n in fields["tp"].split("/"))
        return cls(fields["model"], fields["dtype"], fields["layout"], int(fields["bs"]), rank,
                   size, int(fields["pp"]), tenant=fields.get("tenant", ""),
                   cache_prefix=fields.get("prefix", ""), tp_shared=shared)

    @property
    def stores(self) -> bool:
        """Whether this rank puts blocks: every rank, or only TP rank 0 of a shared namespace."""
        return not self.tp_shared or self.tp_rank == 0

    def prefix(self) -> str:
        """``mcv/<16 hex digits>``: the key prefix of this namespace."""
        return f"{KEY_PREFIX}/{self.digest()}"

    def pattern(self) -> str:
        """A regular expression matching exactly this namespace's block keys."""
        return f"^{KEY_PREFIX}/{self.digest()}/"

    def registry_key(self) -> str:
        """``mcv-ns/<digest>/<fields>``: the key announcing this namespace in the pool."""
        fields = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        encoded = base64.urlsafe_b64encode(fields).decode().rstrip("=")
        return f"{REGISTRY_PREFIX}/{self.digest()}/{encoded}"


def parse_registry_key(key: str) -> KeyNamespace | None:
    """The namespace a :meth:`KeyNamespace.registry_key` names; ``None`` for any other
    key, a damaged one, or one whose fields do not hash to its digest."""
    head, sep, rest = key.partition("/")
    digest, sep2, encoded = rest.partition("/")
    if head != REGISTRY_PREFIX or not sep or not sep2:
        return None
    try:
        raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
        ns = KeyNamespace(**json.loads(raw))
    except (binascii.Error, ValueError, TypeError, AttributeError, RecursionError):
        return None
    return ns if ns.digest() == digest else None


def block_key_digest(key: str) -> str | None:
    """The namespace digest of a value key ``mcv/<16 hex>/...`` (blocks, V0 tails), else ``None``."""
    m = _NAMESPACE_KEY.fullmatch(key)
    return m.group(1) if m else None


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


class DigestMemo:
    """Recent chunk digests by their exact inputs (parent digest, extras, token bytes).

    Prompts that share a prefix (a document, a system prompt, a conversation's earlier
    turns) hash it once per process: a hit is a dict lookup on the very bytes the digest
    would hash (keys compare by equality, so a hit is never a collision). Bounded: past
    ``capacity`` entries the oldest are forgotten. Not thread-safe (one per scheduler).
    """

    __slots__ = ("capacity", "_entries")

    #: Python's own bytes per entry beside the chunk's token bytes (tuples, the digest, its hex)
    ENTRY_OVERHEAD = 320

    @classmethod
    def for_block_size(cls, block_size: int, budget: int = 32 << 20) -> DigestMemo:
        """A memo of at most ``budget`` bytes (entries hold a chunk's 8 bytes per token), and
        at most 65536 entries (a million tokens of prefixes at block size 16)."""
        return cls(max(1, min(1 << 16, budget // (8 * block_size + cls.ENTRY_OVERHEAD))))

    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, found {capacity}")
        self.capacity = capacity
        #: inputs -> (digest, its hex)
        self._entries: dict[tuple[bytes, bytes, bytes], tuple[bytes, str]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, inputs: tuple[bytes, bytes, bytes]) -> tuple[bytes, str] | None:
        """``(digest, hex)`` of these inputs, if computed recently."""
        return self._entries.get(inputs)

    def put(self, inputs: tuple[bytes, bytes, bytes], digest: bytes) -> tuple[bytes, str]:
        """Remember ``digest`` of ``inputs``; the entry ``(digest, hex)``."""
        entries = self._entries
        if len(entries) >= self.capacity:
            del entries[next(iter(entries))]  # the oldest (dicts keep insertion order)
        entry = entries[inputs] = (digest, digest.hex())
        return entry


def _chain(token_ids: Sequence[int], block_size: int, extras: RequestExtras | None,
           memo: DigestMemo) -> list[tuple[bytes, str]]:
    """``(digest, hex)`` of every full chunk of ``token_ids``, chained (see the module)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, found {block_size}")
    full = len(token_ids) // block_size
    data = _token_bytes(token_ids[: full * block_size])
    parent = _root(extras)
    width = 8 * block_size
    multimodal = extras is not None and bool(extras.mm_hashes)
    recall, remember = memo._entries.get, memo.put  # the dict's own get: no call between
    entries: list[tuple[bytes, str]] = []
    for i in range(full):
        chunk_extras = (_chunk_extras(extras, i * block_size, (i + 1) * block_size)
                        if multimodal else b"")
        inputs = (parent, chunk_extras, data[i * width:(i + 1) * width])
        entry = recall(inputs)
        if entry is None:
            h = hashlib.blake2b(parent, digest_size=_DIGEST_SIZE)
            h.update(chunk_extras)
            h.update(inputs[2])
            entry = remember(inputs, h.digest())
        parent = entry[0]
        entries.append(entry)
    return entries


def chunk_digests(
    token_ids: Sequence[int], block_size: int, extras: RequestExtras | None = None
) -> list[bytes]:
    """Chained digests of every full chunk of ``token_ids`` (the tail is left out)."""
    return [digest for digest, _ in _chain(token_ids, block_size, extras, DigestMemo())]


def chunk_hex_digests(token_ids: Sequence[int], block_size: int,
                      extras: RequestExtras | None = None,
                      memo: DigestMemo | None = None) -> list[str]:
    """:func:`chunk_digests` as hex strings (what a key names); ``memo``: recent ones
    reused (the same values, computed once per process)."""
    return [text for _, text in _chain(token_ids, block_size, extras,
                                          memo if memo is not None else DigestMemo())]


def seen_key(block_key: str) -> str:
    """The mark a first save of chunk ``block_key`` (``mcv/<ns>/<32 hex>``) leaves under
    ``save_admission: "repeat"``: ``mcv/<ns>/seen/<32 hex>`` — in the namespace (removed
    with it), never a chunk key, never read as KV."""
    prefix, _, digest = block_key.rpartition("/")
    if not prefix or not digest:
        raise ValueError(f"not a chunk key: {block_key!r}")
    return f"{prefix}/seen/{digest}"


def chunk_keys(
    ns: KeyNamespace, token_ids: Sequence[int], extras: RequestExtras | None = None
) -> list[str]:
    """The store key of every full chunk of ``token_ids`` in namespace ``ns``."""
    prefix = ns.prefix()
    return [f"{prefix}/{d}" for d in chunk_hex_digests(token_ids, ns.block_size, extras)]
