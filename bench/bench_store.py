"""Store put/get throughput: our StoreClient vs raw Mooncake zero-copy vs a memcpy baseline.

One run, side by side, against a real local stack (master + metadata + a
``mooncake_client`` holder; this process is a pure client over TCP loopback):

    .venv/bin/python bench/bench_store.py [--reps 5] [--mib-per-batch 32] \
        [--layers 4] [--block-kib 256 4096]

Block sizes 256 KiB and 4 MiB by default; each block is --layers layer segments
(4, as a 4-layer model's block is; the CPU bench model of bench_serving: 12
segments of 256 KiB, ``--layers 12 --block-kib 3072``). Prints GB/s (median of --reps) and ours/raw ratios.
Target: ours >= 80 % of raw zero-copy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import numpy as np

from mooncake_vllm.config import load_store_config
from mooncake_vllm.keys import KeyNamespace, chunk_keys
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.services import LocalStack
from mooncake_vllm.store import StoreClient, page_aligned_buffer

LAYERS = 4


_KEEP: list = []


def _aligned(shape: tuple[int, ...], seed: int | None) -> np.ndarray:
    """A float32 array on pages of its own (Mooncake rejects page-sharing registrations)."""
    buf, _ = page_aligned_buffer(int(np.prod(shape)) * 4)
    _KEEP.append(buf)
    arr = np.frombuffer(buf, dtype=np.float32).reshape(shape)
    if seed is not None:
        arr[...] = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    return arr


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _bench_size(client: StoreClient, block_bytes: int, batch_bytes: int, reps: int,
                layers: int = LAYERS) -> dict:
    store = client.store  # the raw MooncakeDistributedStore, for the raw baseline
    n = max(1, batch_bytes // block_bytes)
    per_layer = block_bytes // layers // 4  # float32 elements per layer block
    kv = [_aligned((n, 1, 1, per_layer), seed=i) for i in range(layers)]
    layout = BlockLayout.from_kv_caches(kv)
    client.register_layout(layout)
    raw_src = _aligned((n * block_bytes // 4,), seed=9)
    raw_dst = _aligned((n * block_bytes // 4,), seed=None)
    for arr in (raw_src, raw_dst):
        rc = store.register_buffer(arr.ctypes.data, arr.nbytes)
        assert rc == 0, rc
    ptrs_src = [raw_src.ctypes.data + i * block_bytes for i in range(n)]
    ptrs_dst = [raw_dst.ctypes.data + i * block_bytes for i in range(n)]
    memcpy_dst = np.empty_like(raw_src)
    total = n * block_bytes
    results: dict[str, list[float]] = {k: [] for k in (
        "memcpy", "raw_put", "raw_get", "seg_put", "seg_get", "ours_put", "ours_get",
        "ours_direct_get")}
    seg_src = [layout.segments(b) for b in range(n)]
    seg_dst_kv = [_aligned(t.shape, seed=None) for t in kv]
    dst_layout = BlockLayout.from_kv_caches(seg_dst_kv)
    client.register_layout(dst_layout)
    seg_dst = [dst_layout.segments(b) for b in range(n)]
    for rep in range(reps):
        t0 = time.perf_counter()
        np.copyto(memcpy_dst, raw_src)
        results["memcpy"].append(_gbps(total, time.perf_counter() - t0))

        def run_raw() -> None:
            raw_keys = [f"bench/raw/{block_bytes}/{rep}/{i}" for i in range(n)]
            t0 = time.perf_counter()
            codes = store.batch_put_from(raw_keys, ptrs_src, [block_bytes] * n)
            results["raw_put"].append(_gbps(total, time.perf_counter() - t0))
            assert all(c == 0 for c in codes), codes
            t0 = time.perf_counter()
            codes = store.batch_get_into(raw_keys, ptrs_dst, [block_bytes] * n)
            results["raw_get"].append(_gbps(total, time.perf_counter() - t0))
            assert all(c == block_bytes for c in codes), codes

        def run_seg() -> None:
            seg_keys = [f"bench/seg/{block_bytes}/{rep}/{i}" for i in range(n)]
            t0 = time.perf_counter()
            codes = store.batch_put_from_multi_buffers(
                seg_keys, [[p for p, _ in s] for s in seg_src], [[z for _, z in s] for s in seg_src])
            results["seg_put"].append(_gbps(total, time.perf_counter() - t0))
            assert all(c == 0 for c in codes), codes
            t0 = time.perf_counter()
            codes = store.batch_get_into_multi_buffers(
                seg_keys, [[p for p, _ in s] for s in seg_dst], [[z for _, z in s] for s in seg_dst])
            results["seg_get"].append(_gbps(total, time.perf_counter() - t0))
            assert all(c == block_bytes for c in codes), codes

        def run_ours() -> None:
            ns = KeyNamespace(f"bench-{rep}", "float32", layout.fingerprint, 1)
            keys = chunk_keys(ns, list(range(n)))
            blocks = list(range(n))
            t0 = time.perf_counter()
            stored = client.put_blocks(keys, layout, blocks)
            results["ours_put"].append(_gbps(total, time.perf_counter() - t0))
            assert stored == n, stored
            t0 = time.perf_counter()
            ok = client.get_blocks(keys, dst_layout, blocks)
            results["ours_get"].append(_gbps(total, time.perf_counter() - t0))
            assert all(ok), ok
            # a background load: straight into the (registered) blocks, verified there
            t0 = time.perf_counter()
            ok = client.get_blocks(keys, dst_layout, blocks[::-1], background=True)
            results["ours_direct_get"].append(_gbps(total, time.perf_counter() - t0))
            assert all(ok), ok

        # counterbalanced: alternate the order so no variant always runs first
        order = [run_raw, run_seg, run_ours]
        for run in (order if rep % 2 == 0 else order[::-1]):
            run()
            store.remove_all(True)  # keep the pool from filling (not timed)
    med = {k: statistics.median(v) for k, v in results.items()}
    med["put_ratio"] = med["ours_put"] / med["seg_put"]
    med["get_ratio"] = med["ours_get"] / med["seg_get"]
    med["put_vs_contig"] = med["ours_put"] / med["raw_put"]
    med["get_vs_contig"] = med["ours_get"] / med["raw_get"]
    med["direct_get_ratio"] = med["ours_direct_get"] / med["seg_get"]
    med["blocks_per_batch"] = n
    return med


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--mib-per-batch", type=int, default=32)
    parser.add_argument("--layers", type=int, default=LAYERS, help="segments per block")
    parser.add_argument("--block-kib", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mcv-bench-") as work, \
            LocalStack(work, segment_size=1 << 30, local_buffer_size=128 << 20) as stack:
        import os
        os.environ.update(stack.env())
        client = StoreClient.connect(load_store_config(stack.config_path))
        rows = {}
        for size in (kib << 10 for kib in args.block_kib):
            rows[size] = _bench_size(client, size, args.mib_per_batch << 20, args.reps,
                                     args.layers)
        client.close()
    print(f"store throughput, GB/s (median of {args.reps}); pure client -> mooncake_client "
          f"holder over TCP loopback; {args.layers} segments per block + our 64 B header")
    print("raw-1 = raw batch_put_from/batch_get_into, one contiguous buffer per block;")
    print("raw-seg = raw batch_*_multi_buffers over the same layer segments we move (the ceiling")
    print("for KV handed over per layer); ratio = ours / raw-seg (ours / raw-1 in brackets)")
    print(f"{'block':>8} {'batch':>5} {'memcpy':>7} | {'raw-1':>6} {'raw-seg':>7} {'ours':>6} "
          f"{'ratio':>12} | {'raw-1':>6} {'raw-seg':>7} {'ours':>6} {'ratio':>12}")
    print(f"{'':>22}| {'put':^36} | {'get':^36}")
    for size, r in rows.items():
        print(f"{size >> 10:>6}Ki {r['blocks_per_batch']:>5} {r['memcpy']:>7.2f} | "
              f"{r['raw_put']:>6.2f} {r['seg_put']:>7.2f} {r['ours_put']:>6.2f} "
              f"{r['put_ratio']:>5.0%} ({r['put_vs_contig']:>4.0%}) | "
              f"{r['raw_get']:>6.2f} {r['seg_get']:>7.2f} {r['ours_get']:>6.2f} "
              f"{r['get_ratio']:>5.0%} ({r['get_vs_contig']:>4.0%})")
    print("ours get = staged (into slots, verified, scattered); background loads get straight "
          "into the blocks and verify them there:")
    for size, r in rows.items():
        print(f"{size >> 10:>6}Ki staged {r['ours_get']:.2f} GB/s, direct {r['ours_direct_get']:.2f} "
              f"GB/s ({r['direct_get_ratio']:.0%} of raw-seg)")
    worst = min(min(r["put_ratio"], r["get_ratio"]) for r in rows.values())
    print(f"target ours >= 80% of raw zero-copy (same segments): "
          f"{'met' if worst >= 0.8 else 'MISSED'} (worst ratio {worst:.0%})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({str(k): v for k, v in rows.items()}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
