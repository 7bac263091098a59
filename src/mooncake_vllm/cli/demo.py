"""``mooncake-vllm demo``: see a prefix served from the Mooncake pool in one command.

Brings up the local stack (master, metadata, pool holder on 127.0.0.1), builds a
random Llama offline if needed, then runs two separate vLLM processes on the same
long prompt: instance A computes it and saves its KV to the pool; instance B,
started after A exited, loads the prefix from the pool. Prints tokens served from
the pool, TTFT of B vs A, and whether the outputs are identical. Every process it
started is stopped, also on error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["configure", "run", "summarize"]

#: A model big enough that prefill costs real time on a laptop CPU, still built in seconds.
DEMO_MODEL = {"num_layers": 8, "hidden_size": 512, "intermediate_size": 1024, "num_heads": 8,
              "num_kv_heads": 2, "head_dim": 64}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", type=int, default=2000,
                        help="length of the shared long prompt (default 2000)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default 16)")
    parser.add_argument("--model", default=None,
                        help="model directory (default: build a random 8-layer Llama offline)")
    parser.add_argument("--tiny", action="store_true",
                        help="use the 2-layer test model (fast, but prefill is too cheap to show a gain)")
    parser.add_argument("--workdir", default=None, help="logs and configs (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--ssd", metavar="DIR", default=None,
                        help="run the pool with a disk tier in DIR (docs/ssd-tier.md; default: DRAM only)")
    parser.add_argument("--ssd-size", default="4GB", help="disk the tier may fill (default 4GB)")


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def _model(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from mooncake_vllm.demo.tiny_model import build_tiny_model, default_cache_dir, tiny_model_params

    params = {} if args.tiny else dict(DEMO_MODEL)
    import hashlib
    import json

    key = hashlib.sha256(json.dumps(tiny_model_params(**params), sort_keys=True).encode())
    path = default_cache_dir() / f"{'tiny' if args.tiny else 'demo'}-llama-{key.hexdigest()[:12]}"
    t0 = time.monotonic()
    built = build_tiny_model(path, **params)
    _say(f"model: {built} ({time.monotonic() - t0:.1f} s)")
    return built


def _pool_tokens(b: dict[str, Any]) -> int:
    """Tokens instance B got from the pool, as the installed vLLM can tell."""
    from mooncake_vllm.demo.run import counts_connector_hits

    if counts_connector_hits():
        return int(b["metrics"]["vllm:external_prefix_cache_hits"])  # missing = broken metrics, never "0"
    return int(b["results"][0]["cached_tokens"])  # B is a fresh process: its cached tokens came from the pool


def summarize(a: dict[str, Any], b: dict[str, Any], prompt_len: int) -> tuple[str, bool]:
    """The result table, and whether the demo showed what it should."""
    ra, rb = a["results"][0], b["results"][0]
    pool = _pool_tokens(b)
    same = ra["tokens"] == rb["tokens"]
    rows = [
        ("prompt tokens", f"{prompt_len}", f"{prompt_len}"),
        ("tokens served from the pool", "0", f"{pool}"),
        ("time to first token", f"{ra['ttft_s']:.3f} s", f"{rb['ttft_s']:.3f} s"),
        ("output", " ".join(map(str, ra["tokens"][:6])) + " …",
         "identical to A" if same else "DIFFERENT from A"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':{width}}  {'instance A (computes)':>24}  {'instance B (from pool)':>24}"]
    lines += [f"{name:{width}}  {va:>24}  {vb:>24}" for name, va, vb in rows]
    speed = ra["ttft_s"] / rb["ttft_s"] if rb["ttft_s"] > 0 else float("inf")
    if speed >= 1:
        lines.append(f"B's first token came {speed:.1f}x faster than A's.")
    else:
        lines.append("B was not faster: this model's prefill is cheaper than a pool load "
                     "(run without --tiny to see the gain).")
    return "\n".join(lines), same and pool > 0


def run(args: argparse.Namespace) -> int:
    from mooncake_vllm.compat.facts import installed_facts
    from mooncake_vllm.config import parse_size
    from mooncake_vllm.demo.run import run_instance
    from mooncake_vllm.services import DiskTier, LocalStack, ServiceError
    from mooncake_vllm.settings import auto_store_clients

    facts = installed_facts()
    if facts is not None and not facts.load_error_reporting:
        print(f"mooncake-vllm demo: vLLM {facts.release} cannot recompute a block whose load fails "
              "(load error reporting came in vLLM 0.11.1), so the connector saves to the pool but "
              "never loads from it there: instance B could not be served from the pool. Fix: run "
              "the demo with vLLM >= 0.11.1 (the same pool and keys)", file=sys.stderr)
        return 1
    tmp = None
    if args.workdir:
        work = Path(args.workdir)
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="mooncake-vllm-demo-")
        work = Path(tmp.name)
    progress = lambda comp, state, detail: _say(f"{comp} {state} {detail}".rstrip())  # noqa: E731
    try:
        disk = DiskTier(Path(args.ssd), parse_size(args.ssd_size, field="--ssd-size")) if args.ssd else None
        model = _model(args)
        prompt = [random.Random(7).randrange(10, 2000) for _ in range(args.prompt_tokens)]
        # vLLM's CPU default block size: few, large objects move fastest
        kw = dict(max_tokens=args.max_tokens, warmup=1, max_model_len=args.prompt_tokens + 64,
                  kv_bytes=512 << 20, block_size=128)
        with LocalStack(work / "stack", segment_size=1 << 30, local_buffer_size=128 << 20,
                        progress=progress, holders=auto_store_clients(), disk=disk) as stack:
            _say(f"config: {stack.config_path} (global_segment_size \"0\": vLLM holds no pool memory)")
            _say("instance A: computing the prompt and saving its KV to the pool ...")
            a = run_instance(model, [prompt], work, env=stack.env(), name="instance-A", **kw)
            _say("instance A exited; instance B (a new process) asks the pool ...")
            b = run_instance(model, [prompt], work, env=stack.env(), name="instance-B", **kw)
        table, ok = summarize(a, b, len(prompt))
        print(table, flush=True)
        if not ok:
            _say(f"the pool did not serve instance B as expected; logs in {work}")
            return 1
        return 0
    except (ServiceError, RuntimeError, OSError, ValueError) as exc:
        print(f"mooncake-vllm demo: {exc}", file=sys.stderr)
        return 1
    finally:
        if tmp is not None and not args.keep:
            tmp.cleanup()
        elif tmp is not None:
            _say(f"work directory kept: {work}")
