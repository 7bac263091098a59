"""Block layouts: segments address exactly one block's bytes for every kind."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from mooncake_vllm.layout import BlockLayout, layout_fingerprint


def _read(segments: list[tuple[int, int]]) -> bytes:
    return b"".join(ctypes.string_at(p, n) for p, n in segments)


def _caches(shape: tuple[int, ...], layers: int = 3, dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(layers)]


def test_cpu_layout_segments_are_the_block() -> None:
    kv = _caches((10, 2, 32, 64))
    lay = BlockLayout.from_kv_caches({f"l{i}": t for i, t in enumerate(kv)})
    assert (lay.kind, lay.num_blocks, lay.block_size, lay.num_layers) == ("cpu", 10, 32, 3)
    assert lay.block_nbytes == 3 * 2 * 32 * 64 * 4
    assert _read(lay.segments(7)) == b"".join(t[7].numpy().tobytes() for t in kv)
    assert lay.fingerprint == "cpu:float32:L3:2x32x64"


def test_flash_and_flashinfer_share_bytes_and_fingerprint() -> None:
    flash = _caches((2, 10, 16, 4, 8), dtype=torch.float16)
    inter = [t.permute(1, 0, 2, 3, 4).contiguous() for t in flash]
    a = BlockLayout.from_kv_caches(flash)
    b = BlockLayout.from_kv_caches(inter)
    assert (a.kind, b.kind) == ("nhd", "nhd-interleaved")
    assert a.fingerprint == b.fingerprint == "nhd:float16:L3:2x16x4x8"
    assert len(a.segments(3)) == 6 and len(b.segments(3)) == 3
    assert _read(a.segments(3)) == _read(b.segments(3))
    assert a.block_size == 16 and a.num_blocks == 10


def test_cpu_and_gpu_layouts_never_match() -> None:
    cpu = BlockLayout.from_kv_caches(_caches((10, 4, 16, 16)))
    gpu = BlockLayout.from_kv_caches(_caches((2, 10, 16, 4, 8)))
    assert cpu.fingerprint != gpu.fingerprint and cpu.block_nbytes == gpu.block_nbytes


def test_old_cpu_backend_is_k_and_v_apart_heads_first() -> None:
    # vLLM's CPU backend up to 0.22: [2, num_blocks, kv_heads, block_size, head]
    kv = _caches((2, 10, 4, 16, 8))
    lay = BlockLayout.from_kv_caches({f"l{i}": t for i, t in enumerate(kv)}, kind="cpu-hnd",
                                     variant="cpu")
    assert (lay.num_blocks, lay.block_size, lay.num_layers, lay.heads_first) == (10, 16, 3, True)
    assert lay.fingerprint == "hnd:cpu:float32:L3:2x16x4x8"
    assert _read(lay.segments(7)) == b"".join(t[0, 7].numpy().tobytes() + t[1, 7].numpy().tobytes()
                                              for t in kv)
    rows = lay.byte_views()  # the device path gathers the same bytes, no copy
    assert rows[0].data_ptr() == kv[0].data_ptr()
    assert bytes(rows[0][0, 7].numpy()) + bytes(rows[0][1, 7].numpy()) == \
        kv[0][0, 7].numpy().tobytes() + kv[0][1, 7].numpy().tobytes()
    gpu_hnd = [t.swapaxes(2, 3) for t in kv]  # the same memory as FlashAttention HND
    assert BlockLayout.from_kv_caches(gpu_hnd).fingerprint == "hnd:float32:L3:2x16x4x8"
    with pytest.raises(ValueError, match=r"cpu-hnd KV tensor is \[2, num_blocks, kv_heads"):
        BlockLayout.from_kv_caches(_caches((10, 4, 16, 16)), kind="cpu-hnd")


def test_oldest_cpu_backend_is_one_page_per_block_for_k_and_v() -> None:
    # vLLM's V1 CPU backend up to 0.11.0: [2, num_blocks, block_size * kv_heads * head]
    kv = _caches((2, 10, 16 * 4 * 8))
    lay = BlockLayout.from_kv_caches(kv, kind="cpu-paged", variant="cpu-ipex")
    assert (lay.num_blocks, lay.num_layers, lay.segs_per_layer) == (10, 3, 2)
    assert lay.fingerprint == "paged:cpu-ipex:float32:L3:2x512"
    assert lay.block_nbytes == 3 * 2 * 512 * 4
    assert _read(lay.segments(7)) == b"".join(t[0, 7].numpy().tobytes() + t[1, 7].numpy().tobytes()
                                              for t in kv)
    rows = lay.byte_views()  # the device path gathers the same bytes, no copy
    assert rows[0].data_ptr() == kv[0].data_ptr()
    assert bytes(rows[1][1, 7].numpy()) == kv[1][1, 7].numpy().tobytes()
    # numpy pages too, and the page order (variant) keeps IPEX and PagedAttention apart
    other = BlockLayout.from_kv_caches([t.numpy() for t in kv], kind="cpu-paged", variant="cpu-paged")
    assert other.fingerprint == "paged:cpu-paged:float32:L3:2x512"
    assert _read(other.segments(7)) == _read(lay.segments(7))
    with pytest.raises(ValueError, match=r"cpu-paged KV tensor is \[2, num_blocks, block_size"):
        BlockLayout.from_kv_caches(_caches((2, 10, 4, 16, 8)), kind="cpu-paged")


def test_mla_numpy_and_variant() -> None:
    kv = [np.arange(5 * 16 * 8, dtype=np.float32).reshape(5, 16, 8) for _ in range(2)]
    lay = BlockLayout.from_kv_caches(kv, variant="isa-vec")
    assert lay.kind == "mla" and lay.fingerprint == "mla:isa-vec:float32:L2:16x8"
    assert _read(lay.segments(1)) == kv[0][1].tobytes() + kv[1][1].tobytes()


def test_regions_merge_views_of_one_buffer() -> None:
    base = torch.zeros(2, 10, 2, 32, 64)
    lay = BlockLayout.from_kv_caches([base[0], base[1]])
    assert lay.regions() == [(base.data_ptr(), base.numel() * 4)]


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="no KV cache"):
        BlockLayout.from_kv_caches([])
    with pytest.raises(ValueError, match="cannot tell"):
        BlockLayout.from_kv_caches([torch.zeros(2, 2, 4, 4, 4)])
    with pytest.raises(ValueError, match="share shape"):
        BlockLayout.from_kv_caches([torch.zeros(4, 2, 4, 4), torch.zeros(5, 2, 4, 4)])
    with pytest.raises(ValueError, match="contiguous"):
        BlockLayout.from_kv_caches([torch.zeros(4, 4, 2, 4).permute(0, 2, 1, 3)])
    with pytest.raises(IndexError, match="outside"):
        BlockLayout.from_kv_caches([torch.zeros(4, 2, 4, 4)]).segments(4)
    with pytest.raises(TypeError, match="torch tensors or numpy"):
        BlockLayout.from_kv_caches([[1, 2]])
    with pytest.raises(ValueError, match="unknown KV layout kind"):
        layout_fingerprint("weird", "f", 1, (1,))
