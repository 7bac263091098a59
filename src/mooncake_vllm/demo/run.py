"""One offline vLLM instance in its own process: generate, measure, report JSON.

The demo, the V1 tests and the benchmark run every vLLM "instance" through this
module so that instances are separate processes (a pool hit then really crosses
processes)::

    python -m mooncake_vllm.demo.run --model DIR --prompts prompts.json \
        --role kv_both --out result.json

``--role none`` runs without a connector (the recompute baseline). The result
JSON holds, per prompt, the generated token ids and the TTFT (one-token
generate latency), plus vLLM's external prefix-cache counters and the
connector's own counters.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mooncake_vllm.compat.facts import installed_facts

__all__ = ["INSTANCE_ENV", "PREFIX_CACHE_METRICS", "connector_counters", "counts_connector_hits",
           "kv_transfer_config",
           "run_instance", "wait_saves_idle", "worker_side", "main"]

#: Environment every offline instance gets (in-process engine, offline, quiet).
INSTANCE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def kv_transfer_config(role: str, *, module_path: bool = True, connector: str = "ours",
                       extra: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` for ``role`` (``none`` → no connector)."""
    if role == "none":
        return None
    cfg: dict[str, Any] = {"kv_connector": "MooncakeStoreConnector", "kv_role": role}
    if connector == "ours" and module_path:
        cfg["kv_connector_module_path"] = "mooncake_vllm.v1.connector"
    if extra:
        cfg["kv_connector_extra_config"] = dict(extra)
    return cfg


#: vLLM's prefix-cache counters the demo and the tests read (always registered by V1's stat logger)
PREFIX_CACHE_METRICS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                        "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits")


def counts_connector_hits() -> bool:
    """Whether the installed vLLM counts a connector's hits itself
    (``vllm:external_prefix_cache_hits``, 0.11.1+); before, a fresh instance's
    ``cached_tokens`` are its pool hits."""
    facts = installed_facts()
    return facts is None or facts.external_hit_counter


def _metric_totals(llm: Any) -> dict[str, float]:
    """vLLM's prefix-cache counters summed over engines.

    Errors propagate and a missing counter is an error: "0 hits" must never
    stand for "the metrics could not be read".
    """
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        name = getattr(metric, "name", "")
        if "prefix_cache" in name and hasattr(metric, "value"):
            out[name] = out.get(name, 0.0) + float(metric.value)
    needed = PREFIX_CACHE_METRICS if counts_connector_hits() \
        else PREFIX_CACHE_METRICS[:2]  # vLLM <= 0.11.0: no connector counter (results' cached_tokens)
    missing = [name for name in needed if name not in out]
    if missing:
        raise RuntimeError(f"vLLM reported no {', '.join(missing)} (prefix-cache counters found: "
                           f"{sorted(out) or 'none'}); hit counts would be meaningless")
    return out


def _connector_instances() -> list[Any]:
    try:
        from mooncake_vllm.v1.connector import INSTANCES
    except Exception:  # noqa: BLE001 - no vLLM / connector not used
        return []
    return list(INSTANCES)


