"""What one new request costs vLLM's thread in the V1 scheduler's lookup hook, by prompt length.

The H100 mixed serving of 2026-12-06 spent 0.3-0.4 ms a request in
``get_num_new_matched_tokens`` with 16-token chunks and a 2k prefix vLLM already held (the
first-token steps of each wave of requests waited for all of them). This drives the
scheduler's logic alone (no engine, no pool: a healthy pool's answers from a callable) with
prompts that share a long prefix vLLM holds and end in a new question, as a serving engine
sees them, and prints per prefix length the median microseconds of the lookup hook and of
``request_finished``, and where the lookup's time goes (cProfile, by function).

    python3 bench/bench_lookup_cost.py [--lengths 2048,8192,32768] [--block-size 16]
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import pstats
import random
import statistics
import sys
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from mooncake_vllm.keys import KeyNamespace
from mooncake_vllm.v1.claims import ClaimAdvisor, ClaimRules
from mooncake_vllm.v1.namespace import RankNamespaces
from mooncake_vllm.v1.scheduler import SchedulerLogic

__all__ = ["main", "measure"]


def _declining(clock: list[float]) -> ClaimAdvisor:
    """A measured policy that declines short spans (a pool slower than recomputing them)."""
    a = ClaimAdvisor(ClaimRules("auto", explore_every=1e9), clock=lambda: clock[0], background=False)
    a.observe(steps=[(m, m * m / 2, m, m / 16) for m in (512.0, 1024.0, 2048.0)],
              loads=[(16.0, 5.0)] * 4)
    return a


def _block_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """Chained content hashes of the full blocks, as vLLM's prefix cache names them."""
    parent, out = b"", []
    for i in range(len(tokens) // block_size):
        parent = hashlib.sha256(parent + repr(tokens[i * block_size:(i + 1) * block_size]).encode()).digest()
        out.append(parent)
    return out


def _request(req_id: str, tokens: list[int], block_size: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, lora_request=None,
                           cache_salt=None, mm_features=[], max_tokens=64, num_output_tokens=0,
                           block_hashes=_block_hashes(tokens, block_size))


def measure(length: int, block_size: int = 16, requests: int = 40, question: int = 100,
            seed: int = 0) -> dict[str, Any]:
    """Median µs of the lookup hook and of ``request_finished`` for requests whose first
    ``length`` tokens vLLM holds, and the lookup's top functions (own time, µs a request)."""
    rng = random.Random(seed)
    clock = [0.0]
    ns = KeyNamespace("bench", "bfloat16", "cuda:bench", block_size, 0, 1, 0)
    logic = SchedulerLogic(RankNamespaces((ns,)), block_size, lambda keys: [True] * len(keys),
                           can_load=True, can_save=True, claims=_declining(clock),
                           clock=lambda: clock[0])
    prefix = [rng.randrange(32000) for _ in range(length)]
    reqs = [_request(f"r{i}", prefix + [rng.randrange(32000) for _ in range(question)], block_size)
            for i in range(2 * requests + 1)]
    logic.get_num_new_matched_tokens(reqs[0], length)  # the prefix's first sighting
    logic.request_finished(reqs[0])
    lookups, finishes = [], []
    for r in reqs[1:requests + 1]:
        t0 = time.perf_counter()
        logic.get_num_new_matched_tokens(r, length)
        t1 = time.perf_counter()
        logic.request_finished(r)
        t2 = time.perf_counter()
        lookups.append(t1 - t0)
        finishes.append(t2 - t1)
    prof = cProfile.Profile()
    for r in reqs[requests + 1:]:
        prof.runcall(logic.get_num_new_matched_tokens, r, length)
        logic.request_finished(r)
    stats = pstats.Stats(prof, stream=io.StringIO())
    top = sorted(((v[2], f"{k[0].rsplit('/', 1)[-1]}:{k[2]}") for k, v in stats.stats.items()),  # type: ignore[attr-defined]
                 reverse=True)[:6]
    return {"length": length, "chunks": length // block_size,
            "lookup_us": round(statistics.median(lookups) * 1e6, 1),
            "request_finished_us": round(statistics.median(finishes) * 1e6, 1),
            "lookup_top_own_us": {name: round(sec / requests * 1e6, 1) for sec, name in top}}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="2048,8192,32768")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    rows = [measure(int(n), args.block_size, args.requests) for n in args.lengths.split(",")]
    for row in rows:
        print(f"{row['length']:>6} tokens ({row['chunks']} chunks): lookup {row['lookup_us']} µs, "
              f"request_finished {row['request_finished_us']} µs; lookup's own time by function "
              f"(µs, under cProfile) {row['lookup_top_own_us']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
