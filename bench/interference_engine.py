"""One vLLM engine of bench_gpu_interference.py (a writer or a reader), in its own process.

Run by the driver as ``python interference_engine.py SPEC``: builds the engine from the spec,
writes ``ready``, then runs one command per stdin line (``write``, ``measure``, ``mixedN``,
``misses``, ``degraded``) and writes each result as ``<command>.json`` beside it. Readers drive
vLLM's in-process engine step by step and stamp every token (engine_steps.py); our connector's
hooks are timed in this process (mixed serving reports their share of each step).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from degraded import degraded_loop
from engine_steps import HookTimer, Req, closed_loop_stats, interference, pct, serve
from proc_census import cpu_delta, gc_census, rss_mib, thread_affinity, thread_cpu

__all__ = ["INJECT_AFTER", "main"]

INJECT_AFTER = 32  #: stream tokens before the 8k request arrives

#: the connector's hooks, timed in this process (mixed serving reports their share of each step)
HOOKS = HookTimer()


def _serve(engine: Any, reqs: list[Req], clients: int = 1, steps: list[float] | None = None,
           after_step: Callable[[], Any] | None = None) -> None:
    serve(engine, reqs, clients=clients, detokenize=False, steps=steps,  # no tokenizer here
          after_step=after_step)


def _advisor() -> dict[str, Any] | None:
    """The claim policy's models and recent decisions (the scheduler side in this process)."""
    try:
        from mooncake_vllm.v1.connector import INSTANCES
    except ImportError:
        return None
    for inst in list(INSTANCES):
        if getattr(inst, "scheduler", None) is not None:
            return inst.scheduler.claims.snapshot()
    return None


def _counters() -> dict[str, int]:
    """Our connector's counters in this process ({} without it)."""
    from mooncake_vllm.demo.run import connector_counters

    return connector_counters()


def _settle(llm: Any, timeout: float) -> float:
    """Step until every block is free again (saves written), then our workers idle; seconds."""
    t0 = time.monotonic()
    while not llm.reset_prefix_cache() and time.monotonic() - t0 < timeout:
        llm.llm_engine.step()
        time.sleep(0.01)
    try:
        from mooncake_vllm.demo.run import wait_saves_idle
        wait_saves_idle(max(1.0, timeout - (time.monotonic() - t0)))
    except ImportError:
        pass
    return time.monotonic() - t0


