"""Issue 12's interference and hit TTFT on a GPU: every mode side by side, one run, one GPU.

Each reader first serves ``--warm-prompts`` unique prompts (misses, as a serving engine has
before its first hit: the claim policy has measured prefills). A decode stream generates 256
tokens alone, then again while another request with an 8k-token prompt is served (a pool
hit, or recomputed with no connector); the stream's inter-token latency (ITL) p50/p99/max
during that load (from adding the request to its first token) vs alone. Then pool hits at
2k/8k (TTFT, tokens from the pool, output compared with the recompute); mixed serving
(``--clients`` closed-loop clients, one of ``--docs`` shared documents the writer put in the
pool + a unique question each: throughput, TTFT p50/p99, ITL p99); misses (unique prompts,
TTFT vs no connector: what saving every block costs). ``--pyspy``: py-spy samples mixed reps
1 (the GIL holder) and 2 (every thread on a CPU, native frames) of ``--pyspy-modes``.
``--timeline-modes``: one more mixed rep of those modes under torch.profiler, a window of its
steps as a chrome trace (CPU ops, CUDA kernels and copies, vLLM's and our hooks' ranges), read
by bench/timeline_table.py. Modes,
one fresh vLLM process each (the reader)::

    none       no connector: the 8k prompt is recomputed
    intree     vLLM's in-tree MooncakeStoreConnector (MOONCAKE_VLLM_DISABLE=1, PYTHONHASHSEED=0)
    ours       ours, defaults (asynchronous loads, gpu_path auto)
    ours-sync  ours with "load_async": false (loads before the forward pass)
    ours-zc    ours with "gpu_path": "zero_copy"
    ours-prev  ours from another build of the package (``--prev-site``: a directory it was
               installed into, put first on that process's PYTHONPATH): A/B of a change
    ours-always  ours claiming every hit (``load_policy`` always)
    ours-1c    ours with one store client claiming every hit (the transfers before issue 24)
    ours-split ours, the engine process started on half of the physical cores (every sibling
               of each): our threads and Mooncake's move to the other half (placement.py),
               so no transfer shares a core or its caches' nearest level with vLLM's thread
    ours-noput ours whose saves are captured and committed but put nothing (the bench
               replaces the store client's ``put_ticket``): ours minus the transfers
    ours-repeat ours with "save_admission": "repeat" (a block is stored the second time it
               is saved; a first save leaves a mark): unique suffixes put no KV
    ours-unplaced ours with ``MOONCAKE_VLLM_THREAD_AFFINITY=off``: our threads and Mooncake's
               stay where they start, at vLLM's priority (placement.py's default lowers them
               ten nice levels where vLLM pins no core, as on a GPU worker)
    ours-never ours claiming nothing (``load_policy`` never): lookups and saves only
    ours-load  ours as ``kv_consumer``: lookups and loads, no saves
    noop       a connector whose every hook returns at once (bench/noop_connector.py): what
               vLLM's connector plumbing alone costs, the floor of every connector

``--degraded-modes``: after its phases, such a reader serves pool hits back to back
while every holder but one is SIGSTOPped mid-run (bench/degraded.py): TTFT per
request over time, the faults marked.

Two writer processes (ours, in-tree: their keys differ) put the readers' pool prompts
first, each prompt recomputed in a fresh process: that output is the reference every
reader's is compared with. Every process starts at once (one GPU holds them all: ``--kv-bytes`` each, no
memory profiling); the readers then measure one at a time, so no two modes share the
GPU while measured. Readers drive vLLM's in-process engine step by step and stamp every
token (bench/engine_steps.py, the method of bench_serving.py). Results go to ``--out`` after each mode::

    python3 bench/bench_gpu_interference.py --model /tmp/model --out $OUT/interference.json

The Mooncake pool comes from ``$MOONCAKE_CONFIG_PATH`` (scripts/gpu/mc_up.sh), or
``--local-stack`` starts one (the CPU dry run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from degraded import FaultSchedule, holder_pids
from engine_steps import (
    EngineProcess,
    other_build_env,
    pyspy_record,
)
from interference_engine import INJECT_AFTER
from interference_table import derive

__all__ = ["main"]

#: measured in this order
MODES = ("ours", "ours-split", "ours-noput", "ours-repeat", "ours-unplaced", "ours-always", "ours-1c",
         "ours-prev", "ours-sync", "ours-never", "ours-load", "none", "noop", "ours-zc", "intree")
_EXTRA = {"ours": {}, "ours-split": {}, "ours-noput": {}, "ours-repeat": {"save_admission": "repeat"},
          "ours-unplaced": {},
          "ours-prev": {}, "ours-sync": {"load_async": False},
          "ours-never": {"load_policy": "never"},
          "ours-zc": {"gpu_path": "zero_copy"}, "ours-always": {"load_policy": "always"},
          "ours-1c": {"load_policy": "always", "store_clients": 1}}
#: the reader's environment: bench devices inside its process (interference_engine.py)
_ENV = {"ours-split": {"MCV_BENCH_SPLIT_CORES": "1"}, "ours-noput": {"MCV_BENCH_DISCARD_PUTS": "1"},
        # the pool's threads and Mooncake's where they start, at vLLM's priority (placement.py)
        "ours-unplaced": {"MOONCAKE_VLLM_THREAD_AFFINITY": "off"}}


def _writer_of(mode: str) -> str | None:
    return None if mode in ("none", "noop") else ("intree" if mode == "intree" else "ours")


# --------------------------------------------------------------------- driver
def _proc(name: str, spec: dict[str, Any], work: Path, env: dict[str, str]) -> EngineProcess:
    return EngineProcess(name, [sys.executable, str(Path(__file__).with_name("interference_engine.py"))],
                         spec, work, env)


def _prompts(args: argparse.Namespace) -> dict[str, Any]:
    rnd = random.Random(args.seed)

    def toks(n: int) -> list[int]:
        return [rnd.randrange(100, args.vocab_max) for _ in range(n)]

    shared = {"warm_hit": toks(1024), "load": toks(args.load_len),
              "hits": {str(n): [toks(n) for _ in range(args.hit_reps)] for n in args.lengths},
              "docs": [toks(args.doc_len) for _ in range(args.docs)],
              "degraded_docs": [toks(args.degraded_len) for _ in range(args.degraded_docs)]}
    # lengths spread around --warm-len (x1/2, x1, x2, ...): an engine that served traffic has
    # prefilled prompts of several lengths (one length alone tells its models little)
    warm_lens = [int(args.warm_len * (0.5, 1.0, 2.0)[i % 3]) for i in range(args.warm_prompts)]
    per_mode = {m: {"warm": [toks(n) for n in warm_lens],
                    "stream_alone": toks(64), "stream_loaded": toks(64),
                    # one set per mixed rep, and the timeline's own last
                    "questions": [[toks(args.question_len) for _ in range(args.requests)]
                                  for _ in range(args.mixed_reps + 1)],
                    "misses": {str(n): [toks(n) for _ in range(args.miss_reps)]
                               for n in args.miss_lengths}}
                for m in MODES}
    return {"shared": shared, "per_mode": per_mode}


def _mode_config(mode: str, prev_site: str = "") -> tuple[dict[str, Any] | None, dict[str, str]]:
    from mooncake_vllm.demo.run import kv_transfer_config

    if mode == "none":
        return None, {}
    if mode == "noop":
        return {"kv_connector": "NoopConnector", "kv_connector_module_path": "noop_connector",
                "kv_role": "kv_both"}, {}
    if mode == "intree":
        return (kv_transfer_config("kv_both", connector="in-tree"),
                {"MOONCAKE_VLLM_DISABLE": "1", "PYTHONHASHSEED": "0"})
    env = other_build_env(prev_site) if mode == "ours-prev" else dict(_ENV.get(mode, {}))
    if mode == "ours-load":  # loads only: what saving costs a serving engine, by difference
        return kv_transfer_config("kv_consumer"), env
    return kv_transfer_config("kv_both", extra=_EXTRA[mode] or None), env


def _run(args: argparse.Namespace, work: Path) -> None:
    prompts = _prompts(args)
    engine = {"model": args.model, "dtype": args.dtype, "enforce_eager": True, "seed": 0,
              "max_model_len": args.max_model_len, "kv_cache_memory_bytes": args.kv_bytes,
              "skip_tokenizer_init": True, "enable_prefix_caching": True,
              "max_num_seqs": 16, "max_num_batched_tokens": args.max_batched}
    if args.block_size:
        engine["block_size"] = args.block_size
    if args.gpu_mem_util:
        engine["gpu_memory_utilization"] = args.gpu_mem_util
    params = {"stream_tokens": args.stream_tokens, "save_timeout": 120.0, "extra_save_wait": 0.0,
              "out_tokens": args.out_tokens, "clients": args.clients,
              "degraded_seconds": args.degraded_seconds, "mixed_reps": args.mixed_reps,
              "profile_hooks": str(Path(args.out).parent) if args.profile_hooks else "",
              "torch_profile": {"dir": str(Path(args.out).parent), "skip": args.timeline_skip,
                                "steps": args.timeline_steps}}
    report: dict[str, Any] = {"args": vars(args), "inject_after": INJECT_AFTER, "engine": engine,
                              "runs": {}, "writers": {}, "started": time.strftime("%F %T")}
    out = Path(args.out)

    def dump() -> None:
        report["table"] = derive(report)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, separators=(",", ":"), default=str) + "\n")  # compact: reports are committed

    from mooncake_vllm.demo.run import INSTANCE_ENV

    base_env = {**os.environ, **INSTANCE_ENV, "TMPDIR": str(work)}
    if args.timeline_modes:  # vLLM's step scopes in the trace (every mode alike: same overhead)
        base_env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    modes = [m for m in MODES if m in args.modes]
    writers = sorted({w for m in modes if (w := _writer_of(m))})
    procs: dict[str, EngineProcess] = {}
    for name in [f"writer-{w}" for w in writers] + modes:
        mode = name.removeprefix("writer-")
        kv, env = _mode_config(mode, args.prev_site)
        per = prompts["per_mode"][mode] if mode in prompts["per_mode"] else {}
        wait = args.intree_save_wait if name == "writer-intree" else 0.0
        hits = prompts["shared"]["hits"]
        if mode == "intree":  # at 32k its reader ran past the measure box
            hits = {n: v for n, v in hits.items() if int(n) <= args.intree_max_len}
        spec = {"engine": engine, "kv_config": kv, "prompts": {**prompts["shared"], **per, "hits": hits},
                "params": {**params, "extra_save_wait": wait,
                           "write_degraded": name == "writer-ours" and bool(args.degraded_modes)}}
        procs[name] = _proc(name, spec, work, {**base_env, **env})
    t0 = time.monotonic()
    started = []
    for w in writers:  # the pool first (writers in parallel); readers build their engines meanwhile
        try:
            report["writers"][w] = {"ready": procs[f"writer-{w}"].wait_file("ready", args.init_timeout)}
            procs[f"writer-{w}"].send("write")
            started.append(w)
        except RuntimeError as exc:
            report["writers"][w] = {"error": str(exc)}
    for w in writers:
        p = procs.pop(f"writer-{w}")
        try:
            if w in started:
                report["writers"][w]["write"] = p.wait_file("write.json", 300.0)
        except RuntimeError as exc:
            report["writers"][w] = {"error": str(exc)}
        p.close()
        print(f"[bench] writer {w}: {json.dumps(report['writers'][w])[:300]}", flush=True)
    dump()
    for mode in modes:  # every reader built before any measures: nothing else runs meanwhile
        try:
            ready = procs[mode].wait_file("ready", max(10.0, args.init_timeout - (time.monotonic() - t0)))
            report["runs"][mode] = {"ready": ready}
        except RuntimeError as exc:
            report["runs"][mode] = {"error": str(exc)}
            procs.pop(mode).close()
    for mode in modes:
        if mode not in procs:
            continue
        p = procs[mode]
        phases = [ph for ph in args.phases
                  if ph != "mixed" and (ph != "degraded" or mode in args.degraded_modes)]
        for phase in phases:  # a phase that hangs ends this mode
            faults = (FaultSchedule(holder_pids(args.holder_pids), args.stop_at, args.resume_at)
                      if phase == "degraded" else None)
            try:
                if faults is not None:
                    faults.start()
                report["runs"][mode][phase] = p.run(phase, args.measure_timeout
                                                    + (args.degraded_seconds if faults else 0))
            except RuntimeError as exc:
                report["runs"][mode]["error"] = f"{phase}: {exc}"
                procs.pop(mode).close()
                break
            finally:
                if faults is not None:
                    report["runs"][mode]["faults"] = faults.finish()
        dump()
        row = report["table"].get(mode)
        print(f"[bench] {mode}: {json.dumps(row) if row else report['runs'][mode]}"[:1500], flush=True)
    if "mixed" in args.phases:  # reps interleaved, every other one in reverse: drift hits every mode
        for rep in range(args.mixed_reps):
            for mode in (modes if rep % 2 == 0 else modes[::-1]):
                if mode not in procs:
                    continue
                spy = (pyspy_record(args.pyspy, procs[mode].proc.pid, rep, args.pyspy_seconds,
                                    Path(args.out).parent / f"pyspy-{mode}-mixed{rep}.txt")
                       if args.pyspy and mode in args.pyspy_modes else None)
                try:
                    result = procs[mode].run(f"mixed{rep}", args.measure_timeout)
                    if spy is not None:  # py-spy samples (--native pauses it): out of the table
                        result = {**result, "profiled": True}
                    report["runs"][mode].setdefault("mixed_reps", []).append(result)
                except RuntimeError as exc:
                    report["runs"][mode]["error"] = f"mixed{rep}: {exc}"
                    procs.pop(mode).close()
                finally:
                    if spy is not None:
                        spy.wait()
            dump()
        for mode in modes:
            row = report["table"].get(mode, {}).get("mixed")
            print(f"[bench] {mode} mixed: {json.dumps(row)}"[:1500], flush=True)
    for mode in [m for m in modes if m in args.timeline_modes and m in procs]:
        try:
            tl = procs[mode].run("timeline", args.measure_timeout + 120)
            report["runs"][mode]["timeline"] = tl
            print(f"[bench] {mode} timeline: {tl.get('trace')} {tl.get('gz_bytes')} B "
                  f"{tl.get('error', '')}", flush=True)
        except RuntimeError as exc:
            report["runs"][mode]["timeline"] = {"error": str(exc)}
        dump()
    for p in procs.values():
        p.close()
    report["finished"] = time.strftime("%F %T")
    dump()
    print(json.dumps(report["table"], indent=1), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/model")
    ap.add_argument("--out", default="interference.json")
    ap.add_argument("--modes", default=",".join(m for m in MODES if m != "ours-prev"))
    ap.add_argument("--prev-site", default="", help="ours-prev: where the other build is installed")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block-size", type=int, default=0, help="0: vLLM's default")
    ap.add_argument("--kv-bytes", type=int, default=2 << 30, help="KV cache per process")
    ap.add_argument("--gpu-mem-util", type=float, default=0.1,
                    help="only vLLM's start check (free memory >= this share); 0: not passed")
    ap.add_argument("--max-model-len", type=int, default=10240)
    ap.add_argument("--max-batched", type=int, default=8192)
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--load-len", type=int, default=8000)
    ap.add_argument("--warm-prompts", type=int, default=3,
                    help="unique prompts each reader serves first (misses: an engine that served "
                         "traffic, whose claim policy has measured its prefills), of --warm-len "
                         "x 1/2, 1, 2 in turn")
    ap.add_argument("--warm-len", type=int, default=2048)
    ap.add_argument("--lengths", default="2048,8000")
    ap.add_argument("--hit-reps", type=int, default=2)
    ap.add_argument("--vocab-max", type=int, default=31900)
    ap.add_argument("--docs", type=int, default=8, help="mixed: shared documents (in the pool)")
    ap.add_argument("--doc-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=100)
    ap.add_argument("--requests", type=int, default=64, help="mixed: requests (one question each)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--out-tokens", type=int, default=64)
    ap.add_argument("--mixed-reps", type=int, default=4,
                    help="mixed: reps per mode, interleaved across modes (ABC CBA ...)")
    ap.add_argument("--miss-lengths", default="1024,8000")
    ap.add_argument("--miss-reps", type=int, default=4)
    ap.add_argument("--intree-save-wait", type=float, default=3.0)
    ap.add_argument("--intree-max-len", type=int, default=16000,
                    help="in-tree reader: hit lengths measured up to this many tokens")
    ap.add_argument("--phases", default="measure,mixed,misses,degraded")
    ap.add_argument("--degraded-modes", default="", help="readers that run the degraded phase")
    ap.add_argument("--degraded-docs", type=int, default=8)
    ap.add_argument("--degraded-len", type=int, default=16000,
                    help="tokens per document (a hit that pays on an H200: 4k hits are declined)")
    ap.add_argument("--degraded-seconds", type=float, default=60.0)
    ap.add_argument("--stop-at", type=float, default=15.0, help="SIGSTOP all holders but one")
    ap.add_argument("--resume-at", type=float, default=35.0, help="SIGCONT them")
    ap.add_argument("--holder-pids", default="/tmp/mc/holder*.pid", help="glob of holder pid files")
    ap.add_argument("--init-timeout", type=float, default=240.0)
    ap.add_argument("--measure-timeout", type=float, default=120.0)
    ap.add_argument("--pyspy", default="", help="py-spy binary: profile mixed reps 1 and 2")
    ap.add_argument("--pyspy-modes", default="ours,ours-never,none")
    ap.add_argument("--pyspy-seconds", type=int, default=6)
    ap.add_argument("--profile-hooks", action="store_true",
                    help="cProfile inside our connector's hooks in mixed reps: "
                         "hooks-profile-MODE-mixedN.txt beside --out (timings then include its overhead)")
    ap.add_argument("--timeline-modes", default="",
                    help="after the mixed reps, one more under torch.profiler (CPU + CUDA) in these "
                         "modes: timeline-MODE.json.gz beside --out (bench/timeline_table.py)")
    ap.add_argument("--timeline-skip", type=int, default=40, help="timeline: engine steps before the window")
    ap.add_argument("--timeline-steps", type=int, default=100, help="timeline: engine steps recorded")
    ap.add_argument("--local-stack", action="store_true", help="start a Mooncake stack (CPU dry run)")
    ap.add_argument("--seed", type=int, default=None,
                    help="prompts' seed (default: the time): runs on one pool never hit each other's prompts")
    args = ap.parse_args(argv)
    if args.seed is None:  # a pool kept between runs held the last run's questions (2026-12-05)
        args.seed = time.time_ns() % (1 << 31)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.miss_lengths = [int(x) for x in args.miss_lengths.split(",")]
    args.modes = args.modes.split(",")
    args.phases = args.phases.split(",")
    args.degraded_modes = [m for m in args.degraded_modes.split(",") if m]
    args.pyspy_modes = args.pyspy_modes.split(",")
    args.timeline_modes = [m for m in args.timeline_modes.split(",") if m]
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-interference-"))
    if not args.local_stack:
        _run(args, work)
        return 0
    from mooncake_vllm.services import LocalStack

    with LocalStack(work / "stack", segment_size=2 << 30, local_buffer_size=256 << 20) as stack:
        cfg = work / "mooncake_config.json"  # ours ignores "mode"; the in-tree connector needs it
        cfg.write_text(json.dumps({**stack.config(), "mode": "standalone-store"}))
        os.environ.update({**stack.env(), "MOONCAKE_CONFIG_PATH": str(cfg),
                           "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1"})
        _run(args, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
