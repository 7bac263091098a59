"""Value framing: headers round-trip; anything else is a miss with a reason."""

from __future__ import annotations

import ctypes

from mooncake_vllm import codec


def _segments(*chunks: bytes) -> tuple[list[tuple[int, int]], list[ctypes.Array]]:
    bufs = [ctypes.create_string_buffer(c, len(c)) for c in chunks]
    return [(ctypes.addressof(b), len(c)) for b, c in zip(bufs, chunks)], bufs


def test_round_trip_and_every_rejection() -> None:
    segs, _keep = _segments(b"a" * 100, b"b" * 28)
    lay, key = codec.digest16("layout"), codec.digest16("key")
    header = codec.pack_header(128, codec.checksum_segments(segs), lay, key)
    assert len(header) == codec.HEADER_SIZE
    assert codec.verify(header, segs, layout_digest=lay, key_digest=key) is None
    assert "layout" in codec.verify(header, segs, layout_digest=codec.digest16("x"), key_digest=key)
    assert "another key" in codec.verify(header, segs, layout_digest=lay, key_digest=codec.digest16("k2"))
    assert "bad magic" in codec.verify(b"XXXX" + header[4:], segs, layout_digest=lay, key_digest=key)
    assert "bad magic" in codec.verify(header[:10], segs, layout_digest=lay, key_digest=key)
    short, _k2 = _segments(b"a" * 100)
    assert "expected 100" in codec.verify(header, short, layout_digest=lay, key_digest=key)
    flipped, _k3 = _segments(b"a" * 99 + b"c", b"b" * 28)
    assert "checksum" in codec.verify(header, flipped, layout_digest=lay, key_digest=key)
    future = header[:4] + (9).to_bytes(2, "little") + header[6:]
    assert "format 9" in codec.verify(future, segs, layout_digest=lay, key_digest=key)


def test_checksum_spans_segments_in_order() -> None:
    a, _k = _segments(b"xy", b"z")
    b, _k2 = _segments(b"x", b"yz")
    c, _k3 = _segments(b"z", b"xy")
    assert codec.checksum_segments(a) == codec.checksum_segments(b) != codec.checksum_segments(c)
