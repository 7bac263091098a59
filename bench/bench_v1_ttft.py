"""TTFT of the V1 connector on the real vLLM V1 engine (CPU) vs recompute and vs vLLM's in-tree one.

One run, one local Mooncake stack (master + metadata + one pool holder), a random
Llama big enough that prefill costs real time on 2 cores. Every vLLM instance is
its own process, started after the previous one exited::

    recompute     no connector
    ours-miss     our connector, prompts not in the pool (they get saved)   → miss overhead
    ours-hit      our connector, a NEW process, same prompts                → cross-instance hit
    intree-miss   vLLM's in-tree MooncakeStoreConnector (standalone-store), saving
    intree-hit    the in-tree connector, a NEW process, same prompts

All instances pin the same core budget (VLLM_CPU_NUM_OF_RESERVED_CPU=1), since
enabling any connector otherwise changes vLLM's CPU thread count. Save/load GB/s
of our connector (from its store counters) is compared with the raw Mooncake
client ceiling (batch_put_from / batch_get_into of the same object size from one
registered buffer, measured in this process against the same holder).

Writes ``<out>/bench_v1_ttft.json`` and ``<out>/bench_v1_ttft.png``::

    .venv/bin/python bench/bench_v1_ttft.py --out bench/results
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mooncake_vllm.demo.run import kv_transfer_config, run_instance
from mooncake_vllm.demo.tiny_model import build_tiny_model, default_cache_dir, tiny_model_params
from mooncake_vllm.services import LocalStack

#: 16384 positions: bench_serving's 8k prompts stay inside them (vLLM's CPU RoPE reads its
#: table unchecked, so prompts past 4096 made the 8k hits' tokens undefined in every mode)
MODEL = {"num_layers": 12, "hidden_size": 512, "intermediate_size": 1536, "num_heads": 8,
         "num_kv_heads": 4, "head_dim": 64, "max_positions": 16384}
BYTES_PER_TOKEN = MODEL["num_layers"] * 2 * MODEL["num_kv_heads"] * MODEL["head_dim"] * 4


def _model() -> Path:
    key = hashlib.sha256(json.dumps(tiny_model_params(**MODEL), sort_keys=True).encode())
    return build_tiny_model(default_cache_dir() / f"bench-llama-{key.hexdigest()[:12]}", **MODEL)


def _ceiling(stack: LocalStack, block_nbytes: int, count: int, reps: int = 3) -> dict[str, float]:
    """Raw client put/get GB/s for ``count`` objects of ``block_nbytes`` (one registered buffer)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", stack.metadata_url, 0, 256 << 20, "tcp", "", stack.master_address)
    if rc != 0:
        raise RuntimeError(f"raw client setup returned {rc}")
    buf = (ctypes.c_char * (block_nbytes * count))()
    ptr = ctypes.addressof(buf)
    ctypes.memset(ptr, 7, block_nbytes * count)
    store.register_buffer(ptr, block_nbytes * count)
    ptrs = [ptr + i * block_nbytes for i in range(count)]
    sizes = [block_nbytes] * count
    put, get = [], []
    try:
        for r in range(reps):
            keys = [f"bench-ceiling/{r}/{i}" for i in range(count)]
            t = time.perf_counter()
            codes = store.batch_put_from(keys, ptrs, sizes)
            put.append(time.perf_counter() - t)
            assert all(c == 0 for c in codes), codes
            t = time.perf_counter()
            codes = store.batch_get_into(keys, ptrs, sizes)
            get.append(time.perf_counter() - t)
            assert all(c == block_nbytes for c in codes), codes
    finally:
        store.close()
    total = block_nbytes * count / 1e9
    return {"put_gbps": total / statistics.median(put), "get_gbps": total / statistics.median(get)}


