"""The store flow's prefill → decode hand-off, end to end: real vLLM CPU instances, a real
pool, the real ``mooncake-vllm proxy`` (store flow), in one run.

Instances (tiny random Llama, block 32): a reference (no connector), two prefill
(``kv_producer``) and two decode (``kv_consumer``) instances of OUR connector; later
one prefill + one decode of vLLM's in-tree ``MooncakeStoreConnector``
(``MOONCAKE_VLLM_DISABLE=1``, ``mode: standalone-store``, ``PYTHONHASHSEED=0``).

Phases, each with its own fresh random prompts (1-2k tokens, never ending on a block
boundary) so no instance has them cached locally:

* ``1p1d`` / ``2p2d``: 20 prompts one after the other, non-streamed, then 20 streamed;
  ``2p2d-8clients``: 20 prompts from 8 concurrent clients, mixed.
* ``kill-prefill``: the pool holder is stopped (SIGSTOP) so the prefill's saves
  hang, the prefill answers, is killed (SIGKILL) and the holder resumed: the decode
  must recompute after ``handoff_timeout`` with one log line.
* ``intree-1p1d``: the same flow with vLLM's in-tree connector (no hand-off).

Per phase: the decode instances' own ``vllm:external_prefix_cache_hits`` against the
exact full-block tokens of the prompts (the hit rate; 1.0 = every full block came
from the pool), the decode's hand-off wait (its report in non-streamed answers),
client TTFT (streamed), and token-for-token identity with the reference::

    .venv/bin/python bench/bench_handoff.py --out docs/bench-results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp

from mooncake_vllm.demo.run import kv_transfer_config
from mooncake_vllm.demo.tiny_model import VOCAB_SIZE, cached_tiny_model
from mooncake_vllm.services import LocalStack, ManagedProcess, free_port, http_probe, start_vllm_server

__all__ = ["main"]

BLOCK = 32
GEN = {"max_tokens": 8, "temperature": 0, "return_token_ids": True}
HITS = "vllm:external_prefix_cache_hits_total"
_CLI = "import sys; from mooncake_vllm.cli import main; sys.exit(main())"


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _prompts(rnd: random.Random, n: int) -> list[list[int]]:
    out = []
    while len(out) < n:
        length = rnd.randrange(1000, 1950)
        if length % BLOCK:
            out.append([rnd.randrange(10, VOCAB_SIZE - 1) for _ in range(length)])
    return out


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _ask(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
               stream: bool) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, **GEN, "stream": stream}
    t0 = time.perf_counter()
    ttft = None
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {(await r.text())[:300]}"}
        if not stream:
            doc = await r.json()
            choice = doc["choices"][0]
            report = (doc.get("kv_transfer_params") or {}).get("mooncake_vllm_handoff")
            return {"ids": choice.get("token_ids"), "text": choice["text"], "report": report,
                    "total_s": time.perf_counter() - t0}
        ids: list[int] = []
        text = ""
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            ch = json.loads(line[6:])["choices"][0]
            text += ch["text"]
            ids += ch.get("token_ids") or []
        return {"ids": ids, "text": text, "ttft_s": ttft, "total_s": time.perf_counter() - t0}


async def _run_phase(url: str, model: str, prompts: list[list[int]], modes: list[bool],
                     clients: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = [{} for _ in prompts]
    queue = list(range(len(prompts)))
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def worker() -> None:
            while queue:
                i = queue.pop(0)
                results[i] = await _ask(session, url, model, prompts[i], modes[i])
                results[i]["stream"] = modes[i]
        await asyncio.gather(*(worker() for _ in range(clients)))
    return results


def _reference(url: str, model: str, prompts: list[list[int]]) -> list[list[int]]:
    async def go() -> list[dict[str, Any]]:
        return await _run_phase(url, model, prompts, [False] * len(prompts), 2)
    return [r["ids"] for r in asyncio.run(go())]


def _summary(results: list[dict[str, Any]], prompts: list[list[int]], ref: list[list[int]],
             hits: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    expected = sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)  # = full-block tokens here
    waits = [r["report"]["wait_ms"] for r in results if r.get("report")]
    outcomes: dict[str, int] = {}
    for r in results:
        if r.get("report"):
            outcomes[r["report"]["outcome"]] = outcomes.get(r["report"]["outcome"], 0) + 1
    ttfts = [r["ttft_s"] for r in results if r.get("ttft_s") is not None]
    out = {
        "requests": len(prompts), "errors": [r["error"] for r in results if "error" in r],
        "identical_to_reference": sum(r.get("ids") == e for r, e in zip(results, ref)),
        "full_block_tokens": expected, "decode_external_hit_tokens": hits,
        "decode_hit_rate": hits / expected if expected else None,
        "handoff_outcomes": outcomes,
        "handoff_wait_ms_p50": _pct(waits, 0.5), "handoff_wait_ms_p99": _pct(waits, 0.99),
        "handoff_wait_ms_max": max(waits) if waits else None,
        "stream_ttft_s_p50": _pct(ttfts, 0.5), "stream_ttft_s_p99": _pct(ttfts, 0.99),
    }
    out.update(extra or {})
    print(f"[bench]   {json.dumps(out)}", flush=True)
    return out


class Proxy:
    """``mooncake-vllm proxy`` (store flow) as its own process."""

    def __init__(self, model: str, prefill: list[ManagedProcess], decode: list[ManagedProcess],
                 work: Path) -> None:
        port = free_port()
        argv = [sys.executable, "-c", _CLI, "proxy", "--model", model, "--port", str(port),
                "--health-interval", "2", "--prefill", *[p.address for p in prefill],
                "--decode", *[d.address for d in decode]]
        self.proc = ManagedProcess(f"proxy-{port}", argv, workdir=work / f"proxy-{port}", port=port)
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> Proxy:
        self.proc.start()
        ready = http_probe(self.url + "/health", lambda s, b: s == 200)
        self.proc.wait_ready(ready, 300, "proxy healthy")
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.stop()


def _phase(name: str, model: str, proxy_url: str, decodes: list[ManagedProcess],
           prompts: list[list[int]], ref: list[list[int]], modes: list[bool],
           clients: int = 1) -> dict[str, Any]:
    print(f"[bench] {name}: {len(prompts)} prompts, {clients} client(s)", flush=True)
    before = sum(_metric(d.url, HITS) for d in decodes)
    t0 = time.perf_counter()
    results = asyncio.run(_run_phase(proxy_url, model, prompts, modes, clients))
    wall = time.perf_counter() - t0
    hits = sum(_metric(d.url, HITS) for d in decodes) - before
    return _summary(results, prompts, ref, hits, {"wall_s": wall, "clients": clients})


def _start_all(specs: dict[str, tuple[dict[str, Any] | None, dict[str, str]]], model: Path,
               work: Path) -> dict[str, ManagedProcess]:
    procs: dict[str, ManagedProcess] = {}
    with ThreadPoolExecutor(len(specs)) as ex:
        futs = {n: ex.submit(start_vllm_server, model, None, work, cfg, env, name=n, timeout=1500)
                for n, (cfg, env) in specs.items()}
        errors = []
        for n, f in futs.items():
            try:
                procs[n] = f.result()
            except Exception as exc:  # noqa: BLE001 - reported after the others stop
                errors.append(f"{n}: {exc}")
    if errors:
        for p in procs.values():
            p.stop()
        raise RuntimeError("instances did not start: " + "; ".join(errors))
    return procs


def _kill_phase(model: str, stack: LocalStack, pre: ManagedProcess, dec: ManagedProcess,
                work: Path, prompt: list[int], ref: list[int], bound: float) -> dict[str, Any]:
    """Holder stopped → the prefill's saves hang; the prefill answers and is killed."""
    print("[bench] kill-prefill", flush=True)
    holder = stack.holder
    log_before = dec.log_path.read_text(errors="replace").count("hand-off of request")
    done_before = _metric(pre.url, "vllm:request_success_total")
    with Proxy(model, [pre], [dec], work) as proxy:
        os.kill(holder.pid, signal.SIGSTOP)
        try:
            async def go() -> dict[str, Any]:
                task = asyncio.create_task(_run_phase(proxy.url, model, [prompt], [False], 1))
                t_kill = None
                while t_kill is None:
                    await asyncio.sleep(0.01)
                    if _metric(pre.url, "vllm:request_success_total") > done_before:
                        os.killpg(pre.pid, signal.SIGKILL)  # answered, saves still hanging
                        t_kill = time.perf_counter()
                os.kill(holder.pid, signal.SIGCONT)
                res = (await task)[0]
                res["after_kill_s"] = time.perf_counter() - t_kill
                return res
            res = asyncio.run(go())
        finally:
            os.kill(holder.pid, signal.SIGCONT)
    pre.stop()
    lines = dec.log_path.read_text(errors="replace").count("hand-off of request") - log_before
    return {"report": res.get("report"), "identical_to_reference": res.get("ids") == ref,
            "decode_answer_after_kill_s": res.get("after_kill_s"), "handoff_timeout_s": bound,
            "decode_log_lines": lines, "error": res.get("error")}


