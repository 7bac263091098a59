"""Serving with a KV pool on the real vLLM V1 CPU engine: three modes side by side, one run.

One local Mooncake stack (master + metadata + one pool holder); the random
12-layer hidden-512 fp32 Llama of ``bench_v1_ttft``; three modes, each a fresh
vLLM process (the "reader") after, for the two connector modes, a "writer"
process that put the reader's hit prompts into the pool (so every hit crosses
processes)::

    none     no connector (everything recomputed; vLLM's local prefix cache only)
    intree   vLLM's in-tree MooncakeStoreConnector ("mode": "standalone-store",
             MOONCAKE_VLLM_DISABLE=1, PYTHONHASHSEED=0)
    ours     our MooncakeStoreConnector
    ours-sync  ours with ``"load_async": false`` (the synchronous load path the
             asynchronous one must not be slower than) under its own
             ``cache_prefix``, so that its pool keys are not ``ours``'s
    ours-nice0 ours with ``MOONCAKE_VLLM_THREAD_NICE=0`` (the pool's threads at vLLM's
             priority; not in the default set), its own ``cache_prefix``
    ours-prev  ours from another build of the package (``--prev-site``, not in the default
             set): the A/B of a change, its own ``cache_prefix``

The reader drives vLLM's engine step by step (``LLMEngine.step``; in-process
engine) and stamps every token, so inter-token latency (ITL) is what a streaming
client would see. Phases, each on prompts no earlier phase of that process used:

0. warmup: two short prompts, then misses of ``warm_misses`` tokens (our claim policy's
   recompute model learns from them, as from a serving engine's prefills).
1. interference: a stream decoding 256 tokens alone, then another stream with an
   8k-token prompt (a pool hit) arriving mid-way; the stream's ITL p50/p99/max
   while that prompt is being served vs the stream alone. Target ours p99 <= 1.5x.
2. hit TTFT at 1k/4k/8k (``hit_reps`` prompts each, medians; token ids compared with
   ``none``) and the floor: the engine's step for the same prompt once it is in
   vLLM's local prefix cache + the hit's bytes / the raw store's get throughput
   measured in this run.
3. mixed serving: 16 closed-loop clients, one of 8 shared 2k-token documents + a
   unique 100-token question each, 64 output tokens: throughput, TTFT p50/p99,
   ITL p99. Target ours >= intree on throughput and on TTFT p99.
4. miss overhead: TTFT of prompts the pool does not have vs ``none``. Target <= 5 %.

Writes ``<out>/bench_serving.json`` and ``.png``::

    .venv/bin/python bench/bench_serving.py [--quick] [--out docs/bench-results]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_v1_ttft import BYTES_PER_TOKEN, MODEL, _ceiling, _model, pyplot
from engine_steps import EngineProcess, Req, closed_loop_stats, interference, itl_stats, other_build_env, serve
from mooncake_vllm.demo.run import INSTANCE_ENV, connector_counters, kv_transfer_config, run_instance, wait_saves_idle
from mooncake_vllm.services import LocalStack

__all__ = ["main"]

MODES = ("none", "intree", "ours", "ours-sync")
FULL = {"stream_tokens": 256, "load_len": 8000, "lengths": [1000, 4000, 8000], "docs": 8,
        "doc_len": 2048, "question_len": 100, "clients": 16, "requests": 32, "out_tokens": 64,
        "misses": 12, "miss_len": 1000, "hit_reps": 3,
        "warm_misses": [640, 1280, 2048]}
QUICK = {"stream_tokens": 64, "load_len": 2000, "lengths": [1000, 2000], "docs": 4,
         "doc_len": 512, "question_len": 32, "clients": 4, "requests": 8, "out_tokens": 16,
         "misses": 2, "miss_len": 500, "hit_reps": 1,
         "warm_misses": [640]}
INJECT_AFTER = 16  #: stream tokens before the interfering prompt arrives


# --------------------------------------------------------------------- reader (one vLLM process)
def _phases(engine: Any, p: dict[str, Any], prompts: dict[str, Any]) -> dict[str, Any]:
    """The reader's phases by name; each returns its JSON-able result."""
    seq = iter(range(1 << 30))

    def req(prompt: list[int], n: int) -> Req:
        return Req(f"r{next(seq)}", prompt, n)

    def warmup() -> dict[str, Any]:
        serve(engine, [req(prompts["warmup"][0], 4), req(prompts["warmup"][1], 2)])
        # misses long enough to teach the claim policy's recompute model, as a serving
        # engine's prefills would: a reader that only hit would spend its hits measuring
        for prompt in prompts["warmup"][2:]:
            serve(engine, [req(prompt, 1)])
        return {}

    def interfere() -> dict[str, Any]:
        out = interference(engine, req(prompts["stream_alone"], p["stream_tokens"]),
                           req(prompts["stream_loaded"], p["stream_tokens"]),
                           req(prompts["load"], 1), INJECT_AFTER, between=wait_saves_idle)
        # the same prompt again is in vLLM's own prefix cache: the step it costs a stream
        # then (its last tokens computed against the whole context) is in both windows
        wait_saves_idle()
        stream, again = req(prompts["stream_hbm"], p["stream_tokens"]), req(prompts["load"], 1)
        serve(engine, [stream], inject=(INJECT_AFTER, again))
        t0, t1 = again.t_add, again.times[0]
        out["during_hbm_hit"] = itl_stats([b - a for a, b in zip(stream.times, stream.times[1:])
                                           if b > t0 and a < t1])
        out["hbm_hit_ttft_s"] = again.ttft()
        return out

    def hits() -> dict[str, Any]:
        # the same prompt again is a local prefix-cache hit: the engine's own step;
        # ``hit_reps`` prompts per length, their medians reported (one sample swings ~10 %)
        out = {}
        for n, group in zip(p["lengths"], prompts["hits"]):
            firsts, agains = [], []
            for prompt in group:
                first, again = req(prompt, 8), req(prompt, 1)
                serve(engine, [first])
                serve(engine, [again])
                firsts.append(first)
                agains.append(again)
            out[str(n)] = {"ttft_s": statistics.median(r.ttft() for r in firsts),
                           "local_ttft_s": statistics.median(r.ttft() for r in agains),
                           "samples_s": [r.ttft() for r in firsts],
                           "tokens": [r.tokens for r in firsts]}
        return out

    def misses() -> dict[str, Any]:
        reqs = [req(m, 1) for m in prompts["misses"]]
        for r in reqs:
            serve(engine, [r])
        return {"ttft_s": [r.ttft() for r in reqs]}

    def mixed() -> dict[str, Any]:
        reqs = [req(m, p["out_tokens"]) for m in prompts["mixed"]]
        serve(engine, reqs, clients=p["clients"])
        return closed_loop_stats(reqs)

    return {"warmup": warmup, "interference": interfere, "hits": hits, "misses": misses,
            "mixed": mixed, "connector": connector_counters}