def _ttfts(result: dict[str, Any], lengths: list[int]) -> dict[int, float]:
    by_len: dict[int, list[float]] = {n: [] for n in lengths}
    for r in result["results"]:
        by_len[r["prompt_len"]].append(r["ttft_s"])
    return {n: statistics.median(v) for n, v in by_len.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--lengths", default="1000,4000")
    parser.add_argument("--reps", type=int, default=3, help="distinct prompts per length")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--skip-intree", action="store_true")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = _model()
    rnd = random.Random(42)
    prompts = [[rnd.randrange(10, 2000) for _ in range(n)] for n in lengths for _ in range(args.reps)]
    work = Path(tempfile.mkdtemp(prefix="bench-v1-"))
    kw = dict(max_tokens=1, ttft_only=True, warmup=1, block_size=args.block_size,
              max_model_len=max(lengths) + 64, kv_bytes=1 << 30, timeout=1800.0)
    runs: dict[str, dict[str, Any]] = {}
    with LocalStack(work / "stack", segment_size=2 << 30, local_buffer_size=256 << 20) as stack:
        # both connectors read one file: ours ignores "mode", the in-tree one needs it
        cfg = {**stack.config(), "mode": "standalone-store"}
        cfg_path = work / "mooncake_config.json"
        cfg_path.write_text(json.dumps(cfg))
        env = {**stack.env(), "MOONCAKE_CONFIG_PATH": str(cfg_path),
               "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1"}
        plan = [("recompute", "none", {}), ("ours-miss", "kv_both", {}),
                ("ours-hit", "kv_both", {})]
        if not args.skip_intree:
            intree = kv_transfer_config("kv_both", connector="in-tree")
            off = {"MOONCAKE_VLLM_DISABLE": "1"}  # keep the name for vLLM's own class
            plan += [("intree-miss", "kv_both", {"cfg": intree, "env": off}),
                     ("intree-hit", "kv_both", {"cfg": intree, "env": off})]
        for name, role, extra in plan:
            print(f"[bench] {name} ...", flush=True)
            try:
                runs[name] = run_instance(model, prompts, work, role=role, name=name,
                                          env={**env, **extra.get("env", {})},
                                          kv_config=extra.get("cfg"), **kw)
            except RuntimeError as exc:
                runs[name] = {"error": str(exc)[-2000:]}
                print(f"[bench] {name} failed: {str(exc)[-600:]}", flush=True)
        ceiling = _ceiling(stack, BYTES_PER_TOKEN * args.block_size, 32)
    report: dict[str, Any] = {"model": MODEL, "block_size": args.block_size, "lengths": lengths,
                              "reps": args.reps, "bytes_per_token": BYTES_PER_TOKEN,
                              "ttft_s": {}, "ceiling": ceiling}
    for name, res in runs.items():
        if "error" in res:
            report["ttft_s"][name] = {"error": res["error"]}
            continue
        report["ttft_s"][name] = _ttfts(res, lengths)
        report.setdefault("external_hits", {})[name] = res["metrics"]["vllm:external_prefix_cache_hits"]
    c_miss = runs.get("ours-miss", {}).get("connector", {})
    c_hit = runs.get("ours-hit", {}).get("connector", {})
    if c_miss.get("store_put_us"):
        report["ours_save_gbps"] = c_miss["store_bytes_put"] / c_miss["store_put_us"] / 1e3
    if c_hit.get("store_get_us"):
        report["ours_load_gbps"] = c_hit["store_bytes_got"] / c_hit["store_get_us"] / 1e3
    t = report["ttft_s"]
    derived: dict[str, Any] = {}
    for n in lengths:
        rec = t.get("recompute", {}).get(n)
        hit = t.get("ours-hit", {}).get(n)
        miss = t.get("ours-miss", {}).get(n)
        ith = t.get("intree-hit", {}).get(n) if isinstance(t.get("intree-hit"), dict) else None
        derived[n] = {
            "hit_over_recompute": hit / rec if rec and hit else None,
            "miss_overhead": miss / rec - 1 if rec and miss else None,
            "ours_over_intree_hit": hit / ith if hit and ith else None,
        }
    report["derived"] = derived
    (out / "bench_v1_ttft.json").write_text(json.dumps(report, indent=2, default=str))
    _plot(report, out / "bench_v1_ttft.png")
    print(json.dumps({k: report[k] for k in ("ttft_s", "derived", "ceiling")
                      if k in report}, indent=2, default=str))
    for k in ("ours_save_gbps", "ours_load_gbps"):
        if k in report:
            print(f"{k}: {report[k]:.2f}")
    return 0


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or None (said on stderr) when not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib missing: no plot", file=sys.stderr)
        return None
    return plt


def _plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, by_len in report["ttft_s"].items():
        if not isinstance(by_len, dict) or "error" in by_len:
            continue
        xs = sorted(int(k) for k in by_len)
        ax.plot(xs, [by_len[x] for x in xs], marker="o", label=name)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s)")
    ax.set_yscale("log")
    ax.set_title("vLLM V1 on CPU: TTFT by mode (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
