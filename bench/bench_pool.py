"""Striped transfers against the machine's parallel ceiling, side by side in one run.

The pool from ``$MOONCAKE_CONFIG_PATH`` (several holders: scripts/gpu/mc_up.sh with
MC_HOLDERS, or ``--local-stack H``). For each client count C:

* **raw, one process** — C Mooncake store clients in this process, each a thread,
  ``batch_put_from`` / ``batch_get_into`` of 2 MiB blocks from / into registered
  pinned memory (the in-process parallel ceiling);
* **raw, C processes** — the same with one client per process (how the ceiling was
  first measured: does one process reach what several do?);
* **ours** — :class:`StoreClient` with ``clients=C`` (lanes), an 8B-class KV cache
  (32 layers, FlashAttention ``[2, blocks, 16, 8, 128]`` bf16, 2 MiB a block) in
  CUDA memory (``--device cpu``: host memory, the CPU dry run): ``put_blocks`` and a
  background ``get_blocks`` into other blocks, byte-exact.

Aggregate GB/s = payload bytes / wall time; best of ``--reps``. Writes ``--out``
(JSON) and prints the table with ours / raw (same C). Target (issue 24): ours ≥ 80 %
of the parallel ceiling.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import threading
import time
from pathlib import Path
from typing import Any

L, H, D, BS = 32, 8, 128, 16
BLK = 2 * BS * H * D * 2 * L  #: bytes of one block of the 8B-class KV (2 MiB)


def _store(config: Any, buffer: int = 64 << 20) -> Any:
    from mooncake_vllm.store.connect import open_store

    lane = __import__("dataclasses").replace(config, global_segment_size=0, local_buffer_size=buffer)
    return open_store(lane, timeout=10.0).store


def _pinned(nbytes: int, device: str) -> Any:
    import torch

    t = torch.empty(nbytes, dtype=torch.uint8)
    return t.pin_memory() if device == "cuda" else t


def _raw_threads(config: Any, clients: int, blocks: int, reps: int, device: str,
                 tag: str) -> dict[str, float]:
    """C clients in this process, one thread each: put then get ``blocks`` blocks."""
    import torch

    stores = [_store(config) for _ in range(clients)]
    src = _pinned(blocks * BLK, device)
    src.copy_(torch.randint(0, 255, (blocks * BLK,), dtype=torch.uint8))
    dst = _pinned(blocks * BLK, device)
    for s in stores:
        assert s.register_buffer(src.data_ptr(), src.numel()) == 0
        assert s.register_buffer(dst.data_ptr(), dst.numel()) == 0
    share = [list(range(i, blocks, clients)) for i in range(clients)]
    best = {"put": 1e9, "get": 1e9}
    for r in range(reps):
        keys = [f"ceil/{tag}/{r}/{i}" for i in range(blocks)]
        for op in ("put", "get"):
            errors: list[Any] = []

            def work(c: int) -> None:
                idx, s = share[c], stores[c]
                for b in range(0, len(idx), 64):
                    part = idx[b:b + 64]
                    ks = [keys[i] for i in part]
                    if op == "put":
                        codes = s.batch_put_from(ks, [src.data_ptr() + i * BLK for i in part],
                                                 [BLK] * len(part))
                        errors.extend(c for c in codes if c != 0)
                    else:
                        codes = s.batch_get_into(ks, [dst.data_ptr() + i * BLK for i in part],
                                                 [BLK] * len(part))
                        errors.extend(c for c in codes if c != BLK)

            t0 = time.perf_counter()
            threads = [threading.Thread(target=work, args=(c,)) for c in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            dt = time.perf_counter() - t0
            assert not errors, f"{op}: {sorted(set(errors))[:5]}"
            best[op] = min(best[op], dt)
        assert torch.equal(src, dst)
        for k in keys:
            stores[0].remove(k)
    for s in stores:
        s.close()
    return {f"{op}_GBps": round(blocks * BLK / t / 1e9, 3) for op, t in best.items()}


def _proc_reader(config_path: str, keys: list[str], barrier: Any, q: Any) -> None:
    import torch

    from mooncake_vllm.config import load_store_config

    s = _store(load_store_config(config_path))
    buf = torch.empty(len(keys) * BLK, dtype=torch.uint8).pin_memory() \
        if torch.cuda.is_available() else torch.empty(len(keys) * BLK, dtype=torch.uint8)
    assert s.register_buffer(buf.data_ptr(), buf.numel()) == 0
    barrier.wait()
    t0 = time.time()
    ok = 0
    for b in range(0, len(keys), 64):
        part = keys[b:b + 64]
        codes = s.batch_get_into(part, [buf.data_ptr() + (b + i) * BLK for i in range(len(part))],
                                 [BLK] * len(part))
        ok += sum(c == BLK for c in codes)
    q.put((t0, time.time(), ok))
    s.close()


def _raw_processes(config: Any, config_path: str, clients: int, blocks: int,
                   device: str) -> dict[str, float]:
    """Get with one client per process (the blocks put from this process first)."""
    import torch

    s = _store(config)
    src = _pinned(blocks * BLK, device)
    src.copy_(torch.randint(0, 255, (blocks * BLK,), dtype=torch.uint8))
    assert s.register_buffer(src.data_ptr(), src.numel()) == 0
    keys = [f"ceilp/{clients}/{i}" for i in range(blocks)]
    for b in range(0, blocks, 64):
        codes = s.batch_put_from(keys[b:b + 64], [src.data_ptr() + i * BLK for i in range(b, min(blocks, b + 64))],
                                 [BLK] * len(keys[b:b + 64]))
        assert all(c == 0 for c in codes), set(codes)
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(clients), ctx.Queue()
    procs = [ctx.Process(target=_proc_reader, args=(config_path, keys[i::clients], barrier, q))
             for i in range(clients)]
    for p in procs:
        p.start()
    outs = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(30)
    for k in keys:
        s.remove(k)
    s.close()
    t0, t1 = min(o[0] for o in outs), max(o[1] for o in outs)
    assert sum(o[2] for o in outs) == blocks
    return {"get_GBps": round(blocks * BLK / (t1 - t0) / 1e9, 3)}


def _ours(config: Any, clients: int, blocks: int, reps: int, device: str) -> dict[str, Any]:
    import torch

    from mooncake_vllm.keys import KeyNamespace, chunk_keys
    from mooncake_vllm.layout import BlockLayout
    from mooncake_vllm.store import StagingSizes, StoreClient

    client = StoreClient.connect(config, staging=StagingSizes(save_cuda=3 << 30, save_host=3 << 30,
                                                              load=1 << 30))
    total = 2 * blocks
    kv = [torch.randn(2, total, BS, H, D, dtype=torch.bfloat16, device=device) for _ in range(L)]
    layout = BlockLayout.from_kv_caches(kv)
    client.register_layout(layout, gpu_path="staged", clients=clients)
    assert layout.block_nbytes == BLK, layout.block_nbytes
    best = {"put": 1e9, "get": 1e9}
    exact = True
    for r in range(reps):
        keys = chunk_keys(KeyNamespace("bench-pool", "bfloat16", layout.fingerprint, BS),
                          [r * 10_000_000 + clients * 1_000_000 + i for i in range(blocks * BS)])
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        stored = client.put_blocks(keys, layout, list(range(blocks)))
        best["put"] = min(best["put"], time.perf_counter() - t0)
        assert stored == blocks, (stored, client.stats.snapshot())
        after = client.stream_position(layout)
        t0 = time.perf_counter()
        ok = client.get_blocks(keys, layout, list(range(blocks, total)), after=after, background=True)
        best["get"] = min(best["get"], time.perf_counter() - t0)
        assert all(ok), client.stats.snapshot()
        exact = exact and all(torch.equal(t[:, :blocks], t[:, blocks:]) for t in kv)
        client.remove_matching("^mcv/")
    out: dict[str, Any] = {f"{op}_GBps": round(blocks * BLK / t / 1e9, 3) for op, t in best.items()}
    out.update(lanes=client.lanes, exact=exact)
    client.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--ours-clients", default="1,4")
    ap.add_argument("--process-clients", default="4")
    ap.add_argument("--blocks", type=int, default=1024, help="2 MiB each (1024: 16k tokens)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--local-stack", type=int, default=0, help="start a stack of N holders (dry run)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "pool.json"))
    args = ap.parse_args(argv)
    from mooncake_vllm.config import load_store_config

    stack = None
    if args.local_stack:
        from mooncake_vllm.services import LocalStack

        stack = LocalStack(Path(os.environ.get("TMPDIR", "/tmp")) / "bench-pool",
                           segment_size=max(4, args.local_stack) * (1 << 30) // 2,
                           holders=args.local_stack).start()
        os.environ.update(stack.env())
    config_path = os.environ["MOONCAKE_CONFIG_PATH"]
    config = load_store_config(config_path)
    res: dict[str, Any] = {"blocks": args.blocks, "block_bytes": BLK, "cpu_count": os.cpu_count(),
                           "device": args.device, "raw_threads": {}, "raw_processes": {}, "ours": {},
                           "started": time.strftime("%F %T")}
    try:
        import torch
        if args.device == "cuda":
            res["gpu"] = torch.cuda.get_device_name()
        for c in map(int, args.clients.split(",")):
            res["raw_threads"][c] = _raw_threads(config, c, args.blocks, args.reps, args.device, f"t{c}")
            print(f"[pool] raw, {c} client(s) in one process: {res['raw_threads'][c]}", flush=True)
        for c in map(int, filter(None, args.process_clients.split(","))):
            res["raw_processes"][c] = _raw_processes(config, config_path, c, args.blocks, args.device)
            print(f"[pool] raw, {c} processes: {res['raw_processes'][c]}", flush=True)
        for c in map(int, args.ours_clients.split(",")):
            res["ours"][c] = o = _ours(config, c, args.blocks, args.reps, args.device)
            raw = res["raw_threads"].get(c) or {}
            ceiling = {k: max(v[k] for v in res["raw_threads"].values()) for k in ("put_GBps", "get_GBps")}
            o["of_raw_same_clients"] = {k: round(o[k] / raw[k], 3) for k in ("put_GBps", "get_GBps")
                                        if raw.get(k)}
            o["of_best_raw"] = {k: round(o[k] / ceiling[k], 3) for k in ceiling}
            print(f"[pool] ours, {c} client(s): {o}", flush=True)
    finally:
        res["finished"] = time.strftime("%F %T")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
        if stack is not None:
            stack.stop()
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
