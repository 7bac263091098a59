"""Value framing: a 64-byte header in front of every stored block.

The header lets a reader refuse anything that is not exactly what it asked for:
a truncated value, a value of another KV layout, a value stored under another
key, or corrupt bytes. Such a value is a miss, never KV handed to the engine.

Layout (little-endian)::

    0  4s  magic  b"MCVB"
    4  H   format version
    6  H   flags: the checksum kind (0 = xxh3-64, 1 = wsum64)
    8  Q   payload length in bytes
    16 Q   checksum of the payload
    24 16s layout fingerprint digest
    40 16s key digest
    56 8x  padding

Two checksum kinds, one verifier (:func:`verify` reads the kind from the header,
so every reader checks either kind on the host):

* ``xxh3`` — xxh3-64 of the payload; values framed from host memory.
* ``wsum64`` — a positional 64-bit word sum with wraparound,
  ``Σ w_i · (2i + 1) mod 2⁶⁴`` over the payload's little-endian u64 words (zero
  padded). Exact integer arithmetic, so torch on a GPU (:func:`wsum_rows`), torch
  on the CPU and numpy (:func:`checksum_bytes`) compute the same number; every
  single-word change is caught (odd weights are invertible mod 2⁶⁴), and a moved
  word changes its weight. Values of KV caches in CUDA memory carry it: their
  checksum is computed on the GPU, never by reading device memory from the host.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

__all__ = [
    "CHECKSUM_KINDS",
    "WSUM64",
    "XXH3",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MASK64",
    "MAGIC",
    "Header",
    "checksum_bytes",
    "check_header",
    "checksum_segments",
    "digest16",
    "frame_value",
    "pack_header",
    "unframe_value",
    "unpack_header",
    "verify",
    "wsum_rows",
    "wsum_weights",
]

MAGIC = b"MCVB"
FORMAT_VERSION = 1
HEADER_SIZE = 64
_STRUCT = struct.Struct("<4sHHQQ16s16s8x")
assert _STRUCT.size == HEADER_SIZE
#: checksum kinds (the header's flags field)
XXH3 = 0
WSUM64 = 1
CHECKSUM_KINDS = {XXH3: "xxh3", WSUM64: "wsum64"}
MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Header:
    """A decoded value header."""

    version: int
    payload_len: int
    checksum: int
    layout_digest: bytes
    key_digest: bytes
    checksum_kind: int = XXH3


def digest16(text: str) -> bytes:
    """16-byte digest used for layout fingerprints and keys in headers."""
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


_np_weights = np.zeros(0, dtype=np.uint64)


def _weights_np(n: int) -> np.ndarray:
    """``2i + 1`` for ``i < n`` as uint64 (cached, grown on demand)."""
    global _np_weights
    if len(_np_weights) < n:
        _np_weights = np.arange(n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    return _np_weights[:n]


def _wsum_np(data: bytes | memoryview, first_word: int = 0) -> int:
    """wsum64 of ``data`` whose first word sits at position ``first_word``."""
    raw = memoryview(data).cast("B")
    whole = len(raw) // 8 * 8
    words = np.frombuffer(raw[:whole], dtype="<u8")
    total = int(np.dot(words, _weights_np(first_word + len(words))[first_word:])) if whole else 0
    if whole < len(raw):  # zero-padded last word
        last = int.from_bytes(bytes(raw[whole:]), "little")
        total += last * (2 * (first_word + len(words)) + 1)
    return total & MASK64


def checksum_segments(segments: Iterable[tuple[int, int]], kind: int = XXH3) -> int:
    """The checksum of the bytes of host ``(ptr, nbytes)`` segments, in order, without copying."""
    views = [memoryview((ctypes.c_char * n).from_address(p)).cast("B") for p, n in segments]
    if kind == WSUM64:
        if all(len(v) % 8 == 0 for v in views):
            total, pos = 0, 0
            for v in views:
                total += _wsum_np(v, pos)
                pos += len(v) // 8
            return total & MASK64
        return _wsum_np(b"".join(bytes(v) for v in views))
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return h.intdigest()


def checksum_bytes(data: bytes | memoryview, kind: int = XXH3) -> int:
    """The checksum of host bytes (the value payload checksum)."""
    if kind == WSUM64:
        return _wsum_np(data)
    return xxhash.xxh3_64_intdigest(data)


def wsum_weights(nwords: int, device: Any) -> Any:
    """The wsum64 weights ``2i + 1`` as a torch int64 tensor on ``device``."""
    import torch

    return torch.arange(nwords, dtype=torch.int64, device=device) * 2 + 1


def wsum_rows(words: Any, weights: Any) -> Any:
    """Per-row wsum64 contributions of int64 ``words [k, n]``: a torch int64 ``[k]``.

    Integer products and sums wrap modulo 2⁶⁴, so contributions of pieces add up
    (in any order) to the checksum; read one as ``int(v) & (2**64 - 1)``.
    """
    return (words * weights).sum(dim=-1)


def pack_header(payload_len: int, checksum: int, layout_digest: bytes, key_digest: bytes,
                kind: int = XXH3) -> bytes:
    """Encode a header (``kind``: the checksum kind)."""
    return _STRUCT.pack(MAGIC, FORMAT_VERSION, kind, payload_len, checksum & MASK64,
                        layout_digest, key_digest)


def unpack_header(raw: bytes | memoryview) -> Header | None:
    """Decode a header, or ``None`` if ``raw`` is not one of ours."""
    if len(raw) < HEADER_SIZE:
        return None
    magic, version, flags, length, checksum, layout, key = _STRUCT.unpack_from(raw)
    if magic != MAGIC:
        return None
    return Header(version, length, checksum, layout, key, flags)


def check_header(raw_header: bytes | memoryview, payload_len: int, *, layout_digest: bytes,
                 key_digest: bytes) -> tuple[Header | None, str | None]:
    """Everything but the checksum: ``(header, None)`` if it may be this key's value."""
    header = unpack_header(raw_header)
    if header is None:
        return None, "not a mooncake-vllm value (bad magic)"
    if header.version != FORMAT_VERSION:
        return header, f"value format {header.version}, expected {FORMAT_VERSION}"
    if header.layout_digest != layout_digest:
        return header, "value of another KV layout"
    if header.key_digest != key_digest:
        return header, "value stored under another key"
    if header.checksum_kind not in CHECKSUM_KINDS:
        return header, f"unknown checksum kind {header.checksum_kind}"
    if header.payload_len != payload_len:
        return header, f"payload of {header.payload_len} bytes, expected {payload_len}"
    return header, None