def _commands(llm: Any, spec: dict[str, Any]) -> dict[str, Any]:
    engine, pr, p = llm.llm_engine, spec["prompts"], spec["params"]
    seq = iter(range(1 << 30))

    def req(prompt: list[int], n: int) -> Req:
        return Req(f"r{next(seq)}", prompt, n)

    warmed: list[bool] = []

    def warm() -> None:
        """Misses first, once, as in serving: the claim policy's recompute samples (a mixed
        phase without the measure phase claimed its first burst blind, 2026-12-05)."""
        if not warmed:
            for prompt in pr["warm"]:
                _serve(engine, [req(prompt, 8)])
            warmed.append(True)

    def write() -> dict[str, Any]:
        """Recompute (and so save) every pool prompt; its output is the readers' reference."""
        t0 = time.perf_counter()
        _serve(engine, [req(pr["warm_hit"], 1)])
        for doc in pr["docs"] + (pr["degraded_docs"] if p["write_degraded"] else []):
            _serve(engine, [req(doc, 1)])  # the mixed and degraded phases' shared documents
        load = req(pr["load"], 8)
        _serve(engine, [load])
        hits: dict[str, list[list[int]]] = {}
        for n, prompts in pr["hits"].items():
            hits[n] = []
            for prompt in prompts:
                r = req(prompt, 16)
                _serve(engine, [r])
                hits[n].append(r.tokens)
        served = time.perf_counter() - t0
        settle = _settle(llm, p["save_timeout"])
        time.sleep(p["extra_save_wait"])
        return {"served_s": served, "settle_s": settle, "tokens": {"load": load.tokens, "hits": hits}}

    def measure() -> dict[str, Any]:
        from mooncake_vllm.demo.run import connector_counters, wait_saves_idle

        warm()
        warm_hit = req(pr["warm_hit"], 2)
        _serve(engine, [warm_hit])  # a first pool hit: one-time costs out of the measurement
        n_out = p["stream_tokens"]
        alone, stream = req(pr["stream_alone"], n_out), req(pr["stream_loaded"], n_out)
        load = req(pr["load"], 8)
        res: dict[str, Any] = interference(engine, alone, stream, load, INJECT_AFTER,
                                           between=wait_saves_idle, detokenize=False)
        t0, t1 = load.t_add, load.times[0]
        res.update({
            "warm_hit": {"ttft_s": warm_hit.ttft(), "cached": warm_hit.cached},
            "load": {"ttft_s": load.ttft(), "cached": load.cached, "tokens": load.tokens,
                     "n": len(load.prompt)},
            "stream_alone_itls": alone.itls(), "stream_loaded_itls": stream.itls(),
            "load_window": [t0 - stream.times[0], t1 - stream.times[0]]})
        wait_saves_idle()
        hits: dict[str, list[dict[str, Any]]] = {}
        for n, prompts in pr["hits"].items():
            hits[n] = []
            for prompt in prompts:
                r, again = req(prompt, 16), req(prompt, 16)
                _serve(engine, [r])
                _serve(engine, [again])  # vLLM's own prefix cache in HBM
                hits[n].append({"ttft_s": r.ttft(), "cached": r.cached, "tokens": r.tokens,
                                "again_ttft_s": again.ttft(), "again_tokens": again.tokens})
        res["hits"] = hits
        res["connector"] = connector_counters()
        return res

    def ready_rep(questions: list[list[int]]) -> tuple[float, list[Req]]:
        """Before a mixed rep: the warm-up misses (once), every block free again, and one
        request per question, each behind its shared document (round robin): the settle
        seconds and the requests."""
        warm()
        settle = _settle(llm, p["save_timeout"])
        docs = pr["docs"]
        return settle, [req(docs[i % len(docs)] + q, p["out_tokens"]) for i, q in enumerate(questions)]

    def mixed(rep: int = 0) -> dict[str, Any]:
        """One rep: the documents only in the pool (vLLM's prefix cache reset first), new questions."""
        settle, reqs = ready_rep(pr["questions"][rep % len(pr["questions"])])
        steps: list[float] = []
        HOOKS.take()
        HOOKS.take_profile()
        HOOKS.profile = bool(p.get("profile_hooks"))
        before, cpu0 = _counters(), thread_cpu()
        _serve(engine, reqs, p["clients"], steps=steps)
        after, cpu = _counters(), cpu_delta(cpu0, thread_cpu())
        HOOKS.profile = False
        if p.get("profile_hooks"):  # where the hooks' time went, beside the driver's JSON
            Path(p["profile_hooks"], f"hooks-profile-{Path(spec['dir']).name}-mixed{rep}.txt").write_text(
                HOOKS.take_profile())
        return {**closed_loop_stats(reqs), "cached": [r.cached for r in reqs], "settle_s": settle,
                "ttft_s": [r.ttft() for r in reqs], "ttft_steps": [r.ttft_steps() for r in reqs],
                "connector_delta": {k: v - before.get(k, 0) for k, v in after.items()
                                    if v != before.get(k, 0)},
                "steps": {"n": len(steps), "sum_s": sum(steps), "p50_s": pct(steps, 0.5),
                          "p99_s": pct(steps, 0.99)},
                "hooks": HOOKS.take(), "rep": rep, "gc": gc_census(),
                "thread_cpu_s": cpu, "rss_mib": rss_mib(),
                **({"thread_cpus": thread_affinity()} if rep == 0 else {})}

    def timeline() -> dict[str, Any]:
        """One more mixed rep (questions no rep asked) under torch.profiler: a window of its
        steps as a gzipped chrome trace beside the driver's JSON (bench/timeline_table.py)."""
        from torch_timeline import record

        settle, reqs = ready_rep(pr["questions"][-1])
        steps: list[float] = []
        prof = p["torch_profile"]
        trace = Path(prof["dir"], f"timeline-{Path(spec['dir']).name}.json")
        HOOKS.annotate = True
        try:
            rec = record(lambda after: _serve(engine, reqs, p["clients"], steps=steps, after_step=after),
                         trace, skip=prof["skip"], active=prof["steps"])
        finally:
            HOOKS.annotate = False
        return {**closed_loop_stats(reqs), **rec, "settle_s": settle, "steps_s": steps,
                "cached": [r.cached for r in reqs], "ttft_s": [r.ttft() for r in reqs],
                # 0-based engine steps: ProfilerStep#N of the trace is step N
                "add_step": [r.step_add for r in reqs], "first_step": [r.step_first - 1 for r in reqs]}

    def misses() -> dict[str, Any]:
        """Prompts nobody stored, back to back (each save runs beside the next prefill)."""
        from mooncake_vllm.demo.run import connector_counters, wait_saves_idle

        wait_saves_idle()
        out: dict[str, Any] = {}
        for n, prompts in pr["misses"].items():
            reqs = [req(prompt, 1) for prompt in prompts]
            for r in reqs:
                _serve(engine, [r])
            out[n] = {"ttft_s": [r.ttft() for r in reqs], "cached": [r.cached for r in reqs]}
        wait_saves_idle()
        out["connector"] = connector_counters()
        return out

    def degraded() -> dict[str, Any]:
        from mooncake_vllm.demo.run import connector_counters, wait_saves_idle

        wait_saves_idle()
        runs = degraded_loop(llm, pr["degraded_docs"], p["degraded_seconds"],
                             lambda doc: req(doc, 1), _serve)
        return {"requests": runs, "connector": connector_counters()}

    commands: dict[str, Callable[[], dict[str, Any]]] = {
        "write": write, "measure": measure, "misses": misses, "degraded": degraded,
        "timeline": timeline}
    for rep in range(p["mixed_reps"]):
        commands[f"mixed{rep}"] = functools.partial(mixed, rep)
    return commands