def _reader(spec: dict[str, Any]) -> None:
    """One vLLM engine serving phases on command: a phase name per stdin line, results as files."""
    from vllm import LLM

    p = spec["params"]
    llm = LLM(model=spec["model"], dtype="float32", block_size=spec["block_size"],
              max_model_len=spec["max_model_len"], kv_cache_memory_bytes=spec["kv_bytes"],
              enforce_eager=True, enable_prefix_caching=True, seed=0,
              kv_transfer_config=spec["kv_config"], max_num_seqs=max(32, p["clients"] + 2))
    phases = _phases(llm.llm_engine, p, spec["prompts"])
    out = Path(spec["dir"])
    (out / "ready").write_text("{}")
    for line in sys.stdin:
        name = line.strip()
        if not name:
            break
        result = phases[name]()
        wait_saves_idle()
        (out / f"{name}.tmp").write_text(json.dumps(result))
        (out / f"{name}.tmp").rename(out / f"{name}.json")


# --------------------------------------------------------------------- driver
def _prompts(p: dict[str, Any], seed: int = 7) -> dict[str, Any]:
    rnd = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rnd.randrange(10, 2000) for _ in range(n)]

    docs = [toks(p["doc_len"]) for _ in range(p["docs"])]
    return {"warmup": [toks(16), toks(256), *(toks(n) for n in p["warm_misses"])],
            "stream_alone": toks(64), "stream_loaded": toks(64),
            "stream_hbm": toks(64),
            "load": toks(p["load_len"]),
            "hits": [[toks(n) for _ in range(p["hit_reps"])] for n in p["lengths"]],
            "misses": [toks(p["miss_len"]) for _ in range(p["misses"])], "docs": docs,
            "mixed": [docs[i % len(docs)] + toks(p["question_len"]) for i in range(p["requests"])]}


