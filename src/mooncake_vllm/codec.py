"""Value framing: a 64-byte header in front of every stored block.

The header lets a reader refuse anything that is not exactly what it asked for:
a truncated value, a value of another KV layout, a value stored under another
key, or corrupt bytes. Such a value is a miss, never KV handed to the engine.

Layout (little-endian)::

    0  4s  magic  b"MCVB"
    4  H   format version
    6  H   flags (reserved, 0)
    8  Q   payload length in bytes
    16 Q   xxh3-64 of the payload
    24 16s layout fingerprint digest
    40 16s key digest
    56 8x  padding
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "Header",
    "checksum_bytes",
    "checksum_segments",
    "digest16",
    "frame_value",
    "pack_header",
    "unframe_value",
    "unpack_header",
    "verify",
]

MAGIC = b"MCVB"
FORMAT_VERSION = 1
HEADER_SIZE = 64
_STRUCT = struct.Struct("<4sHHQQ16s16s8x")
assert _STRUCT.size == HEADER_SIZE


@dataclass(frozen=True)
class Header:
    """A decoded value header."""

    version: int
    payload_len: int
    checksum: int
    layout_digest: bytes
    key_digest: bytes


def digest16(text: str) -> bytes:
    """16-byte digest used for layout fingerprints and keys in headers."""
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def checksum_segments(segments: Iterable[tuple[int, int]]) -> int:
    """xxh3-64 over the bytes of ``(ptr, nbytes)`` segments, in order, without copying."""
    h = xxhash.xxh3_64()
    for ptr, nbytes in segments:
        h.update(memoryview((ctypes.c_char * nbytes).from_address(ptr)))
    return h.intdigest()


def checksum_bytes(data: bytes | memoryview) -> int:
    """xxh3-64 of host bytes (the value payload checksum)."""
    return xxhash.xxh3_64_intdigest(data)


def pack_header(payload_len: int, checksum: int, layout_digest: bytes, key_digest: bytes) -> bytes:
    """Encode a header."""
    return _STRUCT.pack(MAGIC, FORMAT_VERSION, 0, payload_len, checksum, layout_digest, key_digest)


def unpack_header(raw: bytes | memoryview) -> Header | None:
    """Decode a header, or ``None`` if ``raw`` is not one of ours."""
    if len(raw) < HEADER_SIZE:
        return None
    magic, version, _flags, length, checksum, layout, key = _STRUCT.unpack_from(raw)
    if magic != MAGIC:
        return None
    return Header(version, length, checksum, layout, key)


def verify(
    raw_header: bytes | memoryview,
    segments: list[tuple[int, int]],
    *,
    layout_digest: bytes,
    key_digest: bytes,
) -> str | None:
    """Check a read value; return ``None`` if good, else the reason it is a miss."""
    header = unpack_header(raw_header)
    if header is None:
        return "not a mooncake-vllm value (bad magic)"
    if header.version != FORMAT_VERSION:
        return f"value format {header.version}, expected {FORMAT_VERSION}"
    if header.layout_digest != layout_digest:
        return "value of another KV layout"
    if header.key_digest != key_digest:
        return "value stored under another key"
    expected = sum(n for _, n in segments)
    if header.payload_len != expected:
        return f"payload of {header.payload_len} bytes, expected {expected}"
    if checksum_segments(segments) != header.checksum:
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
            or header.checksum != checksum_bytes(payload)):
        return None
    return payload