def _physical_cores() -> list[set[int]]:
    """This process's CPUs grouped by physical core (siblings together), from sysfs."""
    cores: dict[str, set[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        key = path.read_text().strip() if path.exists() else str(cpu)
        cores.setdefault(key, set()).add(cpu)
    return list(cores.values())


def _split_cores() -> dict[str, Any] | None:
    """``MCV_BENCH_SPLIT_CORES=1``: this process (vLLM's threads, and every thread they start)
    keeps the first half of the physical cores; our threads move to the rest when they start."""
    if os.environ.get("MCV_BENCH_SPLIT_CORES") != "1":
        return None
    import mooncake_vllm.placement  # noqa: F401 - the process's cores, noted before it narrows
    cores = _physical_cores()
    mine = set().union(*cores[:max(1, len(cores) // 2)])
    os.sched_setaffinity(0, mine)
    return {"engine_cpus": sorted(mine), "physical_cores": [sorted(c) for c in cores]}


def _discard_puts() -> bool:
    """``MCV_BENCH_DISCARD_PUTS=1``: saves are captured and committed as usual, but their
    puts store nothing (``put_ticket`` returns at once): what capturing costs, without the
    transfers. A bench device only: nothing of it is in the package."""
    if os.environ.get("MCV_BENCH_DISCARD_PUTS") != "1":
        return False
    from mooncake_vllm.store import client

    def discard(transport: Any, paths: Any, ticket: Any, todo: list[int]) -> int:
        return 0

    client.put_ticket = discard  # type: ignore[assignment]
    return True


def _worker(spec: dict[str, Any]) -> None:
    """One vLLM engine: ``ready`` once built, then one command per stdin line, results as files."""
    out, rc = Path(spec["dir"]), 0
    try:
        import vllm
        from vllm import LLM

        split = _split_cores()
        discarding = _discard_puts()
        t0 = time.perf_counter()
        llm = LLM(**spec["engine"], kv_transfer_config=spec["kv_config"])
        import mooncake_vllm

        info = {"init_s": time.perf_counter() - t0, "vllm": vllm.__version__, "split": split,
                "puts_discarded": discarding,
                "mooncake_vllm": str(Path(mooncake_vllm.__file__).parent)}
        try:
            info["async_scheduling"] = llm.llm_engine.vllm_config.scheduler_config.async_scheduling
        except AttributeError:
            pass
        if spec["kv_config"] is not None and os.environ.get("MOONCAKE_VLLM_DISABLE") != "1":
            from mooncake_vllm.v1.connector import MooncakeStoreConnector
            HOOKS.install(MooncakeStoreConnector)
        (out / "ready").write_text(json.dumps(info))
        commands = _commands(llm, spec)
        for line in sys.stdin:
            name = line.strip()
            if not name:
                break
            try:
                result = commands[name]()
                advisor = _advisor()
                if advisor is not None and isinstance(result, dict):
                    result["advisor"] = advisor  # the claim policy as this phase left it
            except Exception as exc:  # noqa: BLE001 - reported to the driver, which goes on
                import traceback
                result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            (out / f"{name}.tmp").write_text(json.dumps(result))
            (out / f"{name}.tmp").rename(out / f"{name}.json")
    except BaseException:  # noqa: BLE001 - the log shows it; the driver sees the exit
        import traceback
        traceback.print_exc()
        rc = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)  # skip vLLM's shutdown: the results are written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    _worker(json.loads(Path(args[0]).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