def _merge_counters(parts: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """Sum counters over connector instances; ``store_*`` (one client per process) by max."""
    out: dict[str, int] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = max(out.get(k, 0), v) if k.startswith("store_") else out.get(k, 0) + v
    return out


def _in_worker_processes(llm: Any, what: str) -> list[Any] | None:
    """``what`` answered by every vLLM worker through ``LLM.collective_rpc`` when the workers
    run in their own processes (vllm-cpu 0.20-0.22 force the multiprocess executor); None
    when they run here (their connector instances are in this process)."""
    if llm is None or any(inst.worker is not None for inst in _connector_instances()):
        return None
    return list(llm.collective_rpc(worker_side, args=(what,)))


def worker_side(_worker: Any, what: str) -> Any:
    """Runs inside a vLLM worker process (``collective_rpc``): its connector's counters,
    waiting until its saves are written, or its KV block digests."""
    if what == "counters":
        return connector_counters()
    if what == "idle":
        wait_saves_idle()
        return True
    if what == "digests":
        return _kv_block_digests()
    raise ValueError(f"what: got {what!r}, expected counters, idle or digests")


def connector_counters(llm: Any = None) -> dict[str, int]:
    """Our connector's counters in this process, plus (given ``llm``) its worker processes'."""
    parts = [inst.counters() for inst in _connector_instances()]
    return _merge_counters(parts + (_in_worker_processes(llm, "counters") or []))


def wait_saves_idle(timeout: float = 30.0, llm: Any = None) -> None:
    """Wait until every worker's saves are written (in worker processes too, given ``llm``)."""
    if _in_worker_processes(llm, "idle") is not None:
        return
    deadline = time.monotonic() + timeout
    for inst in _connector_instances():
        while inst.worker is not None and not inst.worker.idle() and time.monotonic() < deadline:
            time.sleep(0.02)


def _step_after_saves(llm: Any) -> None:
    """Wait for the workers' saves, then step the engine once. What a finished save reports
    (its blocks freed, its KV events) rides the output of the engine's next step, and an offline
    ``LLM`` does not step between ``generate`` calls: step it with a 1-token request, since vLLM
    before 0.31 does not step an engine whose only requests wait on a connector's saves (the
    step returns at once, and 0.9's ``LLMEngine.step`` asserts on it)."""
    from vllm import SamplingParams

    wait_saves_idle(llm=llm)
    nudge = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1]}], nudge, use_tqdm=False)


def _reset_prefix_cache(llm: Any, timeout: float = 10.0) -> None:
    """Reset vLLM's local prefix cache, stepping the engine until delayed frees are done
    (blocks of a finished request stay held until the workers report its saves written)."""
    deadline = time.monotonic() + timeout
    while not _prefix_cache_reset(llm):
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM's prefix cache could not be reset: blocks still held")
        _step_after_saves(llm)


