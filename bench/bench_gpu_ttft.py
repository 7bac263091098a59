"""TTFT of one vLLM instance per call, for the GPU A/B comparison (needs CUDA + vLLM).

``--phase A`` serves each prompt once (a miss that saves to the pool); a fresh
``--phase B`` process then serves the same prompts (a pool hit); ``ours-zc`` is ours
with ``gpu_path=zero_copy``. ``--mode none``
serves each prompt twice in one process instead (recompute, then an in-HBM
prefix hit). ``--summarize DIR`` prints the TTFT table of every run in DIR:
recompute, in-HBM hit, and A/B of each connector, with B's tokens from the
pool (vLLM's own counter) and whether B's output equals the in-HBM hit's.

Prompts are token ids (``skip_tokenizer_init``): no tokenizer, no model hub.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
import threading
import time
import traceback


def prompt(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(100, 31900) for _ in range(n)]


def serve(args: argparse.Namespace) -> None:
    res: dict = {"mode": args.mode, "phase": args.phase, "runs": [], "error": None}

    def dump() -> None:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    llm = None
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        res["vllm"] = vllm.__version__
        kw = dict(model=args.model, enforce_eager=True, gpu_memory_utilization=0.5,
                  max_model_len=args.max_len, skip_tokenizer_init=True, dtype="bfloat16",
                  disable_log_stats=False, seed=0)
        if args.mode != "none":
            kw["kv_transfer_config"] = {"kv_connector": "MooncakeStoreConnector",
                                        "kv_role": "kv_both"}
        if args.mode == "ours-zc":  # ours, straight between GPU memory and the pool
            kw["kv_transfer_config"]["kv_connector_extra_config"] = {"gpu_path": "zero_copy"}
        t0 = time.time()
        llm = LLM(**kw)
        res["init_s"] = round(time.time() - t0, 1)
        sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, detokenize=False)

        def run(label: str, ids: list[int]) -> None:
            t = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
            wall = time.perf_counter() - t
            m = out.metrics
            ttft = getattr(m, "first_token_latency", None) if m is not None else None
            r = {"label": label, "n": len(ids), "wall_s": round(wall, 5),
                 "ttft_s": round(ttft, 5) if ttft is not None else None,
                 "cached": out.num_cached_tokens, "tokens": list(out.outputs[0].token_ids)}
            res["runs"].append(r)
            dump()
            print("RUN", json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)

        run("warmup", prompt(1024, {"A": 11, "B": 12}.get(args.phase, 13)
                             + {"none": 0, "intree": 100, "ours": 200, "ours-zc": 300}[args.mode]))
        for n in [int(x) for x in args.lengths.split(",")]:
            ids = prompt(n, n)
            run(f"L{n}", ids)
            if args.mode == "none":
                run(f"L{n}-again", ids)
        time.sleep(args.save_wait)  # saves are asynchronous: let them land before exiting
        try:
            from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: F401
        except Exception:  # noqa: BLE001
            pass
    except BaseException as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        res["traceback"] = traceback.format_exc()[-4000:]
        print("ERROR", res["error"], flush=True)
    dump()
    print("DONE", flush=True)
    if llm is not None:
        th = threading.Thread(target=lambda: llm.llm_engine.engine_core.shutdown(), daemon=True)
        th.start()
        th.join(30)
    sys.stdout.flush()
    os._exit(0)


_MODES = ("intree", "ours", "ours-zc")


def summarize(folder: str) -> None:
    runs: dict[tuple[str, str], dict] = {}
    for path in glob.glob(os.path.join(folder, "*.json")):
        try:
            data = json.load(open(path))
        except (OSError, ValueError):
            continue
        if "mode" in data and "phase" in data:
            runs[(data["mode"], data["phase"])] = data
            if data.get("error"):
                print(f"{data['mode']} {data['phase']}: ERROR {data['error'][:300]}")

    def by_label(mode: str, phase: str) -> dict[str, dict]:
        return {r["label"]: r for r in runs.get((mode, phase), {}).get("runs", [])}

    none = by_label("none", "A")
    lengths = sorted({r["n"] for r in none.values() if r["label"].startswith("L")}
                     | {r["n"] for m in _MODES for r in by_label(m, "B").values()
                        if r["label"].startswith("L")})
    rows = []
    print("| tokens | recompute | in-HBM hit | in-tree A | in-tree B (pool) | ours A | ours B (pool) "
          "| ours zero-copy A | ours zero-copy B (pool) "
          "| B tokens from pool (in-tree / ours / zero-copy) | B = in-HBM hit (in-tree / ours / zero-copy) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def ms(r: dict | None) -> str:
        return f"{r['ttft_s'] * 1e3:.0f}" if r and r.get("ttft_s") is not None else "-"

    for n in lengths:
        key = f"L{n}"
        rec, hbm = none.get(key), none.get(f"{key}-again")
        cells = [str(n), ms(rec), ms(hbm)]
        hits, same = [], []
        for mode in _MODES:
            a, b = by_label(mode, "A").get(key), by_label(mode, "B").get(key)
            cells += [ms(a), ms(b)]
            hits.append(str(b["cached"]) if b else "-")
            same.append(str(b["tokens"] == hbm["tokens"]) if b and hbm else "-")
        cells += [" / ".join(hits), " / ".join(same)]
        rows.append(cells)
        print("| " + " | ".join(cells) + " |")
    with open(os.path.join(folder, "ttft_table.json"), "w") as f:
        json.dump({"rows": rows, "runs": {f"{m}_{p}": v for (m, p), v in runs.items()}}, f,
                  indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["none", "intree", "ours", "ours-zc"])
    ap.add_argument("--phase", default="A")
    ap.add_argument("--model", default="/tmp/model")
    ap.add_argument("--lengths", default="2048,8000,16000")
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--out")
    ap.add_argument("--save-wait", type=float, default=8.0)
    ap.add_argument("--summarize", metavar="DIR")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
    else:
        serve(args)


if __name__ == "__main__":
    main()
