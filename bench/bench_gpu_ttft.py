"""TTFT of one vLLM instance per call, for the GPU A/B comparison (needs CUDA + vLLM).

``--phase A`` serves each prompt once (a miss that saves to the pool); a fresh
``--phase B`` process then serves the same prompts (a pool hit); ``ours-zc`` is ours
with ``gpu_path=zero_copy``. ``--mode none``
serves each prompt twice in one process instead (recompute, then an in-HBM
prefix hit). ``--summarize DIR`` prints the TTFT table of every run in DIR:
recompute, in-HBM hit, and A/B of each connector, with B's tokens from the
pool (vLLM's own counter) and whether B's output equals the in-HBM hit's.

The same script drives vLLM 0.10.0's legacy engine (``VLLM_USE_V1=0``, issue 25):
its worker runs in this process, so each run also records our connector's
counter deltas (blocks loaded / saved); ``--again`` serves every prompt a second
time in the same process (an in-HBM prefix hit) in any mode; ``--summarize-v0
DIR`` prints the V0 -> V1 table (V0 A computes and saves, a fresh V0 B and then
vLLM 0.24's V1 read the blocks V0 wrote).

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
        v0 = os.environ.get("VLLM_USE_V1") == "0"
        res["engine"] = "V0" if v0 else "V1"
        res["block_size"] = args.block_size
        kw = dict(model=args.model, enforce_eager=True, gpu_memory_utilization=args.gpu_util,
                  max_model_len=args.max_len, skip_tokenizer_init=True, dtype="bfloat16",
                  disable_log_stats=False, seed=0, block_size=args.block_size,
                  enable_prefix_caching=True)
        if v0:  # V0's connector hooks see whole prefills only
            kw["enable_chunked_prefill"] = False
        if args.mode != "none":
            kw["kv_transfer_config"] = {"kv_connector": "MooncakeStoreConnector",
                                        "kv_role": "kv_both"}
            extra = json.loads(args.extra) if args.extra else {}
            if args.mode == "ours-zc":  # ours, straight between GPU memory and the pool
                extra["gpu_path"] = "zero_copy"
            if extra:
                kw["kv_transfer_config"]["kv_connector_extra_config"] = extra
        t0 = time.time()
        llm = LLM(**kw)
        res["init_s"] = round(time.time() - t0, 1)
        sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, detokenize=False)
        counters = _in_process_counters if v0 and args.mode != "none" else (lambda: {})

        def run(label: str, ids: list[int]) -> None:
            before = counters()
            t = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
            wall = time.perf_counter() - t
            r = {"label": label, "n": len(ids), "wall_s": round(wall, 5),
                 "ttft_s": _ttft(out.metrics), "cached": out.num_cached_tokens,
                 "tokens": list(out.outputs[0].token_ids)}
            after = counters()
            if after:
                r["ours"] = {k: after.get(k, 0) - before.get(k, 0) for k in _COUNTED}
            res["runs"].append(r)
            dump()
            print("RUN", json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)

        run("warmup", prompt(1024, {"A": 11, "B": 12}.get(args.phase, 13)
                             + {"none": 0, "intree": 100, "ours": 200, "ours-zc": 300}[args.mode]))
        for n in [int(x) for x in args.lengths.split(",")]:
            ids = prompt(n, n)
            run(f"L{n}", ids)
            if args.mode == "none" or args.again:
                run(f"L{n}-again", ids)
        time.sleep(args.save_wait)  # saves are asynchronous: let them land before exiting
        res["ours_total"] = counters()
    except BaseException as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        res["traceback"] = traceback.format_exc()[-4000:]
        print("ERROR", res["error"], flush=True)
    dump()
    print("DONE", flush=True)
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:  # V1: the engine core is another process
        th = threading.Thread(target=core.shutdown, daemon=True)
        th.start()
        th.join(30)
    sys.stdout.flush()
    os._exit(0)


#: our connector's counters recorded per run on V0 (its worker is in this process)
_COUNTED = ("blocks_got", "blocks_put", "hits", "misses", "corrupt", "errors")


def _ttft(metrics: object) -> float | None:
    """Seconds to the first token: V1's ``first_token_latency``, V0's two timestamps."""
    if metrics is None:
        return None
    ttft = getattr(metrics, "first_token_latency", None)
    if ttft is None and getattr(metrics, "first_token_time", None) is not None:
        ttft = metrics.first_token_time - metrics.arrival_time  # type: ignore[attr-defined]
    return round(ttft, 5) if ttft is not None else None


def _in_process_counters() -> dict[str, int]:
    """Our V0 connector's store counters (V0 builds its worker in this process)."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return dict(get_kv_transfer_group().store.stats().snapshot())
    except Exception:  # noqa: BLE001 - no connector here (V1, or mode none)
        return {}


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


def summarize_v0(folder: str) -> None:
    """The issue-25 table from ``v0_A.json``, ``v0_B.json`` and ``v1_C.json`` in ``folder``."""
    runs: dict[str, dict[str, dict]] = {}
    block = 16
    for name in ("v0_A", "v0_B", "v1_C"):
        try:
            data = json.load(open(os.path.join(folder, f"{name}.json")))
        except (OSError, ValueError):
            data = {}
        if data.get("error"):
            print(f"{name}: ERROR {data['error'][:300]}")
        runs[name] = {r["label"]: r for r in data.get("runs", [])}
        block = data.get("block_size", block)

    def ms(r: dict | None) -> str:
        return f"{r['ttft_s'] * 1e3:.0f}" if r and r.get("ttft_s") is not None else "-"

    def same(x: dict | None, y: dict | None) -> str:
        return str(x["tokens"] == y["tokens"]) if x and y else "-"

    print("| tokens | V0 A recompute | V0 A in-HBM hit | V0 B pool hit (fresh) | B blocks loaded "
          "(ours) / full blocks | B = A in-HBM hit | V1 C pool hit (after A exited) "
          "| C tokens from pool (vLLM) | V1 C in-HBM hit | C pool = C in-HBM hit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    lengths = sorted({r["n"] for r in runs["v0_A"].values() if r["label"].startswith("L")})
    for n in lengths:
        key = f"L{n}"
        a, a2 = runs["v0_A"].get(key), runs["v0_A"].get(f"{key}-again")
        b = runs["v0_B"].get(key)
        c, c2 = runs["v1_C"].get(key), runs["v1_C"].get(f"{key}-again")
        loaded = str(b.get("ours", {}).get("blocks_got", "-")) if b else "-"
        cells = [str(n), ms(a), ms(a2), ms(b), f"{loaded} / {n // block}", same(b, a2), ms(c),
                 str(c["cached"]) if c else "-", ms(c2), same(c, c2)]
        rows.append(cells)
        print("| " + " | ".join(cells) + " |")
    with open(os.path.join(folder, "v0_table.json"), "w") as f:
        json.dump({"rows": rows, "runs": runs}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["none", "intree", "ours", "ours-zc"])
    ap.add_argument("--phase", default="A")
    ap.add_argument("--model", default="/tmp/model")
    ap.add_argument("--lengths", default="2048,8000,16000")
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--out")
    ap.add_argument("--save-wait", type=float, default=8.0)
    ap.add_argument("--again", action="store_true", help="serve every prompt twice (any mode)")
    ap.add_argument("--extra", help="kv_connector_extra_config as JSON")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--gpu-util", type=float, default=0.5)
    ap.add_argument("--summarize", metavar="DIR")
    ap.add_argument("--summarize-v0", metavar="DIR")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
    elif args.summarize_v0:
        summarize_v0(args.summarize_v0)
    else:
        serve(args)


if __name__ == "__main__":
    main()
