#!/usr/bin/env python3
"""Does the carried vLLM run here? One engine, a few greedy requests given as token ids.

  python3 scripts/gpu/vllm_smoke.py MODEL_DIR [--connector MooncakeStoreConnector] [--tokens 2048]

Prints one JSON line per request (TTFT, cached tokens, first output ids) and 'SMOKE OK' at the end.
Run it under `timeout`: an engine that dies can leave the frontend waiting.
"""
import argparse
import json
import os
import random
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--connector", default=None, help="kv_connector name (none: no KV connector)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = ap.parse_args()
    t0 = time.time()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    print(f"vllm {vllm.__version__} from {os.path.dirname(vllm.__file__)}; import {time.time() - t0:.1f}s", flush=True)
    kw = dict(model=args.model, enforce_eager=True, gpu_memory_utilization=args.gpu_memory_utilization,
              max_model_len=args.max_model_len, skip_tokenizer_init=True, dtype="bfloat16",
              disable_log_stats=False, seed=0)
    if args.connector:
        kw["kv_transfer_config"] = {"kv_connector": args.connector, "kv_role": "kv_both"}
    t0 = time.time()
    llm = LLM(**kw)
    print(f"engine up in {time.time() - t0:.1f}s", flush=True)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
    rng = random.Random(0)
    ids = [rng.randrange(100, 31900) for _ in range(args.tokens)]
    outs = []
    for label in ("first", "again (prefix hit)"):
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
        m = out.metrics
        ttft = getattr(m, "first_token_latency", None) if m is not None else None
        rec = {"request": label, "prompt_tokens": len(ids), "wall_s": round(time.perf_counter() - t, 4),
               "ttft_s": None if ttft is None else round(ttft, 4), "cached": out.num_cached_tokens,
               "tokens": list(out.outputs[0].token_ids)}
        outs.append(rec)
        print(json.dumps(rec), flush=True)
    same = outs[0]["tokens"] == outs[1]["tokens"]
    print(f"SMOKE OK (outputs equal: {same})", flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip a slow engine teardown


if __name__ == "__main__":
    sys.exit(main())