def _mode_config(mode: str, env: dict[str, str],
                 prev_site: str = "") -> tuple[dict[str, Any] | None, dict[str, str]]:
    if mode == "ours":
        return kv_transfer_config("kv_both"), dict(env)
    if mode == "ours-prev":  # its own keys: the prompts are shared, the pool must not be
        return (kv_transfer_config("kv_both", extra={"cache_prefix": "prev"}),
                {**env, **other_build_env(prev_site)})
    if mode == "ours-nice0":
        return (kv_transfer_config("kv_both", extra={"cache_prefix": "nice0"}),
                {**env, "MOONCAKE_VLLM_THREAD_NICE": "0"})
    if mode == "ours-sync":
        return (kv_transfer_config("kv_both", extra={"load_async": False, "cache_prefix": "sync"}),
                dict(env))
    if mode == "intree":  # keep the name for vLLM's own class; its hashes must agree across processes
        return (kv_transfer_config("kv_both", connector="in-tree"),
                {**env, "MOONCAKE_VLLM_DISABLE": "1", "PYTHONHASHSEED": "0"})
    return None, dict(env)


PHASES = ("warmup", "interference", "hits", "misses", "mixed", "connector")


def _run_modes(modes: list[str], base: dict[str, Any], prompts: dict[str, Any], work: Path,
               env: dict[str, str], stack: LocalStack,
               phases: tuple[str, ...] = PHASES) -> tuple[dict[str, Any], dict[str, float]]:
    """Writers first, then every mode's reader alive at once, phase by phase, order rotated."""
    runs: dict[str, Any] = {m: {} for m in modes}
    readers: dict[str, EngineProcess] = {}
    ceiling: dict[str, float] = {}
    try:
        for mode in modes:
            kv_cfg, mode_env = _mode_config(mode, env, base.get("prev_site", ""))
            try:
                if kv_cfg is not None:  # the writer: put the reader's hit prompts into the pool
                    print(f"[bench] {mode}: writer", flush=True)
                    run_instance(base["model"], [prompts["load"], *(q for g in prompts["hits"] for q in g),
                                                  *prompts["docs"]],
                                 work, name=f"{mode}-writer", env=mode_env, kv_config=kv_cfg,
                                 max_tokens=1, ttft_only=True, block_size=base["block_size"],
                                 kv_bytes=base["kv_bytes"], max_model_len=base["max_model_len"],
                                 timeout=1800.0)
                readers[mode] = EngineProcess(
                    f"{mode}-reader", [sys.executable, __file__, "--reader"],
                    {**base, "kv_config": kv_cfg, "prompts": prompts}, work,
                    {**os.environ, **INSTANCE_ENV, "TMPDIR": str(work), **mode_env})
                readers[mode].wait_file("ready", 900.0)
            except RuntimeError as exc:
                runs[mode] = {"error": str(exc)[-2000:]}
                print(f"[bench] {mode} failed: {str(exc)[-800:]}", flush=True)
                readers.pop(mode, None)
        for k, phase in enumerate(phases):
            if phase == "hits":  # the floor's store throughput, measured between the same phases
                ceiling = _ceiling(stack, BYTES_PER_TOKEN * base["block_size"], 32)
            live = [m for m in modes if m in readers]
            for mode in live[k % len(live):] + live[:k % len(live)] if live else []:
                print(f"[bench] {mode}: {phase}", flush=True)
                try:
                    runs[mode][phase] = readers[mode].run(phase, 1800.0)
                except RuntimeError as exc:
                    runs[mode] = {"error": str(exc)[-2000:]}
                    print(f"[bench] {mode} failed: {str(exc)[-800:]}", flush=True)
                    readers.pop(mode).close()
    finally:
        for reader in readers.values():
            reader.close()
    return runs, ceiling


