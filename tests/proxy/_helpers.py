"""Helpers for the proxy tests: real aiohttp stub upstreams and a real proxy on loopback ports."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp

from mooncake_vllm.proxy.server import ProxyConfig, ProxyServer
from mooncake_vllm.proxy.stub import StubUpstream

MODEL = "tiny-llama"
ADMIN_KEY = "s3cret-admin-key"


def run(fn: Callable[[], Awaitable[Any]], timeout: float = 30.0) -> Any:
    """Run one async scenario to completion (no pytest-asyncio needed)."""
    return asyncio.run(asyncio.wait_for(fn(), timeout))


@contextlib.asynccontextmanager
async def stubs(n: int, **kwargs: Any) -> AsyncIterator[list[StubUpstream]]:
    """``n`` started stub upstreams, stopped afterwards."""
    ups = [StubUpstream(**kwargs) for _ in range(n)]
    try:
        for u in ups:
            await u.start()
        yield ups
    finally:
        for u in ups:
            await u.stop()


@contextlib.asynccontextmanager
async def proxy(prefill: list[StubUpstream] | list[str], decode: list[StubUpstream] | list[str],
                **cfg: Any) -> AsyncIterator[tuple[ProxyServer, str, aiohttp.ClientSession]]:
    """A started proxy over the given upstreams; yields (server, base url, client session)."""
    def addr(x: StubUpstream | str) -> str:
        return x if isinstance(x, str) else x.address

    cfg.setdefault("model", MODEL)
    cfg.setdefault("health_interval", 0.2)
    cfg.setdefault("health_timeout", 1.0)
    cfg.setdefault("connect_timeout", 2.0)
    server = ProxyServer(ProxyConfig(prefill=[addr(p) for p in prefill], decode=[addr(d) for d in decode],
                                     port=0, **cfg))
    port = await server.start()
    try:
        async with aiohttp.ClientSession() as client:
            yield server, f"http://127.0.0.1:{port}", client
    finally:
        await server.stop()


async def wait_for(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``pred`` until true; AssertionError on timeout."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def sse_events(raw: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