def _merge(path: Path, kill: dict[str, Any]) -> int:
    """Put a kill-only run's result into the full run's JSON (marked as its own run)."""
    print(f"[bench]   {json.dumps(kill)}", flush=True)
    report = json.loads(path.read_text()) if path.exists() else {"phases": {}}
    report["phases"]["kill-prefill"] = {**kill, "run": "separate --only-kill run"}
    path.write_text(json.dumps(report, indent=2, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/bench-results")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--skip-intree", action="store_true")
    parser.add_argument("--only-kill", action="store_true",
                        help="run only the kill-prefill phase; merge it into an existing JSON")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = cached_tiny_model()
    model = str(model_dir)
    rnd = random.Random(18)
    n = args.prompts
    sets = {k: _prompts(rnd, n) for k in ("1p1d", "1p1d-stream", "2p2d", "2p2d-stream",
                                           "2p2d-8clients", "kill", "intree", "intree-stream")}
    work = Path(tempfile.mkdtemp(prefix="bench-handoff-"))
    report: dict[str, Any] = {"hardware": "dev box: 2 cores, 24 GiB, shared with other jobs",
                              "block_size": BLOCK, "prompt_tokens": "1000-1950",
                              "loadavg_start": os.getloadavg(), "phases": {}}
    t_start = time.perf_counter()
    with LocalStack(work / "stack", segment_size=1 << 30, local_buffer_size=128 << 20) as stack:
        cfg_path = work / "mooncake_config.json"
        cfg_path.write_text(json.dumps({**stack.config(), "mode": "standalone-store"}))
        env = {**stack.env(), "MOONCAKE_CONFIG_PATH": str(cfg_path),
               "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1", "PYTHONHASHSEED": "0"}
        specs: dict[str, tuple[dict[str, Any] | None, dict[str, str]]] = {
            "reference": (None, {}),
            "p1": (kv_transfer_config("kv_producer"), env),
            "p2": (kv_transfer_config("kv_producer"), env),
            "d1": (kv_transfer_config("kv_consumer"), env),
            "d2": (kv_transfer_config("kv_consumer"), env),
        }
        if args.only_kill:
            sets = {"kill": sets["kill"]}
            specs = {k: specs[k] for k in ("reference", "p2", "d2")}
        procs = _start_all(specs, model_dir, work)
        report["startup_s"] = time.perf_counter() - t_start
        try:
            ref_proc = procs["reference"]
            refs = {k: _reference(ref_proc.url, model, v) for k, v in sets.items()}
            ref_proc.stop()
            ph = report["phases"]
            if args.only_kill:
                ph["kill-prefill"] = _kill_phase(model, stack, procs["p2"], procs["d2"], work,
                                                 sets["kill"][0], refs["kill"][0], 5.0)
                return _merge(out / "handoff-vllm-cpu-0.32.json", ph["kill-prefill"])
            p1, p2, d1, d2 = (procs[k] for k in ("p1", "p2", "d1", "d2"))
            with Proxy(model, [p1], [d1], work) as px:
                ph["1p1d"] = _phase("1p1d", model, px.url, [d1], sets["1p1d"], refs["1p1d"], [False] * n)
                ph["1p1d-stream"] = _phase("1p1d-stream", model, px.url, [d1], sets["1p1d-stream"],
                                           refs["1p1d-stream"], [True] * n)
            with Proxy(model, [p1, p2], [d1, d2], work) as px:
                ph["2p2d"] = _phase("2p2d", model, px.url, [d1, d2], sets["2p2d"], refs["2p2d"], [False] * n)
                ph["2p2d-stream"] = _phase("2p2d-stream", model, px.url, [d1, d2], sets["2p2d-stream"],
                                           refs["2p2d-stream"], [True] * n)
                ph["2p2d-8clients"] = _phase("2p2d-8clients", model, px.url, [d1, d2], sets["2p2d-8clients"],
                                             refs["2p2d-8clients"], [i % 2 == 0 for i in range(n)], clients=8)
            ph["kill-prefill"] = _kill_phase(model, stack, p2, d2, work, sets["kill"][0],
                                             refs["kill"][0], 5.0)
            print(f"[bench]   {json.dumps(ph['kill-prefill'])}", flush=True)
        finally:
            for p in procs.values():
                p.stop()
        if not args.skip_intree:
            intree = kv_transfer_config("kv_producer", connector="in-tree")
            intree_d = kv_transfer_config("kv_consumer", connector="in-tree")
            off = {**env, "MOONCAKE_VLLM_DISABLE": "1"}
            try:
                it = _start_all({"ip": (intree, off), "id": (intree_d, off)}, model_dir, work)
            except RuntimeError as exc:
                report["phases"]["intree-1p1d"] = {"error": str(exc)[-1500:]}
            else:
                try:
                    with Proxy(model, [it["ip"]], [it["id"]], work) as px:
                        ph = report["phases"]
                        ph["intree-1p1d"] = _phase("intree-1p1d", model, px.url, [it["id"]], sets["intree"],
                                                   refs["intree"], [False] * n)
                        ph["intree-1p1d-stream"] = _phase("intree-1p1d-stream", model, px.url, [it["id"]],
                                                          sets["intree-stream"], refs["intree-stream"],
                                                          [True] * n)
                finally:
                    for p in it.values():
                        p.stop()
    report["wall_s"] = time.perf_counter() - t_start
    report["loadavg_end"] = os.getloadavg()
    path = out / "handoff-vllm-cpu-0.32.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"[bench] wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