def verify(
    raw_header: bytes | memoryview,
    segments: list[tuple[int, int]],
    *,
    layout_digest: bytes,
    key_digest: bytes,
) -> str | None:
    """Check a read value in host memory; ``None`` if good, else the reason it is a miss."""
    header, reason = check_header(raw_header, sum(n for _, n in segments),
                                  layout_digest=layout_digest, key_digest=key_digest)
    if header is None or reason:
        return reason
    if checksum_segments(segments, header.checksum_kind) != header.checksum:
        return "checksum mismatch (corrupt value)"
    return None


_VALUE_LAYOUT = digest16("mooncake-vllm/value")


def frame_value(key: str, data: bytes | memoryview) -> bytes:
    """A small value (not a KV block, e.g. a V0 prompt tail) with its header in front."""
    payload = bytes(data)
    return pack_header(len(payload), checksum_bytes(payload), _VALUE_LAYOUT, digest16(key)) + payload


def unframe_value(key: str, raw: bytes | memoryview) -> bytes | None:
    """The payload of :func:`frame_value` output stored under ``key``, or ``None`` if damaged."""
    header = unpack_header(raw)
    payload = bytes(raw[HEADER_SIZE:])
    if (header is None or header.layout_digest != _VALUE_LAYOUT
            or header.key_digest != digest16(key) or header.payload_len != len(payload)
            or header.checksum != checksum_bytes(payload, header.checksum_kind)):
        return None
    return payload