def _prefix_cache_reset(llm: Any) -> bool:
    """``LLM.reset_prefix_cache()``'s answer; vLLM before 0.14 answers None, so there ask
    the in-process engine core's scheduler, which says whether the reset happened."""
    done = llm.reset_prefix_cache()
    if done is not None:
        return bool(done)
    scheduler = getattr(getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None),
                        "scheduler", None)
    if scheduler is None:
        raise RuntimeError("this vLLM does not say whether its prefix cache was reset and its "
                           "scheduler is not in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    return bool(scheduler.reset_prefix_cache())


def _tolerate_inprocess_connector_stats() -> None:
    """vLLM 0.11.x's stat logger asserts that its process holds no KV connector: true with a
    separate engine process (``vllm serve``), false in our in-process offline instances,
    where the engine core has built the connector first. Lift only that assertion (its
    stats aggregation then runs as in the separate-process case); facts say which releases."""
    facts = installed_facts()
    if facts is None or not facts.inprocess_connector_stats_assert:
        return
    from vllm.distributed.kv_transfer.kv_connector.v1 import metrics

    metrics.has_kv_transfer_group = lambda: False


def _record_idle_step_stats(llm: Any) -> None:
    """vLLM 0.17-0.27's offline ``LLMEngine.step`` drops the scheduler stats of a step with
    no request outputs: the step that starts a background load, so vLLM's own hit counters
    miss every asynchronously loaded prefix (``vllm serve`` records them; vLLM 0.28 fixed
    the offline path: "record even when this step produced no request outputs"). Record
    exactly those stats, as 0.28 does, so the counters the tests read are vLLM's own."""
    facts = installed_facts()
    engine = llm.llm_engine
    if facts is None or not facts.offline_drops_idle_step_stats or engine.logger_manager is None:
        return
    core = engine.engine_core
    get_output = core.get_output

    def get_output_recording_idle_steps() -> Any:
        outputs = get_output()
        if outputs.scheduler_stats is not None and not outputs.outputs:
            engine.logger_manager.record(scheduler_stats=outputs.scheduler_stats,
                                         iteration_stats=None)
        return outputs

    core.get_output = get_output_recording_idle_steps


def _kv_cache_size(nbytes: int) -> dict[str, int]:
    """The LLM keyword for a KV cache of ``nbytes`` (or its environment, vLLM <= 0.10 on CPU)."""
    from mooncake_vllm.services.external import kv_cache_size

    kwargs, env = kv_cache_size(nbytes)
    for key, value in env.items():
        os.environ.setdefault(key, value)
    return kwargs


def _kv_events(enabled: bool) -> dict[str, Any]:
    """The LLM keyword that turns vLLM's KV events on (published nowhere: publisher ``null``)."""
    if not enabled:
        return {}
    return {"kv_events_config": {"enable_kv_cache_events": True, "publisher": "null"}}


def _attention(backend: str | None) -> dict[str, Any]:
    """The LLM keyword that picks vLLM's attention backend (``$MOONCAKE_VLLM_DEMO_ATTENTION_BACKEND``,
    e.g. ``CPU_MLA``: vllm-cpu 0.32 prefers AMX MLA on AMX hosts, whose kernels refuse float32)."""
    return {"attention_config": {"backend": backend}} if backend else {}


def _instance(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    _tolerate_inprocess_connector_stats()

    prompts: list[list[int]] = json.loads(Path(args.prompts).read_text())
    kv_cfg = json.loads(args.kv_transfer_config) if args.kv_transfer_config else None
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype="float32", block_size=args.block_size,
              max_model_len=args.max_model_len, **_kv_cache_size(args.kv_bytes),
              enforce_eager=True, enable_prefix_caching=True, disable_log_stats=False,
              kv_transfer_config=kv_cfg, seed=0, **_kv_events(args.kv_events),
              **_attention(os.environ.get("MOONCAKE_VLLM_DEMO_ATTENTION_BACKEND")))
    init_s = time.perf_counter() - t0
    _record_idle_step_stats(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=args.first_max_tokens, ignore_eos=True)
    results = []
    kill_pid, kill_after = (int(x) for x in args.kill_after.split(":")) if args.kill_after else (0, -1)
    for _ in range(args.warmup):
        llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], first, use_tqdm=False)
        _reset_prefix_cache(llm)
    for n, ids in enumerate(prompts):
        if n == kill_after:  # fault injection for tests: kill a service mid-run
            os.kill(kill_pid, signal.SIGKILL)
        if args.reset_prefix_cache:
            _reset_prefix_cache(llm)
        t = time.perf_counter()
        first_out = llm.generate([{"prompt_token_ids": ids}], first, use_tqdm=False)
        ttft = time.perf_counter() - t
        tokens: list[int] = []
        if not args.ttft_only:
            if args.reset_prefix_cache:
                _reset_prefix_cache(llm)
            out = llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)
            tokens = list(out[0].outputs[0].token_ids)
        # vLLM's own count of this prompt's prefix tokens it did not compute (local + pool)
        cached = getattr(first_out[0], "num_cached_tokens", None)
        results.append({"prompt_len": len(ids), "ttft_s": ttft, "tokens": tokens,
                        "cached_tokens": cached, "rss_kb": _rss_kb()})
    if args.kv_events:  # every save's KV events reach the scheduler side
        _step_after_saves(llm)
    else:
        wait_saves_idle(llm=llm)
    return {"init_s": init_s, "results": results, "metrics": _metric_totals(llm),
            "connector": connector_counters(llm), "rss_kb": _rss_kb(),
            "kv_block_digests": _kv_block_digests(llm)}


