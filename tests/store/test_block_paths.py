"""Blocks through the store client on every KV layout, in host and CUDA memory.

Real master + holder on loopback. The same tests run on the CPU (CI) and, marked
``gpu``, on CUDA tensors (skipped cleanly without a GPU): a save then a load into
other physical blocks is byte-exact, untouched blocks stay untouched, planted
corrupt or foreign values are misses, and a snapshot keeps the bytes the key
names even when vLLM overwrites the blocks before the put runs.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from mooncake_vllm import codec
from mooncake_vllm.config import load_store_config
from mooncake_vllm.keys import KeyNamespace, chunk_keys
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.store import StagingSizes, StoreClient

NB, BS, H, D, L = 12, 16, 4, 32, 3
_counter = itertools.count()

DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]

#: name -> (logical shape, permutation applied to a contiguous allocation)
LAYOUTS = {
    "flash-nhd": ((2, NB, BS, H, D), None),
    "flash-hnd": ((2, NB, BS, H, D), (0, 1, 3, 2, 4)),
    "flashinfer-nhd": ((NB, 2, BS, H, D), None),
    "flashinfer-hnd": ((NB, 2, BS, H, D), (0, 1, 3, 2, 4)),
    "mla": ((NB, BS, 64), None),
    "cpu": ((NB, H, BS, 2 * D), None),
}


def _need(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")


def _tensor(shape: tuple[int, ...], perm: tuple[int, ...] | None, dtype: torch.dtype,
            device: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if perm is None:
        t = torch.randn(shape, generator=gen)
    else:  # allocate in physical order, view in vLLM's logical order
        inv = [perm.index(i) for i in range(len(perm))]
        t = torch.randn([shape[p] for p in perm], generator=gen).permute(inv)
    return t.to(dtype).to(device) if dtype != torch.float32 else t.to(device)


def _caches(name: str, dtype: torch.dtype, device: str, seed: int) -> list[torch.Tensor]:
    shape, perm = LAYOUTS[name]
    return [_tensor(shape, perm, dtype, device, seed + i) for i in range(L)]


def _block(t: torch.Tensor, kind: str, b: int) -> torch.Tensor:
    """Block ``b`` of one layer as raw bytes, on the host."""
    sel = t[:, b] if kind == "nhd" else t[b]
    return sel.contiguous().view(torch.uint8).cpu()


@pytest.fixture(scope="module")
def stack(module_local_stack: Any) -> Any:
    return module_local_stack


@pytest.fixture(params=[True, False], ids=["zero-copy", "snapshot"])
def client(request: pytest.FixtureRequest, stack: Any) -> Any:
    c = StoreClient.connect(load_store_config(stack.config_path), zero_copy=request.param)
    yield c
    c.close()


def _keys(layout: BlockLayout, n: int) -> list[str]:
    ns = KeyNamespace("paths-test", layout.dtype, layout.fingerprint, layout.block_size)
    base = next(_counter) * 1000
    return chunk_keys(ns, list(range(base, base + n * layout.block_size)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn],
                         ids=["bf16", "fp16", "fp8"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_round_trip_is_byte_exact_into_other_blocks(client: StoreClient, name: str,
                                                    dtype: torch.dtype, device: str) -> None:
    _need(device)
    src = _caches(name, dtype, device, 1)
    dst = _caches(name, dtype, device, 50)
    before = [t.clone() for t in dst]
    a, b = BlockLayout.from_kv_caches(src), BlockLayout.from_kv_caches(dst)
    assert a.fingerprint == b.fingerprint and a.on_cuda == (device == "cuda")
    client.register_layout(a)
    client.register_layout(b)
    keys = _keys(a, 4)
    ticket = client.prepare_save(keys, a, [7, 2, 9, 0])  # what the worker asks first
    assert ticket.snapshot == client.saves_snapshot(a)
    client.discard(ticket)
    assert client.put_blocks(keys, a, [7, 2, 9, 0]) == 4
    missing = _keys(a, 1)
    assert client.get_blocks(keys + missing, b, [1, 3, 5, 11, 4]) == [True] * 4 + [False]
    if device == "cuda":
        torch.cuda.synchronize()
    kind = a.kind
    for s, d, old in zip(src, dst, before):
        for sb, db in ((7, 1), (2, 3), (9, 5), (0, 11)):
            assert torch.equal(_block(d, kind, db), _block(s, kind, sb))
        for untouched in (0, 2, 4, 6, 7, 8, 9, 10):  # block 4's value was missing
            assert torch.equal(_block(d, kind, untouched), _block(old, kind, untouched))


def test_hnd_bytes_are_named_apart_from_nhd() -> None:
    nhd = BlockLayout.from_kv_caches(_caches("flash-nhd", torch.bfloat16, "cpu", 1))
    hnd = BlockLayout.from_kv_caches(_caches("flash-hnd", torch.bfloat16, "cpu", 1))
    inter = BlockLayout.from_kv_caches(_caches("flashinfer-hnd", torch.bfloat16, "cpu", 1))
    assert nhd.fingerprint.startswith("nhd:") and hnd.fingerprint.startswith("hnd:")
    assert hnd.fingerprint == inter.fingerprint != nhd.fingerprint


@pytest.mark.parametrize("device", DEVICES)
def test_snapshot_keeps_the_bytes_the_key_names(stack: Any, device: str) -> None:
    _need(device)
    client = StoreClient.connect(load_store_config(stack.config_path), zero_copy=False)
    try:
        src = _caches("flash-nhd", torch.bfloat16, device, 3)
        layout = BlockLayout.from_kv_caches(src)
        expected = [_block(t, "nhd", 4) for t in src]
        keys = _keys(layout, 1)
        ticket = client.prepare_save(keys, layout, [4])
        assert ticket.snapshot
        for t in src:  # vLLM reuses the block before the put runs
            t[:, 4] = 0.5
        assert client.commit_save(ticket) == 1
        dst = _caches("flash-nhd", torch.bfloat16, device, 9)
        assert client.get_blocks(keys, layout_of(dst, client), [6]) == [True]
        for t, want in zip(dst, expected):
            assert torch.equal(_block(t, "nhd", 6), want)
    finally:
        client.close()


def layout_of(caches: list[torch.Tensor], client: StoreClient) -> BlockLayout:
    layout = BlockLayout.from_kv_caches(caches)
    client.register_layout(layout)
    return layout


@pytest.mark.parametrize("device", DEVICES)
def test_planted_corrupt_and_foreign_values_are_misses(client: StoreClient,
                                                        device: str) -> None:
    _need(device)
    src = _caches("flash-nhd", torch.float16, device, 5)
    layout = layout_of(src, client)
    keys = _keys(layout, 4)
    assert client.put_blocks(keys[:1], layout, [3]) == 1
    raw = client.store.get(keys[0])
    store = client.store
    assert store.upsert(keys[1], raw[:300] + bytes([raw[300] ^ 4]) + raw[301:]) == 0  # bit flip
    assert store.upsert(keys[2], raw[: len(raw) - 7]) == 0  # truncated
    assert store.upsert(keys[3], raw) == 0  # another key's value
    dst = _caches("flash-nhd", torch.float16, device, 6)
    before = [t.clone() for t in dst]
    dl = layout_of(dst, client)
    assert client.get_blocks(keys[1:], dl, [1, 2, 5]) == [False] * 3
    for t, old in zip(dst, before):  # a refused value never touches the KV cache
        assert torch.equal(t.cpu(), old.cpu())
    assert client.stats.snapshot()["corrupt"] >= 3
    assert len(raw) == codec.HEADER_SIZE + layout.block_nbytes


@pytest.mark.parametrize("device", DEVICES)
def test_v0_data_path_full_blocks_and_tail(client: StoreClient, device: str) -> None:
    """What the V0 connector moves, on V0's flash-layout caches: full blocks + the tail.

    The V0 engine itself runs only on vLLM <= 0.10.0 (torch 2.7), which no GPU
    machine here has; its batch parsing is tested with real V0 objects in the
    contract envs, and this proves its data path in host and CUDA memory.
    """
    _need(device)
    from mooncake_vllm.v0.batch import Tail

    src = _caches("flash-nhd", torch.bfloat16, device, 21)
    dst = _caches("flash-nhd", torch.bfloat16, device, 22)
    a, b = layout_of(src, client), layout_of(dst, client)
    keys = _keys(a, 2)
    assert client.put_blocks(keys, a, [3, 8]) == 2  # two full blocks of a 40-token prompt
    tail_slots = tuple(5 * BS + i for i in range(8))  # its last 8 tokens, in block 5
    hidden = torch.randn(64, dtype=torch.bfloat16, device=device)
    assert client.put_value(keys[0] + "/tail", Tail.gather(src, tail_slots, hidden).pack())
    # the consumer: other physical blocks, the tail into block 10
    assert client.get_blocks(keys, b, [1, 2]) == [True, True]
    raw = client.get_value(keys[0] + "/tail")
    tail = Tail.unpack(raw)
    dst_slots = tuple(10 * BS + i for i in range(8))
    assert tail is not None and tail.fits(dst, dst_slots)
    tail.scatter(dst, dst_slots)
    for s, d in zip(src, dst):
        assert torch.equal(d[:, 1].cpu(), s[:, 3].cpu()) and torch.equal(d[:, 2].cpu(), s[:, 8].cpu())
        assert torch.equal(d[:, 10, :8].cpu(), s[:, 5, :8].cpu())
    assert torch.equal(tail.hidden.cpu(), hidden.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_many_blocks_through_few_slots_in_pipelined_fetches(stack: Any, device: str) -> None:
    """60 blocks through 8 load slots: several fetches, two in flight, slots reused."""
    _need(device)
    src = [_tensor((2, 64, BS, H, D), None, torch.bfloat16, device, 40 + i) for i in range(L)]
    dst = [_tensor((2, 64, BS, H, D), None, torch.bfloat16, device, 80 + i) for i in range(L)]
    probe = BlockLayout.from_kv_caches(src)
    slot = codec.HEADER_SIZE + probe.block_nbytes
    client = StoreClient.connect(load_store_config(stack.config_path),
                                 staging=StagingSizes(load=8 * slot))
    try:
        a, b = layout_of(src, client), layout_of(dst, client)
        keys = _keys(a, 60)
        assert client.put_blocks(keys, a, list(range(60))) == 60
        targets = list(range(63, 3, -1))  # 60 other blocks, reversed
        assert client.get_blocks(keys, b, targets) == [True] * 60
        if device == "cuda":
            torch.cuda.synchronize()
        for s, d in zip(src, dst):
            for i, t in enumerate(targets):
                assert torch.equal(_block(d, "nhd", t), _block(s, "nhd", i))
    finally:
        client.close()


# ---------------------------------------------------------------- GPU zero-copy (gpu_path)
@pytest.fixture
def fresh(stack: Any) -> Any:
    """``fresh()`` → a new connected client; all are closed after the test."""
    made: list[StoreClient] = []

    def make() -> StoreClient:
        made.append(StoreClient.connect(load_store_config(stack.config_path),
                                        staging=StagingSizes(save_cuda=64 << 20, load=64 << 20)))
        return made[-1]

    yield make
    for c in made:
        c.close()


def _registered(client: StoreClient, caches: list[torch.Tensor], path: str) -> BlockLayout:
    layout = BlockLayout.from_kv_caches(caches)
    client.register_layout(layout, gpu_path=path)
    assert client.gpu_path(layout) == path  # the CUDA build registers the KV cache
    return layout


def _load(client: StoreClient, keys: list[str], layout: BlockLayout, blocks: list[int],
          path: str) -> list[bool]:
    if path == "zero_copy":  # background loads go straight into the blocks
        ok = client.get_blocks(keys, layout, blocks, after=client.stream_position(layout),
                               background=True)
    else:
        ok = client.get_blocks(keys, layout, blocks)
    torch.cuda.synchronize()
    return ok


@pytest.mark.gpu
@pytest.mark.parametrize("reader", ["staged", "zero_copy"])
@pytest.mark.parametrize("writer", ["staged", "zero_copy"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("name", sorted(set(LAYOUTS) - {"cpu"}))
def test_zero_copy_and_staged_read_each_others_values(fresh: Any, name: str, dtype: torch.dtype,
                                                      writer: str, reader: str) -> None:
    _need("cuda")
    w, r = fresh(), fresh()
    src = _caches(name, dtype, "cuda", 61)
    dst = _caches(name, dtype, "cuda", 62)
    before = [t.clone() for t in dst]
    a, b = _registered(w, src, writer), _registered(r, dst, reader)
    keys = _keys(a, 4)
    assert w.put_blocks(keys, a, [7, 2, 9, 0]) == 4
    assert _load(r, keys + _keys(a, 1), b, [1, 3, 5, 11, 4], reader) == [True] * 4 + [False]
    for s, d, old in zip(src, dst, before):
        for sb, db in ((7, 1), (2, 3), (9, 5), (0, 11)):
            assert torch.equal(_block(d, a.kind, db), _block(s, a.kind, sb))
        for untouched in (0, 2, 6, 7, 8, 9, 10):
            assert torch.equal(_block(d, a.kind, untouched), _block(old, a.kind, untouched))
    raw = w.store.get(keys[0])
    assert codec.unpack_header(raw).checksum_kind == codec.WSUM64  # CUDA KV: wsum64


@pytest.mark.gpu
def test_gpu_checksums_equal_the_host_checksum_of_the_same_bytes(fresh: Any) -> None:
    _need("cuda")
    c = fresh()
    for name in sorted(set(LAYOUTS) - {"cpu"}):
        caches = _caches(name, torch.bfloat16, "cuda", 70)
        paths = c._paths_for(_registered(c, caches, "zero_copy"))
        host = BlockLayout.from_kv_caches([t.cpu() for t in caches])
        blocks = [0, 5, 11, 3]
        assert paths.device_sums(blocks) == [
            codec.checksum_segments(host.segments(b), codec.WSUM64) for b in blocks]


def _zero_copy_source(fresh: Any, dtype: torch.dtype, seed: int,
                      n: int) -> tuple[StoreClient, list[torch.Tensor], BlockLayout, list[str]]:
    """A zero-copy client, flash-layout CUDA caches registered with it, ``n`` keys."""
    _need("cuda")
    c = fresh()
    src = _caches("flash-nhd", dtype, "cuda", seed)
    layout = _registered(c, src, "zero_copy")
    return c, src, layout, _keys(layout, n)


@pytest.mark.gpu
def test_zero_copy_loads_refuse_corrupt_foreign_and_unverifiable_values(fresh: Any) -> None:
    c, src, layout, keys = _zero_copy_source(fresh, torch.float16, 80, 5)
    assert c.put_blocks(keys[:1], layout, [3]) == 1
    store = c.store
    raw = store.get(keys[0])
    assert store.upsert(keys[1], raw[:300] + bytes([raw[300] ^ 4]) + raw[301:]) == 0
    assert store.upsert(keys[2], raw[: len(raw) - 7]) == 0  # truncated
    assert store.upsert(keys[3], raw) == 0  # another key's value
    # the same bytes framed from host memory carry xxh3: not verifiable on the GPU
    host = BlockLayout.from_kv_caches([t.cpu() for t in src])
    xxh = codec.pack_header(host.block_nbytes, codec.checksum_segments(host.segments(3)),
                            codec.digest16(layout.fingerprint), codec.digest16(keys[4]))
    assert store.upsert(keys[4], xxh + raw[codec.HEADER_SIZE:]) == 0
    dl = _registered(c, _caches("flash-nhd", torch.float16, "cuda", 81), "zero_copy")
    before = c.stats.snapshot().get("corrupt", 0)
    assert _load(c, keys[1:], dl, [1, 2, 5, 8], "zero_copy") == [False] * 4
    stats = c.stats.snapshot()
    # the truncated value may come back as an error code of the multi-buffer get (``errors``)
    assert stats["corrupt"] + stats.get("errors", 0) - before >= 4
    assert stats["corrupt"] - before >= 3 and stats["unverifiable_on_gpu"] == 1
    # a staged reader verifies the xxh3 value on the host and takes it
    s = fresh()
    sl = _registered(s, _caches("flash-nhd", torch.float16, "cuda", 82), "staged")
    assert _load(s, keys[4:], sl, [6], "staged") == [True]


@pytest.mark.gpu
def test_zero_copy_save_of_a_block_reused_before_the_put_is_removed(fresh: Any) -> None:
    c, src, layout, keys = _zero_copy_source(fresh, torch.bfloat16, 90, 2)
    ticket = c.prepare_save(keys, layout, [4, 6])
    assert not ticket.snapshot
    for t in src:  # vLLM reuses block 4 before the put runs
        t[:, 4] = 0.5
    assert c.commit_save(ticket) == 1
    assert c.stats.snapshot()["save_raced"] == 1
    assert c.exists(keys) == [False, True]


@pytest.mark.parametrize("device", DEVICES)
def test_a_deferred_fence_keeps_the_snapshot_exact_once_ordered(fresh: Any, device: str) -> None:
    """The V1 worker's capture: vLLM's stream is not held; ordering the fence is enough."""
    _need(device)
    c = fresh()
    src = _caches("flash-nhd", torch.bfloat16, device, 31)
    layout = BlockLayout.from_kv_caches(src)
    c.register_layout(layout, gpu_path="staged")
    keys = _keys(layout, 2)
    expected = {b: [_block(t, "nhd", b) for t in src] for b in (4, 7)}
    ticket = c.prepare_save(keys, layout, [4, 7], defer_fence=True)
    assert ticket.snapshot
    if device == "cuda":
        assert ticket.fence is not None and not ticket.fence.ordered
        ticket.fence.order()  # the blocks are freed: vLLM's later writes come after the copy
        assert ticket.fence.ordered and ticket.fence.order() is False  # idempotent
    else:
        assert ticket.fence is None  # host copies are done on return
    for t in src:  # vLLM reuses both blocks before the put runs
        t[:, 4] = 0.5
        t[:, 7] = -1.0
    assert c.commit_save(ticket) == 2
    dst = _caches("flash-nhd", torch.bfloat16, device, 32)
    dl = BlockLayout.from_kv_caches(dst)
    c.register_layout(dl, gpu_path="staged")
    assert c.get_blocks(keys, dl, [1, 2]) == [True, True]
    if device == "cuda":
        torch.cuda.synchronize()
    for i, t in enumerate(dst):
        assert torch.equal(_block(t, "nhd", 1), expected[4][i])
        assert torch.equal(_block(t, "nhd", 2), expected[7][i])


@pytest.mark.gpu
@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "at-capture"])
def test_a_deferred_snapshot_copy_does_not_hold_vllms_stream(fresh: Any, defer: bool) -> None:
    """With the save stream busy, vLLM's next kernels run at once only with a deferred fence."""
    _need("cuda")
    c = fresh()
    src = _caches("flash-nhd", torch.bfloat16, "cuda", 33)
    layout = BlockLayout.from_kv_caches(src)
    c.register_layout(layout, gpu_path="staged")
    mover = c._paths_for(layout).mover
    torch.cuda.synchronize()
    slept = torch.cuda.Event()
    with torch.cuda.stream(mover.save_stream):
        torch.cuda._sleep(1 << 30)  # ~0.5 s of GPU time ahead of the gather
        slept.record(mover.save_stream)
    ticket = c.prepare_save(_keys(layout, 1), layout, [5], defer_fence=defer)
    step = torch.cuda.Event()
    step.record(torch.cuda.current_stream())  # "the next forward pass"
    step.synchronize()
    if defer:  # vLLM's stream ran while the save stream was still busy
        assert not slept.query() and not ticket.ready.query()
        assert ticket.fence is not None and not ticket.fence.ordered
    else:  # vLLM's stream waited for the gather, queued behind the sleep
        assert slept.query() and ticket.fence is None
    if ticket.fence is not None:
        assert ticket.fence.order() is True  # still running when freed: vLLM now waits
    assert c.commit_save(ticket) == 1
