"""What a hung or full pool costs the engine, measured against real services.

1. **Hung master** (a real ``mooncake_master`` SIGSTOP'd: it accepts TCP and never
   answers): the added latency of each request's pool calls (lookup + load + save
   capture/commit as the V1 connector makes them), and the time until a finished
   request's blocks are released by the worker (zero-copy and snapshot saves).
2. **Full pool** (a 16 MiB holder): warning lines per minute while saves keep coming.

    .venv/bin/python bench/bench_faults.py [--full-seconds 65]

Prints one table; numbers depend on the machine (report them with its description).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import statistics
import tempfile
import time

import numpy as np

from mooncake_vllm.config import load_store_config
from mooncake_vllm.keys import KeyNamespace, chunk_keys
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.services import LocalStack
from mooncake_vllm.store import StoreClient
from mooncake_vllm.v1.client import SharedClient
from mooncake_vllm.v1.metadata import BlockJob, MooncakeConnectorMetadata
from mooncake_vllm.v1.namespace import ExpectedLayout
from mooncake_vllm.v1.worker import WorkerLogic


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _cache_on(client: StoreClient, name: str, shape: tuple[int, ...]
              ) -> tuple[list[np.ndarray], BlockLayout, KeyNamespace]:
    """Two layers of random host KV of ``shape``, registered, and a namespace for them."""
    kv = [np.random.default_rng(i).standard_normal(shape, dtype=np.float32) for i in range(2)]
    layout = BlockLayout.from_kv_caches(kv)
    client.register_layout(layout)
    return kv, layout, KeyNamespace(name, "float32", layout.fingerprint, shape[2])


def _request(client: StoreClient, layout: BlockLayout, keys: list[str]) -> float:
    t0 = time.perf_counter()
    client.longest_prefix(keys)
    client.get_blocks(keys[:2], layout, [1, 2])
    client.commit_save(client.prepare_save(keys[2:4], layout, [3, 4]))
    return time.perf_counter() - t0


def hung_master(work: str) -> dict:
    stack = LocalStack(work, segment_size=256 << 20, local_buffer_size=64 << 20).start()
    out: dict = {}
    try:
        os.environ.update(stack.env())
        client = StoreClient.connect(load_store_config(stack.config_path))
        kv, layout, ns = _cache_on(client, "faults", (16, 2, 64, 1024))
        base = [_request(client, layout, chunk_keys(ns, list(range(i * 640, i * 640 + 640))))
                for i in range(20)]
        # a worker connected while the pool was healthy (its own client, as in vLLM)
        shared = SharedClient(load_store_config(stack.config_path))
        assert shared.start() is not None
        expected = ExpectedLayout("cpu", "", "float32", 2, (2, 64, 1024))
        worker = WorkerLogic(ns, expected, shared, can_load=False, can_save=True)
        worker.register_kv_caches({f"l{i}": t for i, t in enumerate(kv)})
        os.kill(stack.master.pid, signal.SIGSTOP)
        try:
            hung = [_request(client, layout, chunk_keys(ns, list(range(10**6 + i * 640,
                                                                        10**6 + i * 640 + 640))))
                    for i in range(50)]
            # a finished request whose zero-copy save meets the hung master
            t0 = time.monotonic()
            worker.wait_for_save(MooncakeConnectorMetadata(saves=[
                BlockJob("r", [f"{0xfa17 + i:032x}" for i in range(4)], [4, 5, 6, 7])]))
            freed: set[str] = set()
            first = True
            while not freed and time.monotonic() - t0 < 120:
                freed, _ = worker.get_finished({"r"} if first else set())
                first = False
                time.sleep(0.01)
            out["blocks_freed_after_s"] = round(time.monotonic() - t0, 2)
            worker.shutdown(timeout=1)
        finally:
            os.kill(stack.master.pid, signal.SIGCONT)
        out["healthy_ms_p50"] = round(statistics.median(base) * 1e3, 2)
        out["hung_first_ms"] = round(hung[0] * 1e3, 1)
        out["hung_ms_p50"] = round(statistics.median(hung[1:]) * 1e3, 3)
        out["hung_ms_max_after_first"] = round(max(hung[1:]) * 1e3, 3)
        client.close()
    finally:
        stack.stop()
    return out


def full_pool(work: str, seconds: float) -> dict:
    stack = LocalStack(work, segment_size=16 << 20, local_buffer_size=16 << 20).start()
    counter = _Count()
    logging.getLogger("mooncake_vllm").addHandler(counter)
    try:
        client = StoreClient.connect(load_store_config(stack.config_path))
        _kv, layout, ns = _cache_on(client, "full", (64, 2, 32, 256))
        t0, i = time.monotonic(), 0
        while time.monotonic() - t0 < seconds:
            client.put_blocks(chunk_keys(ns, list(range(i * 2048, i * 2048 + 2048))), layout,
                              list(range(64)))
            i += 1
            time.sleep(0.05)
        elapsed = time.monotonic() - t0
        stats = client.stats.snapshot()
        client.close()
    finally:
        logging.getLogger("mooncake_vllm").removeHandler(counter)
        stack.stop()
    return {"seconds": round(elapsed, 1), "save_batches": i,
            "warning_lines": len(counter.lines),
            "lines_per_minute": round(len(counter.lines) / elapsed * 60, 2),
            "failed_puts": sum(v for k, v in stats.items() if k.startswith("put_failed_")),
            "saves_skipped_backpressure": stats.get("saves_skipped", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full-seconds", type=float, default=65.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mcv-faults-") as work:
        hung = hung_master(os.path.join(work, "hung"))
        full = full_pool(os.path.join(work, "full"), args.full_seconds)
    print("hung master (SIGSTOP'd: accepts TCP, never answers); one request = lookup + "
          "load 2 blocks + save 2 blocks")
    for k, v in hung.items():
        print(f"  {k:28} {v}")
    print("full pool (16 MiB holder, 64 x 256 KiB blocks saved every 50 ms)")
    for k, v in full.items():
        print(f"  {k:28} {v}")


if __name__ == "__main__":
    main()
