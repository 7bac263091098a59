"""GPU data path throughput, side by side in one run (needs CUDA, a master and a holder).

4096 tokens of an 8B-class KV (32 layers, FlashAttention layout ``[2, blocks, 16,
8, 128]`` bf16, 2 MiB a block, 512 MiB a batch) saved from and loaded into GPU
memory by :class:`StoreClient`, against two ceilings measured in the same run:

* the raw store: Mooncake ``batch_put_from`` / ``batch_get_into`` of one
  contiguous registered pinned buffer per block (the fastest raw path);
* the raw GPU path: Mooncake multi-buffer put/get straight from the registered
  KV cache, one buffer per layer and K/V (what vLLM's in-tree connector does);
* the copy: torch gather + device→host into pinned memory (and back).

Ours on both GPU paths (``gpu_path``): ``staged`` (gather → pinned slots) and
``zero_copy`` (GPU checksums, header + GPU segments in one multi-buffer put;
background gets straight into the blocks, verified on the GPU).

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
    store = client.store
    kv = [torch.randn(2, total, BS, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(L)]
    layout = BlockLayout.from_kv_caches(kv)
    client.register_layout(layout, gpu_path="staged")
    zc = StoreClient.connect(config, staging=StagingSizes(load=64 << 20))
    zlayout = BlockLayout.from_kv_caches(kv)
    zc.register_layout(zlayout, gpu_path="zero_copy")
    res["zero_copy_path"] = zc.gpu_path(zlayout)
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

    # ---- raw GPU multi-buffer (vLLM's in-tree path): per-layer K/V buffers of registered KV
    gidx = [int(b) for b in torch.randperm(total)[:2 * nb]]
    gsrc, gdst = gidx[:nb], gidx[nb:]
    def segs(blocks: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        sl = [zlayout.segments(b) for b in blocks]
        return [[p for p, _ in x] for x in sl], [[n for _, n in x] for x in sl]
    def raw_gpu_put(r: int) -> None:
        ptrs, sizes = segs(gsrc)
        codes = zc.store.batch_put_from_multi_buffers([f"rawg/{r}/{i}" for i in range(nb)], ptrs, sizes)
        assert all(c == 0 for c in codes), set(codes)
    def raw_gpu_get(r: int) -> None:
        ptrs, sizes = segs(gdst)
        codes = zc.store.batch_get_into_multi_buffers([f"rawg/{r}/{i}" for i in range(nb)], ptrs, sizes)
        assert all(c >= 0 for c in codes), set(codes)
        res["raw_gpu_get_code"] = int(codes[0])
    if res["zero_copy_path"] == "zero_copy":
        res["raw_gpu_put_GBps"] = gbps(nbytes, best(raw_gpu_put, args.reps))
        res["raw_gpu_get_GBps"] = gbps(nbytes, best(raw_gpu_get, args.reps))

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

    # ---- ours, both GPU paths: prepare_save + commit_save, then get_blocks
    ns = KeyNamespace("bench-gpu", "bfloat16", layout.fingerprint, BS)
    perm = [int(b) for b in torch.randperm(total)]
    blocks, targets = perm[:nb], perm[nb:2 * nb]  # disjoint: a load never overwrites a source
    src_idx, dst_idx = torch.tensor(blocks, device="cuda"), torch.tensor(targets, device="cuda")
    for label, c, lay in (("staged", client, layout), ("zero_copy", zc, zlayout)):
        if c.gpu_path(lay) != label:
            res[f"{label}_error"] = f"path is {c.gpu_path(lay)}"
            continue
        base = {"staged": 1, "zero_copy": 2}[label] * 10**8
        keysets = [chunk_keys(ns, list(range(base + r * 10**6, base + r * 10**6 + nb * BS)))
                   for r in range(args.reps)]
        put_times, cap_times = [], []
        for r in range(args.reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            ticket = c.prepare_save(keysets[r], lay, blocks)
            cap_times.append(time.perf_counter() - t)
            stored = c.commit_save(ticket)
            put_times.append(time.perf_counter() - t)
            assert stored == nb, (label, stored, c.stats.snapshot())
        res[f"{label}_put_GBps"] = gbps(nbytes, min(put_times))
        res[f"{label}_capture_ms"] = round(min(cap_times) * 1e3, 2)
        get_times = []
        for r in range(args.reps):
            for v in views:  # a load must really write: clear the targets first
                v.index_fill_(1, dst_idx, 0)
            torch.cuda.synchronize()
            t = time.perf_counter()
            # as vLLM's worker loads: in the background, after its stream position
            ok = c.get_blocks(keysets[r], lay, targets, after=c.stream_position(lay),
                              background=True)
            torch.cuda.synchronize()
            get_times.append(time.perf_counter() - t)
            assert all(ok), (label, sum(ok), c.stats.snapshot())
        res[f"{label}_get_GBps"] = gbps(nbytes, min(get_times))
        res[f"{label}_exact"] = all(torch.equal(v.index_select(1, src_idx), v.index_select(1, dst_idx))
                                    for v in views)
        res[f"{label}_put_vs_raw"] = round(res[f"{label}_put_GBps"] / res["raw_put_GBps"], 3)
        res[f"{label}_get_vs_raw"] = round(res[f"{label}_get_GBps"] / res["raw_get_GBps"], 3)
        res[f"{label}_stats"] = c.stats.snapshot()
    # the values each path wrote are read by the other (one wsum64 format)
    if "zero_copy_put_GBps" in res and "staged_put_GBps" in res:
        k0 = chunk_keys(ns, list(range(10**8, 10**8 + 8 * BS)))
        k1 = chunk_keys(ns, list(range(2 * 10**8, 2 * 10**8 + 8 * BS)))
        a = zc.get_blocks(k0, zlayout, targets[:8], after=zc.stream_position(zlayout), background=True)
        b = client.get_blocks(k1, layout, targets[8:16])
        torch.cuda.synchronize()
        res["cross_read_ok"] = all(a) and all(b)
    zc.close()
    client.close()
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "gpu_store.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("| path | put GB/s | get GB/s |\n|---|---|---|")
    print(f"| raw Mooncake, contiguous pinned | {res['raw_put_GBps']} | {res['raw_get_GBps']} |")
    print(f"| torch gather+D2H / H2D+scatter | {res['gather_d2h_GBps']} | {res['h2d_scatter_GBps']} |")
    print(f"| raw Mooncake, GPU multi-buffer (in-tree's path) | {res.get('raw_gpu_put_GBps', '-')} "
          f"| {res.get('raw_gpu_get_GBps', '-')} |")
    for label in ("staged", "zero_copy"):
        print(f"| ours, gpu_path={label} | {res.get(label + '_put_GBps', '-')} "
              f"| {res.get(label + '_get_GBps', '-')} |")
    for label in ("staged", "zero_copy"):
        print(f"{label}: /raw put {res.get(label + '_put_vs_raw')}, get {res.get(label + '_get_vs_raw')}; "
              f"capture {res.get(label + '_capture_ms')} ms; exact {res.get(label + '_exact')} "
              f"{res.get(label + '_error', '')}")
    print(f"raw_exact {res['raw_exact']} cross_read_ok {res.get('cross_read_ok')} "
          f"zero_copy_path {res['zero_copy_path']}")


if __name__ == "__main__":
    main()
