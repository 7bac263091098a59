"""``mooncake-vllm proxy`` as a real process (seed-compatible flags) over real stub upstreams."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from mooncake_vllm.services import ManagedProcess, free_port, http_probe

from ._helpers import ADMIN_KEY, MODEL, run, sse_events, stubs

CLI = [sys.executable, "-c", "import sys; from mooncake_vllm.cli import main; sys.exit(main())"]


def test_cli_serves_streams_and_admin(tmp_path: Path) -> None:
    async def go() -> None:
        async with stubs(1) as (p,), stubs(2) as (d1, d2):
            port = free_port()
            argv = [*CLI, "proxy", "--model", f"org/{MODEL}", "-p", p.address, "-d", d1.address,
                    "--port", str(port), "--scheduling", "least_loaded", "--health-interval", "0.5"]
            env = {**os.environ, "ADMIN_API_KEY": ADMIN_KEY}
            proc = ManagedProcess("proxy", argv, workdir=tmp_path, env=env, port=port).start()
            try:
                await asyncio.to_thread(proc.wait_ready, http_probe(f"http://127.0.0.1:{port}/health"), 30)
                url = f"http://127.0.0.1:{port}"
                async with aiohttp.ClientSession() as c:
                    async with c.post(url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
                        assert r.status == 200 and sse_events(await r.read())[-1] == "[DONE]"
                    async with c.post(url + "/instances/add", headers={"X-API-Key": ADMIN_KEY},
                                      json={"type": "decode", "instance": d2.address}) as r:
                        assert r.status == 200, await r.text()
                    status = await (await c.get(url + "/status")).json()
                    assert status["decode_nodes"] == [d1.address, d2.address]
                    assert status["scheduling"] == "least_loaded" and status["admin_api"] == "enabled"
            finally:
                proc.stop()
            assert ADMIN_KEY not in proc.log_path.read_text()

    run(go, timeout=60)


def test_cli_rejects_a_bad_address_naming_the_flag() -> None:
    out = subprocess.run([*CLI, "proxy", "--model", MODEL, "-p", "::1:8100", "-d", "127.0.0.1:8200"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--prefill" in out.stderr and "must be written in brackets" in out.stderr


def test_sigterm_lets_streams_in_flight_finish(tmp_path: Path) -> None:
    async def go() -> None:
        async with stubs(1) as (p,), stubs(1, tokens=10, delay=0.1) as (d,):
            port = free_port()
            argv = [*CLI, "proxy", "--model", MODEL, "-p", p.address, "-d", d.address, "--port", str(port)]
            proc = ManagedProcess("proxy", argv, workdir=tmp_path, port=port).start()
            try:
                await asyncio.to_thread(proc.wait_ready, http_probe(f"http://127.0.0.1:{port}/health"), 30)
                async with aiohttp.ClientSession() as c:
                    async with c.post(f"http://127.0.0.1:{port}/v1/completions",
                                      json={"prompt": "x", "stream": True}) as r:
                        first = await r.content.readline()
                        os.kill(proc.pid, signal.SIGTERM)  # mid-stream, by PID
                        rest = await r.read()
                    events = sse_events(first + rest)
                    assert len(events) == 11 and events[-1] == "[DONE]"
                    for _ in range(200):
                        if proc.returncode is not None:
                            break
                        await asyncio.sleep(0.1)
                    assert proc.returncode == 0
                    with pytest.raises(aiohttp.ClientConnectionError):  # no longer listening
                        await c.get(f"http://127.0.0.1:{port}/health")
            finally:
                proc.stop()

    run(go, timeout=60)


def test_vllm_p2p_proxy_prefill_form_is_accepted() -> None:
    from mooncake_vllm.cli.proxy import join_bootstrap_ports

    items = ["http://10.0.0.2:8100", "9000", "http://10.0.0.3:8100", "none", "[::1]:8100", "h:1@5", "7"]
    assert join_bootstrap_ports(items) == ["http://10.0.0.2:8100@9000", "http://10.0.0.3:8100", "[::1]:8100",
                                           "h:1@5", "7"]


def test_kv_aware_without_its_packages_routes_round_robin_said_once_and_counted(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from mooncake_vllm.proxy import kv_fallback
    from mooncake_vllm.proxy.scheduling import KvAwarePolicy, RoundRobinPolicy

    from ._helpers import proxy

    monkeypatch.setattr(kv_fallback, "missing_modules", lambda: ["msgspec"])

    async def scenario() -> None:
        async with stubs(2) as ups, proxy([], ups, flow="kv_both", scheduling="kv_aware", kv_queue_cap=4,
                                          health_interval=60) as (server, url, client):
            assert server.kv is None and server.config.scheduling == "round_robin"
            assert all(isinstance(p, RoundRobinPolicy) for p in server.policies.values())
            for _ in range(4):
                async with client.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}) as r:
                    assert r.status == 200
            assert sorted(len(u.received) for u in ups) == [2, 2]
            async with client.get(url + "/metrics") as r:
                text = await r.text()
            assert ('mooncake_proxy_scheduling_fallback_total{wanted="kv_aware",using="round_robin",'
                    'reason="missing_msgspec"} 4') in text

    with caplog.at_level("WARNING", logger="mooncake_vllm.proxy.kv_fallback"):
        run(scenario)
    warned = [r.getMessage() for r in caplog.records if r.name == "mooncake_vllm.proxy.kv_fallback"]
    assert len(warned) == 1 and "pip install msgspec" in warned[0]
    monkeypatch.setattr(kv_fallback, "missing_modules", lambda: [])
    from mooncake_vllm.proxy.server import ProxyConfig, ProxyServer

    full = ProxyServer(ProxyConfig(model=MODEL, decode=["127.0.0.1:8200"], scheduling="kv_aware"))
    assert full.fallback is None and isinstance(full.policies["decode"], KvAwarePolicy)


def test_kv_aware_with_a_tokenizer_but_no_transformers_routes_round_robin(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib.util

    from mooncake_vllm.proxy import kv_fallback
    from mooncake_vllm.proxy import server as server_mod

    real = importlib.util.find_spec
    monkeypatch.setattr(kv_fallback, "missing_modules", lambda: [])
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    s = server_mod.ProxyServer(server_mod.ProxyConfig(model=MODEL, decode=["127.0.0.1:8200"], scheduling="kv_aware",
                                                      tokenizer=str(tmp_path)))
    assert s.fallback is not None and s.fallback.reason == "missing_transformers"
    assert s.tokenizer is None and s.kv is None and s.config.tokenizer is None


def test_a_bad_kv_queue_cap_stops_the_cli_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from mooncake_vllm.cli.proxy import configure
    from mooncake_vllm.cli.proxy import run as run_cli

    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(["--model", MODEL, "-d", "127.0.0.1:8200", "--scheduling", "kv_aware",
                              "--kv-queue-cap", "-2"])
    assert run_cli(args) == 2
    assert "--kv-queue-cap" in capsys.readouterr().err
