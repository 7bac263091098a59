"""Value framing: headers round-trip; anything else is a miss with a reason."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

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


def _wsum_reference(data: bytes) -> int:
    """wsum64 spelled out in Python integers: Σ w_i (2i + 1) mod 2^64."""
    data += b"\0" * (-len(data) % 8)
    words = [int.from_bytes(data[i:i + 8], "little") for i in range(0, len(data), 8)]
    return sum(w * (2 * i + 1) for i, w in enumerate(words)) % (1 << 64)


@pytest.mark.parametrize("nbytes", [8, 1000, 4096, 65536 + 3])
def test_wsum_host_numpy_equals_torch_and_the_definition(nbytes: int) -> None:
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    host = codec.checksum_bytes(data, codec.WSUM64)
    assert host == _wsum_reference(data)
    padded = data + b"\0" * (-len(data) % 8)
    words = torch.frombuffer(bytearray(padded), dtype=torch.int64).view(1, -1)
    on_torch = int(codec.wsum_rows(words, codec.wsum_weights(words.shape[1], "cpu"))[0])
    assert on_torch & codec.MASK64 == host
    # pieces add up modulo 2^64 in any order (how the GPU sums layer by layer)
    half = words.shape[1] // 2
    weights = codec.wsum_weights(words.shape[1], "cpu")
    parts = [codec.wsum_rows(words[:, half:], weights[half:]),
             codec.wsum_rows(words[:, :half], weights[:half])]
    assert (int(parts[0][0]) + int(parts[1][0])) & codec.MASK64 == host


def test_wsum_segments_catch_flips_and_moves() -> None:
    rng = np.random.default_rng(3)
    a, b = (rng.integers(0, 256, 4096, dtype=np.uint8).tobytes() for _ in range(2))
    segs, _keep = _segments(a, b)
    whole = codec.checksum_segments(segs, codec.WSUM64)
    assert whole == codec.checksum_bytes(a + b, codec.WSUM64)
    swapped, _k2 = _segments(b, a)
    assert codec.checksum_segments(swapped, codec.WSUM64) != whole
    for pos, bit in ((0, 0), (777, 3), (8191, 7)):
        raw = bytearray(a + b)
        raw[pos] ^= 1 << bit
        assert codec.checksum_bytes(bytes(raw), codec.WSUM64) != whole
    odd, _k3 = _segments(a[:13], a[13:])  # not whole words: joined, same number
    assert codec.checksum_segments(odd, codec.WSUM64) == codec.checksum_bytes(a, codec.WSUM64)


def test_every_reader_verifies_either_kind_from_the_header() -> None:
    segs, _keep = _segments(b"k" * 64, b"v" * 64)
    lay, key = codec.digest16("layout"), codec.digest16("key")
    for kind in (codec.XXH3, codec.WSUM64):
        header = codec.pack_header(128, codec.checksum_segments(segs, kind), lay, key, kind)
        assert codec.unpack_header(header).checksum_kind == kind
        assert codec.verify(header, segs, layout_digest=lay, key_digest=key) is None
    wrong = codec.pack_header(128, codec.checksum_segments(segs, codec.XXH3), lay, key,
                              codec.WSUM64)  # an xxh3 number under the wsum64 kind
    assert "checksum" in codec.verify(wrong, segs, layout_digest=lay, key_digest=key)
    unknown = codec.pack_header(128, 0, lay, key, 7)
    assert "checksum kind 7" in codec.verify(unknown, segs, layout_digest=lay, key_digest=key)