def _derive(runs: dict[str, Any], base: dict[str, Any], raw_get_gbps: float | None) -> dict[str, Any]:
    """Ratios between modes, phase by phase, over the modes that finished that phase."""
    p, bs = base["params"], base["block_size"]

    def done(phase: str) -> dict[str, Any]:
        return {m: r[phase] for m, r in runs.items() if phase in r}

    d: dict[str, Any] = {"interference": {}, "hits": {}, "mixed": {}, "miss": {}}
    for m, i in done("interference").items():
        d["interference"][m] = {"p99_during_over_alone": i["during_load"]["p99"] / i["alone"]["p99"],
                                "max_during_over_alone_p99": i["during_load"]["max"] / i["alone"]["p99"]}
        hbm = i.get("during_hbm_hit") or {}
        if hbm.get("n"):  # issue 24: a pool hit costs a stream at most 1.2x what an in-HBM hit does
            d["interference"][m]["p99_during_pool_over_hbm_hit"] = i["during_load"]["p99"] / hbm["p99"]
    hits = done("hits")
    ref = hits.get("none")
    for n in map(str, p["lengths"]) if hits else ():
        step = ref[n]["local_ttft_s"] if ref else None
        nbytes = (int(n) - 1) // bs * bs * BYTES_PER_TOKEN
        floor = step + nbytes / raw_get_gbps / 1e9 if step is not None and raw_get_gbps else None
        row: dict[str, Any] = {"floor_s": floor, "engine_step_s": step, "hit_bytes": nbytes}
        for m, h in hits.items():
            row[m] = {"ttft_s": h[n]["ttft_s"], "over_floor": h[n]["ttft_s"] / floor if floor else None,
                      "tokens_match_none": h[n]["tokens"] == ref[n]["tokens"] if ref else None}
        bars = [hits[b][n]["ttft_s"] for b in ("none", "intree") if b in hits]
        if "ours" in hits and bars:  # issue 24: <= 1.05 x min(recompute, in-tree)
            row["ours_over_min_recompute_intree"] = hits["ours"][n]["ttft_s"] / min(bars)
        for other in ("intree", "ours-sync"):
            if "ours" in hits and other in hits:
                row[f"ours_over_{other.replace('-', '_')}"] = (hits["ours"][n]["ttft_s"]
                                                               / hits[other][n]["ttft_s"])
        d["hits"][n] = row
    mixed = done("mixed")
    if "ours" in mixed and "intree" in mixed:
        o, t = mixed["ours"], mixed["intree"]
        d["mixed"] = {"throughput_ours_over_intree": o["throughput_tok_s"] / t["throughput_tok_s"],
                      "ttft_p99_ours_over_intree": o["ttft_p99_s"] / t["ttft_p99_s"]}
    misses = done("misses")
    if "none" in misses:
        base_miss = statistics.median(misses["none"]["ttft_s"])
        d["miss"] = {m: statistics.median(r["ttft_s"]) / base_miss - 1 for m, r in misses.items()}
    targets = {}
    if "ours" in d["interference"]:
        targets["interference_p99<=1.5x"] = d["interference"]["ours"]["p99_during_over_alone"] <= 1.5
        pool_over_hbm = d["interference"]["ours"].get("p99_during_pool_over_hbm_hit")
        if pool_over_hbm is not None:
            targets["interference_pool<=1.2x_hbm_hit"] = pool_over_hbm <= 1.2
    if d["hits"] and all("ours_over_min_recompute_intree" in r for r in d["hits"].values()):
        targets["hit_ttft<=1.05x_min(recompute,intree)"] = all(
            r["ours_over_min_recompute_intree"] <= 1.05 for r in d["hits"].values())
    if d["mixed"]:
        targets["mixed_throughput>=intree"] = d["mixed"]["throughput_ours_over_intree"] >= 1.0
        targets["mixed_ttft_p99<=intree"] = d["mixed"]["ttft_p99_ours_over_intree"] <= 1.0
    if "ours" in d["miss"]:
        targets["miss_overhead<=5%"] = d["miss"]["ours"] <= 0.05
    if all("ours_over_ours_sync" in row for row in d["hits"].values()) and d["hits"]:
        targets["hit_ttft_async<=1.05x_sync"] = all(row["ours_over_ours_sync"] <= 1.05
                                                    for row in d["hits"].values())
    if "ours" in hits and ref:
        targets["hits_token_identical"] = all(row[m]["tokens_match_none"] for row in d["hits"].values()
                                              for m in ("ours", "ours-sync") if m in row)
    d["targets"] = targets
    return d


