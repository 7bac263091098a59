"""Host block copies of :class:`BlockMover`: run-by-run slices and fancy indexing agree.

Pure host memory (no pool needed): gather blocks into slots, scatter slots into
other blocks, for ids with and without consecutive runs, with layer pieces above
and below the run-copy threshold, against a block-by-block reference.
"""

from __future__ import annotations

import pytest
import torch

from mooncake_vllm.codec import HEADER_SIZE
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.store.mover import BlockMover, _copy_by_runs, _id_runs, checksums_on_device
from mooncake_vllm.store.slots import SlotPool

NB = 24


def _block(t: torch.Tensor, b: int) -> torch.Tensor:
    return t[:, b].contiguous().view(torch.uint8)


@pytest.mark.parametrize("head_dim", [32, 1024], ids=["small-pieces", "large-pieces"])
@pytest.mark.parametrize("ids", [[3, 4, 5, 6, 10, 11, 0], [9, 2, 17, 5], list(range(8, 20))],
                         ids=["runs", "scattered", "one-run"])
def test_gather_then_scatter_moves_exact_blocks(head_dim: int, ids: list[int]) -> None:
    gen = torch.Generator().manual_seed(1)
    src = [torch.randn((2, NB, 16, 2, head_dim), generator=gen) for _ in range(3)]
    dst = [torch.randn((2, NB, 16, 2, head_dim), generator=gen) for _ in range(3)]
    before = [t.clone() for t in dst]
    layout = BlockLayout.from_kv_caches(src)
    pool = SlotPool(HEADER_SIZE + layout.block_nbytes, len(ids) + 2, pinned=False,
                    register=lambda ptr, n: 0)
    runs = pool.take(len(ids))
    BlockMover(layout).gather(pool, runs, ids)
    targets = [NB - 1 - i for i in range(len(ids) - 1)] + [1]  # descending, then a lone one
    if ids == list(range(8, 20)):
        targets = list(range(2, 2 + len(ids)))  # consecutive on both sides
    ok = [True] * len(ids)
    ok[1] = False  # a slot not to be written
    BlockMover(BlockLayout.from_kv_caches(dst)).scatter(pool, runs, ok, targets)
    for s, d, old in zip(src, dst, before):
        for i, (sb, db) in enumerate(zip(ids, targets)):
            want = _block(old, db) if i == 1 else _block(s, sb)
            assert torch.equal(_block(d, db), want)
        for untouched in set(range(NB)) - set(targets):
            assert torch.equal(_block(d, untouched), _block(old, untouched))


def test_runs_and_the_choice_of_copy() -> None:
    assert _id_runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert _id_runs([3, 4, 5], [0, 2, 3]) == [(0, 3, 1), (2, 4, 2)]
    assert _copy_by_runs([(0, 0, 8)], 8, (4, 1, 1024))  # one long run of small pieces
    assert not _copy_by_runs([(i, i * 2, 1) for i in range(8)], 8, (4, 1, 1024))
    assert _copy_by_runs([(i, i * 2, 1) for i in range(8)], 8, (4, 1, 64 << 10))


def test_only_cuda_blocks_of_whole_words_are_checksummed_on_device() -> None:
    host = BlockLayout.from_kv_caches([torch.zeros((2, 4, 16, 2, 8))])
    assert host.seg_nbytes % 8 == 0 and not checksums_on_device(host)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, whole", [(8, True), (3, False)])
def test_cuda_blocks_are_checksummed_on_device_when_whole_words(head_dim: int,
                                                                 whole: bool) -> None:
    kv = [torch.zeros((2, 4, 1, 1, head_dim), dtype=torch.float16, device="cuda")]
    assert checksums_on_device(BlockLayout.from_kv_caches(kv)) is whole


@pytest.mark.gpu
@pytest.mark.parametrize("wait", ["save_copy", "load_scatter", "checksums"])
def test_a_thread_waiting_for_our_copies_sleeps_instead_of_spinning(wait: str) -> None:
    """The copies queue behind ~0.4 s of GPU work on the current (vLLM's) stream; the host
    thread that waits for them must sleep in the driver: a default CUDA event spins a
    core for as long (thread CPU time ~ wall time), beside vLLM's threads."""
    import time

    kv = [torch.zeros((2, 8, 16, 8, 128), dtype=torch.float16, device="cuda")]
    layout = BlockLayout.from_kv_caches(kv)
    mover = BlockMover(layout)
    pool = SlotPool(HEADER_SIZE + layout.block_nbytes, 4, pinned=True, register=lambda p, n: 0)
    runs = pool.take(2)
    cycles_per_s = torch.cuda.get_device_properties(0).clock_rate * 1000  # kHz
    torch.cuda._sleep(int(0.4 * cycles_per_s))  # the forward pass the copy must follow
    if wait == "save_copy":
        done, _ = mover.gather(pool, runs, [1, 2])
    elif wait == "load_scatter":
        done = mover.scatter(pool, runs, [True, True], [3, 4])  # a background load waits on it
    else:
        _, done = mover.checksums([1, 2])
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    done.synchronize()
    wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
    assert wall > 0.15, f"the copy did not queue behind the GPU work ({wall:.3f} s)"
    assert cpu < 0.3 * wall, f"the waiting thread spun: {cpu:.3f} s CPU in {wall:.3f} s"


def test_row_sums_are_the_payloads_wsum64() -> None:
    """What the GPU writes into a CUDA snapshot's headers (``gather(sums=...)``) is the
    checksum a reader verifies: the same arithmetic on host rows, against the codec."""
    from mooncake_vllm import codec

    layout = BlockLayout.from_kv_caches([torch.zeros((2, 4, 16, 2, 8))])
    rows = torch.randint(0, 256, (11, HEADER_SIZE + layout.block_nbytes), dtype=torch.uint8)
    got = [int(v) & codec.MASK64 for v in BlockMover(layout).row_sums(rows)]
    want = [codec.checksum_bytes(r[HEADER_SIZE:].numpy().tobytes(), codec.WSUM64) for r in rows]
    assert got == want and len(set(got)) == 11


@pytest.mark.gpu
def test_a_cuda_snapshot_is_checksummed_on_the_gpu_as_the_host_would() -> None:
    from mooncake_vllm import codec

    gen = torch.Generator().manual_seed(3)
    kv = [torch.randn((2, NB, 16, 8, 128), generator=gen).to(torch.float16).cuda() for _ in range(2)]
    layout = BlockLayout.from_kv_caches(kv)
    pool = SlotPool(HEADER_SIZE + layout.block_nbytes, 8, pinned=True, register=lambda p, n: 0)
    ids = [5, 6, 7, 2, 19]
    runs = pool.take(len(ids))
    sums = torch.empty(len(ids), dtype=torch.int64, pin_memory=True)
    done, _ = BlockMover(layout).gather(pool, runs, ids, sums=sums)
    done.synchronize()
    from mooncake_vllm.store.slots import slots_of

    want = [codec.checksum_bytes(pool.view(s)[HEADER_SIZE:], codec.WSUM64) for s in slots_of(runs)]
    assert [int(v) & codec.MASK64 for v in sums] == want
