"""Latency and throughput the XpYd proxy adds, against a fast stub upstream, in one run.

Three processes on loopback: the stub upstreams (one prefill, one decode port),
the real ``mooncake-vllm proxy`` (store flow), and this client. Two modes do
the same upstream work:

* direct:  POST prefill (max_tokens=1), then stream from decode, by the client itself
* proxied: one streaming POST to the proxy, which does exactly that

Latency: ``--streams`` closed-loop workers alternate the two modes request by
request, so both run side by side under the same machine load; the difference
of the percentiles is the latency the proxy adds. Throughput: each mode alone,
alternating, same concurrency. Prints absolute figures and ratios.

    .venv/bin/python bench/bench_proxy.py [--streams 100] [--requests 1200] [--tokens 16] [--delay 0.02]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from mooncake_vllm.services import ManagedProcess, free_port, http_probe

__all__ = ["main"]

MODEL = "bench-model"
MODES = ("direct", "proxied")

_STUBS = """
import asyncio, sys
from mooncake_vllm.proxy.stub import StubUpstream
async def serve():
    for port in sys.argv[4:]:
        await StubUpstream(model=sys.argv[1], port=int(port), tokens=int(sys.argv[2]),
                           delay=float(sys.argv[3])).start()
    await asyncio.Event().wait()
try:
    import uvloop
    uvloop.run(serve())
except ImportError:
    asyncio.run(serve())
