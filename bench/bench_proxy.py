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
                                          [--in-process]

"direct" is not "decode only": the store flow's prefill round trip is part of the
protocol, not of the proxy, so the direct client does it too. On a loaded box the
extra process hop costs scheduler wait; ``--in-process`` runs everything on one
event loop to isolate the proxy's own code, and a bare aiohttp request/response
is timed first as the machine's yardstick.
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
#: the proxy without uvloop (``--loop asyncio``): an import of it then fails
_NO_UVLOOP = "import sys; sys.modules['uvloop'] = None; "

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


async def _bench(args: argparse.Namespace, urls: dict[str, str],
                 proxy_pid: int | None) -> tuple[Samples, dict[str, float]]:
    """Warm-up, then ``rounds`` of side-by-side latency and per-mode throughput.
    ``proxy_pid`` None: everything runs in this process; CPU is counted for all of it."""

    def cpu_now() -> float:
        return time.process_time() if proxy_pid is None else _cpu_seconds(proxy_pid)

    await _round(MODES, urls, min(args.streams, 10), 60, args.tokens)  # warm-up: connections, code paths
    lat: Samples = {m: {"ttfb": [], "total": []} for m in MODES}
    rps = {m: 0.0 for m in MODES}
    per_round = max(2, args.requests // args.rounds)
    cpu = 0.0
    for _ in range(args.rounds):
        c0 = cpu_now()
        for mode, res in (await _round(MODES, urls, args.streams, per_round, args.tokens)).items():
            for key, values in res.items():
                lat[mode][key] += values
        cpu += cpu_now() - c0
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
    if args.in_process:
        print(f"CPU per request, client + stubs + proxy in one process: {rps['proxy_cpu_ms'] / 2:.3f} ms")
    else:
        print(f"proxy CPU per proxied request (prefill + relayed stream): {rps['proxy_cpu_ms']:.3f} ms")
    added = (_pct(p["total"], 0.5) - _pct(d["total"], 0.5)) * 1000
    added_fb = (_pct(p["ttfb"], 0.5) - _pct(d["ttfb"], 0.5)) * 1000
    print(f"added at p50: {added:.2f} ms total, {added_fb:.2f} ms first byte; "
          f"target < 1 ms: {'met' if max(added, added_fb) < 1.0 else 'NOT met'}")


async def _calibrate(n: int = 400) -> float:
    """Wall ms of one bare aiohttp GET exchange on loopback (client and server in this process):
    the machine-speed yardstick the proxy's added latency can be compared with."""
    from aiohttp import web

    app = web.Application()

    async def ok(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/"
    try:
        async with aiohttp.ClientSession() as session:
            for i in range(n + 50):
                if i == 50:
                    t0 = time.perf_counter()
                async with session.get(url) as r:
                    await r.read()
            return (time.perf_counter() - t0) / n * 1000
    finally:
        await runner.cleanup()


def _run(coro):  # noqa: ANN001, ANN202 - runs a coroutine on uvloop when installed
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


async def _in_process(args: argparse.Namespace) -> tuple[Samples, dict[str, float]]:
    from mooncake_vllm.proxy.server import ProxyConfig, ProxyServer
    from mooncake_vllm.proxy.stub import StubUpstream

    ups = [StubUpstream(model=MODEL, tokens=args.tokens, delay=args.delay) for _ in range(2)]
    for up in ups:
        await up.start()
    server = ProxyServer(ProxyConfig(model=MODEL, prefill=[ups[0].address], decode=[ups[1].address], port=0))
    port = await server.start()
    try:
        urls = {"prefill": f"http://{ups[0].address}", "decode": f"http://{ups[1].address}",
                "proxy": f"http://127.0.0.1:{port}"}
        return await _bench(args, urls, None)
    finally:
        await server.stop()
        for up in ups:
            await up.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=100, help="concurrent streams (default 100)")
    ap.add_argument("--requests", type=int, default=1200, help="side-by-side requests in all rounds (default 1200)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--tokens", type=int, default=16, help="SSE chunks per stream (default 16)")
    ap.add_argument("--delay", type=float, default=0.02, help="seconds between chunks (default 0.02)")
    ap.add_argument("--in-process", action="store_true",
                    help="run stubs, proxy and client on one event loop: measures the proxy's code on the "
                         "critical path without the OS scheduler's cost of an extra process hop")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                    help="the proxy's event loop (uvloop: when installed, as the CLI runs it)")
    ap.add_argument("--pin", action="store_true",
                    help="pin the proxy to the first allowed core and the client and stubs to the others")
    args = ap.parse_args(argv)
    print(f"machine yardstick: one bare aiohttp request/response on loopback takes {_run(_calibrate()):.3f} ms")
    if args.in_process:
        lat, rps = _run(_in_process(args))
        _report(lat, rps, args)
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    pre_port, dec_port, proxy_port = free_port(), free_port(), free_port()
    procs: list[ManagedProcess] = []
    try:
        stub = ManagedProcess("stubs", [sys.executable, "-c", _STUBS, MODEL, str(args.tokens), str(args.delay),
                                        str(pre_port), str(dec_port)], workdir=work).start()
        procs.append(stub)
        if args.pin:  # the proxy alone on the first core, everything else on the others
            cores = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, cores[1:])
            os.sched_setaffinity(stub.pid, cores[1:])
        for port in (pre_port, dec_port):
            stub.wait_ready(http_probe(f"http://127.0.0.1:{port}/health"), 30)
        cli = (_NO_UVLOOP if args.loop == "asyncio" else "") + _CLI
        proxy = ManagedProcess("proxy", [sys.executable, "-c", cli, "proxy", "--model", MODEL,
                                         "-p", f"127.0.0.1:{pre_port}", "-d", f"127.0.0.1:{dec_port}",
                                         "--port", str(proxy_port), "--log-level", "WARNING"], workdir=work).start()
        procs.append(proxy)
        if args.pin:
            os.sched_setaffinity(proxy.pid, cores[:1])
        proxy.wait_ready(http_probe(f"http://127.0.0.1:{proxy_port}/health"), 30)
        urls = {"prefill": f"http://127.0.0.1:{pre_port}", "decode": f"http://127.0.0.1:{dec_port}",
                "proxy": f"http://127.0.0.1:{proxy_port}"}
        lat, rps = _run(_bench(args, urls, proxy.pid))
        _report(lat, rps, args)
    finally:
        for proc in reversed(procs):
            proc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
