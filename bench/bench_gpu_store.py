"""GPU data path throughput, side by side in one run (needs CUDA, a master and a holder).

4096 tokens of an 8B-class KV (32 layers, FlashAttention layout ``[2, blocks, 16,
8, 128]`` bf16, 2 MiB a block, 512 MiB a batch) saved from and loaded into GPU
memory by :class:`StoreClient`, against two ceilings measured in the same run:

* the raw store: Mooncake ``batch_put_from`` / ``batch_get_into`` of one
  contiguous registered pinned buffer per block (the fastest raw path);
* the copy: torch gather + device→host into pinned memory (and back).

Prints a table and writes ``$OUT/gpu_store.json``. Target: ours ≥ 80 % of raw.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from mooncake_vllm import codec
from mooncake_vllm.config import load_store_config
from mooncake_vllm.keys import KeyNamespace, chunk_keys
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.store import StagingSizes, StoreClient

L, H, D, BS = 32, 8, 128, 16


def gbps(nbytes: int, sec: float) -> float:
    return round(nbytes / sec / 1e9, 3)


def best(fn, reps: int) -> float:
    times = []
    for r in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn(r)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--cache-blocks", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    nb, total = args.blocks, args.cache_blocks
    res: dict = {"blocks": nb, "tokens": nb * BS, "device": torch.cuda.get_device_name()}
    config = load_store_config()
    client = StoreClient.connect(config, staging=StagingSizes(save_cuda=2 << 30, load=1 << 30))
    store = client._store
    kv = [torch.randn(2, total, BS, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(L)]
    layout = BlockLayout.from_kv_caches(kv)
    client.register_layout(layout)
    blk = layout.block_nbytes
    nbytes = nb * blk
    res["batch_bytes"] = nbytes

    # ---- ceiling 1: raw store from contiguous pinned host buffers (one per block)
    slot = codec.HEADER_SIZE + blk
    src = torch.randint(0, 255, (nb * slot,), dtype=torch.uint8).pin_memory()
    dst = torch.zeros_like(src).pin_memory()
    for t in (src, dst):
        assert store.register_buffer(t.data_ptr(), t.numel()) == 0
    def raw_put(r: int) -> None:
        keys = [f"raw/{r}/{i}" for i in range(nb)]
        codes = store.batch_put_from(keys, [src.data_ptr() + i * slot for i in range(nb)], [slot] * nb)
        assert all(c == 0 for c in codes), set(codes)
    def raw_get(r: int) -> None:
        keys = [f"raw/{r}/{i}" for i in range(nb)]
        codes = store.batch_get_into(keys, [dst.data_ptr() + i * slot for i in range(nb)], [slot] * nb)
        assert all(c == slot for c in codes), set(codes)
    res["raw_put_GBps"] = gbps(nbytes, best(raw_put, args.reps))
    res["raw_get_GBps"] = gbps(nbytes, best(raw_get, args.reps))
    res["raw_exact"] = bool(torch.equal(src, dst))

    # ---- ceiling 2: gather + D2H, H2D + scatter (torch, one stream)
    idx = torch.randperm(total, device="cuda")[:nb]
    pinned = torch.empty((nb, L, 2, BS * H * D * 2), dtype=torch.uint8).pin_memory()
    stage = torch.empty_like(pinned, device="cuda")
    views = layout.byte_views()
    def g2h(_r: int) -> None:
        for i, v in enumerate(views):
            stage[:, i].copy_(v.index_select(1, idx).transpose(0, 1))
        pinned.copy_(stage, non_blocking=True)
    def h2s(_r: int) -> None:
        stage.copy_(pinned, non_blocking=True)
        for i, v in enumerate(views):
            v.index_copy_(1, idx, stage[:, i].transpose(0, 1))
    res["gather_d2h_GBps"] = gbps(nbytes, best(g2h, args.reps))
    res["h2d_scatter_GBps"] = gbps(nbytes, best(h2s, args.reps))

    # ---- ours: put_blocks (snapshot through pinned slots) and get_blocks
    ns = KeyNamespace("bench-gpu", "bfloat16", layout.fingerprint, BS)
    perm = [int(b) for b in torch.randperm(total)]
    blocks, targets = perm[:nb], perm[nb:2 * nb]  # disjoint: a load never overwrites a source
    keysets = [chunk_keys(ns, list(range(r * 10**6, r * 10**6 + nb * BS))) for r in range(args.reps)]
    put_times, cap_times = [], []
    for r in range(args.reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        ticket = client.prepare_save(keysets[r], layout, blocks)
        cap_times.append(time.perf_counter() - t)
        stored = client.commit_save(ticket)
        put_times.append(time.perf_counter() - t)
        assert stored == nb, (stored, client.stats.snapshot())
    res["ours_put_GBps"] = gbps(nbytes, min(put_times))
    res["ours_capture_ms"] = round(min(cap_times) * 1e3, 2)
    get_times = []
    for r in range(args.reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        ok = client.get_blocks(keysets[r], layout, targets)
        torch.cuda.synchronize()
        get_times.append(time.perf_counter() - t)
        assert all(ok), sum(ok)
    res["ours_get_GBps"] = gbps(nbytes, min(get_times))
    src_idx, dst_idx = torch.tensor(blocks, device="cuda"), torch.tensor(targets, device="cuda")
    res["ours_exact"] = all(torch.equal(v.index_select(1, src_idx), v.index_select(1, dst_idx))
                            for v in views)
    res["put_vs_raw"] = round(res["ours_put_GBps"] / res["raw_put_GBps"], 3)
    res["get_vs_raw"] = round(res["ours_get_GBps"] / res["raw_get_GBps"], 3)
    res["stats"] = client.stats.snapshot()
    client.close()
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "gpu_store.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("| path | put GB/s | get GB/s |\n|---|---|---|")
    print(f"| raw Mooncake, contiguous pinned | {res['raw_put_GBps']} | {res['raw_get_GBps']} |")
    print(f"| torch gather+D2H / H2D+scatter | {res['gather_d2h_GBps']} | {res['h2d_scatter_GBps']} |")
    print(f"| ours (StoreClient, GPU KV) | {res['ours_put_GBps']} | {res['ours_get_GBps']} |")
    print(f"ours/raw: put {res['put_vs_raw']}, get {res['get_vs_raw']}; capture "
          f"{res['ours_capture_ms']} ms; exact {res['ours_exact']} raw_exact {res['raw_exact']}")


if __name__ == "__main__":
    main()