def _kv_block_digests(llm: Any = None) -> list[str]:
    """With ``MOONCAKE_VLLM_DEMO_KV_DIGESTS=1``: a digest of every non-zero KV block the
    worker holds (all layers' bytes), so tests can compare two instances' caches."""
    if os.environ.get("MOONCAKE_VLLM_DEMO_KV_DIGESTS") != "1":
        return []
    remote = _in_worker_processes(llm, "digests")
    if remote is not None:
        return [digest for part in remote for digest in part]
    import hashlib

    out = []
    for inst in _connector_instances():
        layout = inst.worker.layout if inst.worker is not None else None
        if layout is None:
            continue
        views = layout.byte_views()
        for block in range(layout.num_blocks):
            rows = [v[:, block].contiguous() for v in views]
            if all(int(r.count_nonzero()) == 0 for r in rows):
                continue
            h = hashlib.blake2b(digest_size=16)
            for r in rows:
                h.update(r.cpu().numpy().tobytes())
            out.append(h.hexdigest())
    return out


def _rss_kb() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_instance(model: str | os.PathLike, prompts: Sequence[Sequence[int]], workdir: Path, *,
                 role: str = "kv_both", env: Mapping[str, str] | None = None,
                 kv_config: Mapping[str, Any] | None = None, max_tokens: int = 8,
                 first_max_tokens: int = 1,
                 block_size: int = 32, kv_bytes: int = 64 << 20, max_model_len: int = 4096,
                 reset_prefix_cache: bool = False, warmup: int = 0, ttft_only: bool = False,
                 kill_after: tuple[int, int] | None = None, timeout: float = 600.0,
                 kv_events: bool = False,
                 name: str = "instance", python: str | None = None) -> dict[str, Any]:
    """Run one instance in a fresh Python process and return its result dict.

    ``python``: the interpreter to run it with (another env's, holding another vLLM
    release); default this one. ``first_max_tokens``: tokens of each prompt's first request
    (1: its ``ttft_s`` is a time to first token)."""
    workdir.mkdir(parents=True, exist_ok=True)
    prompts_path = workdir / f"{name}-prompts.json"
    prompts_path.write_text(json.dumps([list(p) for p in prompts]))
    out_path = workdir / f"{name}-result.json"
    cfg = dict(kv_config) if kv_config is not None else kv_transfer_config(role)
    argv = [python or sys.executable, "-m", "mooncake_vllm.demo.run", "--model", str(model),
            "--prompts", str(prompts_path), "--out", str(out_path),
            "--max-tokens", str(max_tokens), "--first-max-tokens", str(first_max_tokens),
            "--block-size", str(block_size),
            "--kv-bytes", str(kv_bytes), "--max-model-len", str(max_model_len),
            "--warmup", str(warmup)]
    if cfg is not None:
        argv += ["--kv-transfer-config", json.dumps(cfg)]
    if reset_prefix_cache:
        argv.append("--reset-prefix-cache")
    if ttft_only:
        argv.append("--ttft-only")
    if kv_events:
        argv.append("--kv-events")
    if kill_after is not None:
        argv += ["--kill-after", f"{kill_after[0]}:{kill_after[1]}"]
    full_env = {**os.environ, **INSTANCE_ENV, "TMPDIR": str(workdir), **(env or {})}
    log_path = workdir / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{name} did not finish within {timeout:.0f} s; log {log_path}") from None
    if rc != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{name} exited with {rc}; log {log_path}:\n{tail}")
    result = json.loads(out_path.read_text())
    result["log"] = log_path.read_text(errors="replace")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--out", required=True)
    parser.add_argument("--kv-transfer-config", default="")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--first-max-tokens", type=int, default=1,
                        help="tokens of each prompt's first (timed) request")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--kv-bytes", type=int, default=64 << 20)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--reset-prefix-cache", action="store_true")
    parser.add_argument("--ttft-only", action="store_true")
    parser.add_argument("--kv-events", action="store_true", help="vLLM KV events on (publisher null)")
    parser.add_argument("--kill-after", default="", help="PID:N - SIGKILL PID before prompt N")
    args = parser.parse_args(argv)
    result = _instance(args)
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