"""
_CLI = "import sys; from mooncake_vllm.cli import main; sys.exit(main())"

Samples = dict[str, dict[str, list[float]]]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _one(session: aiohttp.ClientSession, mode: str, urls: dict[str, str], n_tokens: int) -> tuple[float, float]:
    """One request; (time to first decode byte, total), seconds."""
    body = {"model": MODEL, "prompt": "The quick brown fox " * 20, "max_tokens": n_tokens, "stream": True}
    t0 = time.perf_counter()
    if mode == "direct":
        async with session.post(urls["prefill"] + "/v1/completions",
                                json={**body, "max_tokens": 1, "stream": False}) as r:
            await r.read()
            r.raise_for_status()
    target = urls["decode"] if mode == "direct" else urls["proxy"]
    ttfb = 0.0
    async with session.post(target + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for _chunk in r.content.iter_any():
            if not ttfb:
                ttfb = time.perf_counter() - t0
    return ttfb, time.perf_counter() - t0


async def _round(modes: tuple[str, ...], urls: dict[str, str], streams: int, requests: int,
                 n_tokens: int) -> Samples:
    """``requests`` requests over ``streams`` closed-loop workers; request i uses ``modes[i % len(modes)]``."""
    lat: Samples = {m: {"ttfb": [], "total": []} for m in modes}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        todo = iter(range(requests))

        async def worker() -> None:
            for i in todo:
                mode = modes[i % len(modes)]
                ttfb, total = await _one(session, mode, urls, n_tokens)
                lat[mode]["ttfb"].append(ttfb)
                lat[mode]["total"].append(total)

        await asyncio.gather(*(worker() for _ in range(streams)))
    return lat


async def _bench(args: argparse.Namespace, urls: dict[str, str], proxy_pid: int) -> tuple[Samples, dict[str, float]]:
    await _round(MODES, urls, min(args.streams, 10), 60, args.tokens)  # warm-up: connections, code paths
    lat: Samples = {m: {"ttfb": [], "total": []} for m in MODES}
    rps = {m: 0.0 for m in MODES}
    per_round = max(2, args.requests // args.rounds)
    cpu = 0.0
    for _ in range(args.rounds):
        c0 = _cpu_seconds(proxy_pid)
        for mode, res in (await _round(MODES, urls, args.streams, per_round, args.tokens)).items():
            for key, values in res.items():
                lat[mode][key] += values
        cpu += _cpu_seconds(proxy_pid) - c0
        for mode in MODES:
            t0 = time.perf_counter()
            await _round((mode,), urls, args.streams, per_round // 2, args.tokens)
            rps[mode] += (per_round // 2) / (time.perf_counter() - t0) / args.rounds
    rps["proxy_cpu_ms"] = cpu / len(lat["proxied"]["total"]) * 1000
    return lat, rps


def _report(lat: Samples, rps: dict[str, float], args: argparse.Namespace) -> None:
    d, p = lat["direct"], lat["proxied"]
    print(f"\n{args.streams} concurrent streams; {len(d['total'])} direct + {len(p['total'])} proxied requests side by "
          f"side in {args.rounds} rounds; {args.tokens} SSE chunks per stream, {args.delay * 1000:.0f} ms apart\n")
    print(f"{'metric':<18}{'direct ms':>12}{'proxied ms':>12}{'added ms':>11}{'ratio':>8}")
    for key, label in (("ttfb", "first byte"), ("total", "total")):
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            a, b = _pct(d[key], q) * 1000, _pct(p[key], q) * 1000
            print(f"{label + ' ' + name:<18}{a:>12.2f}{b:>12.2f}{b - a:>11.2f}{b / a:>8.3f}")
        a, b = statistics.mean(d[key]) * 1000, statistics.mean(p[key]) * 1000
        print(f"{label + ' mean':<18}{a:>12.2f}{b:>12.2f}{b - a:>11.2f}{b / a:>8.3f}")
    rd, rp = rps["direct"], rps["proxied"]
    print(f"\nthroughput, each mode alone: direct {rd:.1f} req/s ({rd * args.tokens:.0f} chunks/s), "
          f"proxied {rp:.1f} req/s ({rp * args.tokens:.0f} chunks/s), ratio {rp / rd:.3f}")
    print(f"proxy CPU per proxied request (prefill + relayed stream): {rps['proxy_cpu_ms']:.3f} ms")
    added = (_pct(p["total"], 0.5) - _pct(d["total"], 0.5)) * 1000
    added_fb = (_pct(p["ttfb"], 0.5) - _pct(d["ttfb"], 0.5)) * 1000
    print(f"added at p50: {added:.2f} ms total, {added_fb:.2f} ms first byte; "
          f"target < 1 ms: {'met' if max(added, added_fb) < 1.0 else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=100, help="concurrent streams (default 100)")
    ap.add_argument("--requests", type=int, default=1200, help="side-by-side requests in all rounds (default 1200)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--tokens", type=int, default=16, help="SSE chunks per stream (default 16)")
    ap.add_argument("--delay", type=float, default=0.02, help="seconds between chunks (default 0.02)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    pre_port, dec_port, proxy_port = free_port(), free_port(), free_port()
    procs: list[ManagedProcess] = []
    try:
        stub = ManagedProcess("stubs", [sys.executable, "-c", _STUBS, MODEL, str(args.tokens), str(args.delay),
                                        str(pre_port), str(dec_port)], workdir=work).start()
        procs.append(stub)
        for port in (pre_port, dec_port):
            stub.wait_ready(http_probe(f"http://127.0.0.1:{port}/health"), 30)
        proxy = ManagedProcess("proxy", [sys.executable, "-c", _CLI, "proxy", "--model", MODEL,
                                         "-p", f"127.0.0.1:{pre_port}", "-d", f"127.0.0.1:{dec_port}",
                                         "--port", str(proxy_port), "--log-level", "WARNING"], workdir=work).start()
        procs.append(proxy)
        proxy.wait_ready(http_probe(f"http://127.0.0.1:{proxy_port}/health"), 30)
        urls = {"prefill": f"http://127.0.0.1:{pre_port}", "decode": f"http://127.0.0.1:{dec_port}",
                "proxy": f"http://127.0.0.1:{proxy_port}"}
        try:
            import uvloop

            lat, rps = uvloop.run(_bench(args, urls, proxy.pid))
        except ImportError:
            lat, rps = asyncio.run(_bench(args, urls, proxy.pid))
        _report(lat, rps, args)
    finally:
        for proc in reversed(procs):
            proc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
