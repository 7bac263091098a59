"""Which path a CUDA KV cache takes (``gpu_path``), and the in-place block checksums."""

from __future__ import annotations

import pytest
import torch

from mooncake_vllm import codec
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.store.mover import BlockMover
from mooncake_vllm.store.paths import choose_gpu_path

_ALL = dict(cuda_build=True, multi_buffer=True, whole_words=True)


def test_auto_is_staged_over_tcp_and_zero_copy_over_rdma() -> None:
    assert choose_gpu_path("auto", protocol="tcp", **_ALL)[0] == "staged"
    assert choose_gpu_path("auto", protocol="rdma", **_ALL)[0] == "zero_copy"
    assert choose_gpu_path("staged", protocol="rdma", **_ALL)[0] == "staged"
    assert choose_gpu_path("zero_copy", protocol="tcp", **_ALL)[0] == "zero_copy"


@pytest.mark.parametrize("missing, words", [("cuda_build", "not a CUDA build"),
                                            ("multi_buffer", "multi-buffer"),
                                            ("whole_words", "8-byte words")])
def test_zero_copy_needs_every_prerequisite_and_says_which_is_missing(missing: str,
                                                                     words: str) -> None:
    facts = {**_ALL, missing: False}
    for setting in ("zero_copy", "auto"):
        path, why = choose_gpu_path(setting, protocol="rdma", **facts)
        assert path == "staged" and words in why


@pytest.mark.parametrize("shape, perm", [((2, 10, 16, 4, 32), None),
                                         ((10, 2, 16, 4, 32), None),
                                         ((2, 10, 16, 4, 32), (0, 1, 3, 2, 4)),
                                         ((10, 16, 64), None)])
def test_block_sums_in_place_equal_the_host_checksum_of_the_stored_bytes(
        shape: tuple[int, ...], perm: tuple[int, ...] | None) -> None:
    """The GPU code path (torch ops on the byte views), run on CPU tensors here."""
    def tensor(seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        if perm is None:
            return torch.randn(shape, generator=gen).to(torch.bfloat16)
        inv = [perm.index(i) for i in range(len(perm))]
        return torch.randn([shape[p] for p in perm], generator=gen).to(torch.bfloat16).permute(inv)

    layout = BlockLayout.from_kv_caches([tensor(i) for i in range(3)])
    mover = BlockMover(layout)
    blocks = [7, 0, 3, 9]
    sums = [int(v) & codec.MASK64 for v in mover._block_sums(blocks)]
    assert sums == [codec.checksum_segments(layout.segments(b), codec.WSUM64) for b in blocks]
    assert len(set(sums)) == len(sums)
