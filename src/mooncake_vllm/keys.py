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
import struct
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
    """Each token as 8 little-endian bytes (``struct`` packs a list of ints ~3x faster than
    ``array("q", ...)``, which converts element by element through the generic path)."""
    return struct.pack(f"<{len(tokens)}q", *tokens)


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

    Where the caller passes vLLM's block hashes of the prompt, a whole shared prefix is
    found at once (:class:`_Prompts`): vLLM's hash of its last block locates a recent prompt
    that began the same way, and that prompt's token bytes (and chain root) compared with
    these decide; the locator only points, the bytes prove, so vLLM's hash function and
    its collisions do not matter.
    """

    __slots__ = ("capacity", "_entries", "prompts")

    #: Python's own bytes per entry beside the chunk's token bytes (tuples, the digest, its hex)
    ENTRY_OVERHEAD = 320

    @classmethod
    def for_block_size(cls, block_size: int, budget: int = 32 << 20) -> DigestMemo:
        """A memo of at most ``budget`` bytes (entries hold a chunk's 8 bytes per token), and
        at most 65536 entries (a million tokens of prefixes at block size 16); its recent
        prompts hold as many chunks (their token bytes and a pointer each: about half that)."""
        return cls(max(1, min(1 << 16, budget // (8 * block_size + cls.ENTRY_OVERHEAD))))

    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, found {capacity}")
        self.capacity = capacity
        #: inputs -> (digest, its hex)
        self._entries: dict[tuple[bytes, bytes, bytes], tuple[bytes, str]] = {}
        #: recent prompts' chains, found by vLLM's block hashes (at most ``capacity`` chunks)
        self.prompts = _Prompts(capacity)

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


class _Prompt:
    """One prompt's chain: its root, its full chunks' token bytes, ``(digest, hex)`` each."""

    __slots__ = ("root", "data", "entries", "located_by")

    def __init__(self, root: bytes, data: bytes, entries: list[tuple[bytes, str]],
                 located_by: list[object]) -> None:
        self.root = root
        self.data = data
        self.entries = entries
        self.located_by = located_by  #: the block hashes that point here


class _Prompts:
    """Recent prompts' chains by vLLM's block hash of each block they were the first to chain.

    A prompt that shares its first ``n`` chunks with a recent one takes those chunks'
    entries from it when vLLM's hash of its block ``n - 1`` points there, both chains have
    the same root and the two prompts' first ``n`` chunks are the same bytes: then the
    entries are what the chain would compute (a chunk's digest depends on the root and
    the tokens up to it only). Bounded by ``capacity`` chunks, the oldest prompt first."""

    __slots__ = ("capacity", "_by_hash", "_prompts", "_chunks")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._by_hash: dict[object, tuple[int, _Prompt]] = {}
        self._prompts: dict[int, _Prompt] = {}  # by id, oldest first
        self._chunks = 0

    def shared(self, hashes: Sequence[object], root: bytes, data: bytes,
               width: int) -> list[tuple[bytes, str]]:
        """The entries of the longest prefix of ``data`` (``width`` bytes a chunk) a recent
        prompt chained, found by ``hashes`` (vLLM's, block ``i`` ending chunk ``i``)."""
        by_hash = self._by_hash
        try:
            for i in range(min(len(hashes), len(data) // width) - 1, -1, -1):
                found = by_hash.get(hashes[i])
                if found is None:
                    continue
                index, prompt = found
                end = (i + 1) * width
                if index != i or prompt.root != root or prompt.data[:end] != data[:end]:
                    return []  # vLLM's hash points elsewhere: chain it
                self._prompts[id(prompt)] = self._prompts.pop(id(prompt))  # used: kept longest
                return prompt.entries[:i + 1]
        except TypeError:  # an unhashable block hash (a release's own type): chain it
            return []
        return []

    def add(self, hashes: Sequence[object], root: bytes, data: bytes,
            entries: list[tuple[bytes, str]], first_new: int) -> None:
        """Remember a chained prompt; its blocks from ``first_new`` on point here."""
        if first_new >= len(entries) or len(entries) > self.capacity:
            return
        located_by = list(hashes[first_new:len(entries)])
        try:
            for block_hash in located_by:
                hash(block_hash)
        except TypeError:  # an unhashable block hash (a release's own type): not located
            return
        prompt = _Prompt(root, data, entries, located_by)
        for i, block_hash in enumerate(located_by, first_new):
            self._by_hash[block_hash] = (i, prompt)
        self._prompts[id(prompt)] = prompt
        self._chunks += len(entries)
        while self._chunks > self.capacity:
            self._forget(self._prompts.pop(next(iter(self._prompts))))

    def _forget(self, prompt: _Prompt) -> None:
        self._chunks -= len(prompt.entries)
        for block_hash in prompt.located_by:
            found = self._by_hash.get(block_hash)
            if found is not None and found[1] is prompt:
                del self._by_hash[block_hash]


def _chain(token_ids: Sequence[int], block_size: int, extras: RequestExtras | None,
           memo: DigestMemo, block_hashes: Sequence[object] = ()) -> list[tuple[bytes, str]]:
    """``(digest, hex)`` of every full chunk of ``token_ids``, chained (see the module)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, found {block_size}")
    full = len(token_ids) // block_size
    data = _token_bytes(token_ids[: full * block_size])
    root = _root(extras)
    width = 8 * block_size
    multimodal = extras is not None and bool(extras.mm_hashes)
    located = len(block_hashes) >= full and not multimodal
    entries = memo.prompts.shared(block_hashes, root, data, width) if located else []
    parent = entries[-1][0] if entries else root
    recall, remember = memo._entries.get, memo.put  # the dict's own get: no call between
    first_new = len(entries)
    for i in range(first_new, full):
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
    if located:
        memo.prompts.add(block_hashes, root, data, entries, first_new)
    return entries


def chunk_digests(
    token_ids: Sequence[int], block_size: int, extras: RequestExtras | None = None
) -> list[bytes]:
    """Chained digests of every full chunk of ``token_ids`` (the tail is left out)."""
    return [digest for digest, _ in _chain(token_ids, block_size, extras, DigestMemo())]


def chunk_hex_digests(token_ids: Sequence[int], block_size: int,
                      extras: RequestExtras | None = None,
                      memo: DigestMemo | None = None,
                      block_hashes: Sequence[object] = ()) -> list[str]:
    """:func:`chunk_digests` as hex strings (what a key names); ``memo``: recent ones
    reused (the same values, computed once per process), a recent prompt's shared prefix
    found at once by vLLM's ``block_hashes`` of these tokens (block ``i`` ending chunk ``i``;
    they only point, the token bytes decide)."""
    return [text for _, text in _chain(token_ids, block_size, extras,
                                          memo if memo is not None else DigestMemo(),
                                          block_hashes)]


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