def _from_work(work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Base and runs from a work folder's per-phase files (a run cut short)."""
    runs, base = {}, {}
    for spec_path in sorted(work.glob("*-reader.spec.json")):
        mode = spec_path.name[:-len("-reader.spec.json")]
        base = json.loads(spec_path.read_text())
        runs[mode] = {f.stem: json.loads(f.read_text()) for f in (work / f"{mode}-reader").glob("*.json")}
    return base, runs


def _plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = report["runs"]

    def have(phase: str) -> tuple[list[str], list[int]]:
        modes = [m for m in runs if phase in runs[m]]
        return modes, list(range(len(modes)))

    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    a = ax[0][0]
    modes, x = have("interference")
    a.bar([i - 0.2 for i in x], [runs[m]["interference"]["alone"]["p99"] * 1e3 for m in modes],
          0.4, label="alone")
    a.bar([i + 0.2 for i in x], [runs[m]["interference"]["during_load"]["p99"] * 1e3 for m in modes],
          0.4, label=f"during the {report['params']['load_len']}-token load")
    a.set_xticks(x, modes)
    a.set_yscale("log")
    a.set_ylabel("stream ITL p99 (ms)")
    a.set_title("1. interference")
    a.legend()
    a = ax[0][1]
    lengths = report["params"]["lengths"]
    for m in have("hits")[0]:
        a.plot(lengths, [runs[m]["hits"][str(n)]["ttft_s"] for n in lengths], marker="o", label=m)
    floors = [report["derived"]["hits"].get(str(n), {}).get("floor_s") for n in lengths]
    if None not in floors:
        a.plot(lengths, floors, "k--", label="floor")
    a.set_yscale("log")
    a.set_xlabel("prompt tokens")
    a.set_ylabel("TTFT (s)")
    a.set_title("2. hit TTFT (cross-instance)")
    a.legend()
    a = ax[1][0]
    modes, x = have("mixed")
    a.bar(x, [runs[m]["mixed"]["throughput_tok_s"] for m in modes])
    a.set_xticks(x, modes)
    a.set_ylabel("output tokens/s")
    twin = a.twinx()
    twin.plot(x, [runs[m]["mixed"]["ttft_p99_s"] for m in modes], "ro-")
    twin.set_ylabel("TTFT p99 (s, red)")
    a.set_title(f"3. mixed: {report['params']['clients']} clients")
    a = ax[1][1]
    modes, x = have("misses")
    a.bar(x, [statistics.median(runs[m]["misses"]["ttft_s"]) for m in modes])
    a.set_xticks(x, modes)
    a.set_ylabel("TTFT (s), median")
    a.set_title("4. misses (0 % hits)")
    fig.suptitle("vLLM V1 CPU, 12-layer hidden-512 fp32 Llama; " + report["hardware"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _report(base: dict[str, Any], runs: dict[str, Any], ceiling: dict[str, float] | None,
            args: argparse.Namespace, load_before: Any, out: Path) -> None:
    report = {"params": base["params"], "block_size": base["block_size"], "model": MODEL,
              "hardware": args.hardware, "loadavg_before": load_before,
              "loadavg_after": os.getloadavg(), "raw_store": ceiling, "runs": runs}
    report["derived"] = _derive(runs, base, (ceiling or {}).get("get_gbps"))
    name = "bench_serving_quick" if base["params"] == QUICK else "bench_serving"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2, default=str))
    _plot(report, out / f"{name}.png")
    print(json.dumps({"derived": report["derived"], "loadavg": [load_before, report["loadavg_after"]],
                      "raw_store": ceiling}, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/bench-results")
    parser.add_argument("--quick", action="store_true", help="short validation run (small prompts)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--hardware", default="dev box: 2 cores, 24 GiB, shared with other jobs")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help="a subset of the reader's phases, in this order (warmup first)")
    parser.add_argument("--from-work", help="report from a cut-short run's work folder (no floor)")
    parser.add_argument("--prev-site", default="", help="mode ours-prev: where the other build is installed")
    parser.add_argument("--hit-reps", type=int, help="prompts per hit length (medians; full default 3)")
    parser.add_argument("--reader", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reader:
        _reader(json.loads(Path(args.reader).read_text()))
        return 0
    if args.from_work:
        base, runs = _from_work(Path(args.from_work))
        _report(base, runs, None, args, ("unknown",) * 3, Path(args.out))
        return 0
    params = QUICK if args.quick else FULL
    if args.hit_reps is not None:
        if args.hit_reps < 1:
            parser.error("--hit-reps: give 1 or more prompts per hit length")
        params = {**params, "hit_reps": args.hit_reps}
    max_len = max(params["load_len"], *params["lengths"], params["doc_len"] + params["question_len"])
    base = {"model": str(_model()), "block_size": args.block_size, "params": params,
            "max_model_len": max_len + 256, "kv_bytes": (512 << 20) if args.quick else (1 << 30),
            "prev_site": args.prev_site}
    prompts = _prompts(params)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    load_before = os.getloadavg()
    # each connector mode's writer puts ~1.5 GB (three prompts per hit length): a pool short of
    # room evicts an earlier mode's prompts, and its reader recomputes them (three modes in 5 GiB did)
    modes = args.modes.split(",")
    pooled = sum(m != "none" for m in modes)
    segment = (2 << 30) if args.quick else max(5 << 30, (2 << 30) * pooled + (1 << 30))
    with LocalStack(work / "stack", segment_size=segment,
                    local_buffer_size=256 << 20) as stack:
        cfg_path = work / "mooncake_config.json"  # ours ignores "mode"; the in-tree one needs it
        cfg_path.write_text(json.dumps({**stack.config(), "mode": "standalone-store"}))
        env = {**stack.env(), "MOONCAKE_CONFIG_PATH": str(cfg_path),
               "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1"}
        phases = tuple(p for p in PHASES if p in args.phases.split(","))
        runs, ceiling = _run_modes(modes, base, prompts, work, env, stack, phases)
    _report(base, runs, ceiling, args, load_before, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
