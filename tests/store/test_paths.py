"""Which path a CUDA KV cache takes (``gpu_path``), the in-place block checksums, and when the
GPU's checksums of a CUDA snapshot are trusted."""

from __future__ import annotations

import pytest
import torch

from mooncake_vllm import codec
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.store.mover import BlockMover
from mooncake_vllm.store.paths import VERIFY_GPU_SUMS, LayoutPaths, SaveTicket, StagingSizes, choose_gpu_path
from mooncake_vllm.store.slots import slots_of

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


def _snapshot_paths() -> LayoutPaths:
    """Host paths that take the GPU's snapshot checksums as a CUDA layout's would."""
    layout = BlockLayout.from_kv_caches([torch.randn((2, 8, 16, 2, 8))])
    paths = LayoutPaths(layout, lambda ptr, n: 0, multi_buffer=False,
                        sizes=StagingSizes(save_host=1 << 20, load=1 << 20))
    paths.gpu_snapshot_sums, paths.checksum_kind = True, codec.WSUM64
    return paths


def _capture(paths: LayoutPaths, keys: list[str], ids: list[int]) -> SaveTicket:
    """A host capture (no pinned memory here), as if the GPU were to checksum it."""
    trusted, paths.gpu_snapshot_sums = paths.gpu_snapshot_sums, False
    try:
        return paths.capture(keys, ids)
    finally:
        paths.gpu_snapshot_sums = trusted


def _signed(values: list[int]) -> torch.Tensor:
    return torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in values], dtype=torch.int64)


def test_gpu_snapshot_checksums_are_checked_against_the_host_before_they_are_trusted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _snapshot_paths()
    for _ in range(VERIFY_GPU_SUMS):
        ticket = _capture(paths, ["a", "b"], [1, 2])
        assert paths.save_pool is not None
        good = [codec.checksum_bytes(paths.save_pool.view(s)[codec.HEADER_SIZE:], codec.WSUM64)
                for s in slots_of(ticket.runs)]
        ticket.sums = _signed(good)
        assert paths._trusted_sums(ticket, slots_of(ticket.runs)) == good
        paths.release(ticket)
    # checked enough: the host computes nothing any more
    monkeypatch.setattr(codec, "checksum_bytes", lambda *a: pytest.fail("host checksum"))
    ticket = _capture(paths, ["c"], [3])
    ticket.sums = _signed([7])
    assert paths._trusted_sums(ticket, slots_of(ticket.runs)) == [7]


def test_one_gpu_checksum_that_differs_from_the_host_turns_them_off(caplog: pytest.LogCaptureFixture) -> None:
    paths = _snapshot_paths()
    ticket = _capture(paths, ["a", "b"], [1, 2])
    ticket.sums = _signed([1, 2])  # not the slots' checksums
    with caplog.at_level("WARNING"):
        assert paths._trusted_sums(ticket, slots_of(ticket.runs)) is None
    assert not paths.gpu_snapshot_sums and "differ from the host" in caplog.text
    assert paths._device_sums_buffer(4) is None  # later snapshots: host checksums
    ptrs, _ = paths.frame_snapshot(ticket, [0, 1])  # framed with the host's checksums
    assert len(ptrs) == 2
