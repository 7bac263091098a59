"""The proxy against misbehaving upstreams and hostile clients (issue 13, items 6, 8 and 9), on a real proxy
and real loopback sockets: no secret in any error body, status page or log line; bounded and timed reads;
deeply nested JSON is a 400; a 413 is recorded as 413."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import aiohttp
import pytest

from ._helpers import ADMIN_KEY, MODEL, proxy, run, stubs, wait_for

CLIENT_TOKEN = "client-tok-9f3c1d7e"
UPSTREAM_KEY = "sk-upstream-4b2a8c6d"
SECRETS = (CLIENT_TOKEN, UPSTREAM_KEY, ADMIN_KEY)


class RawUpstream:
    """A tiny asyncio HTTP server: proper answers to GETs (so it passes health checks), ``on_post(raw request)``
    bytes to POSTs (then it closes the connection)."""

    def __init__(self, on_post: Callable[[bytes], bytes]) -> None:
        self.on_post, self.port, self.posts = on_post, 0, 0
        self._server: asyncio.base_events.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                if head.startswith(b"GET"):
                    out = json.dumps({"data": [{"id": MODEL}]}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                                 % len(out) + out)
                    await writer.drain()
                    continue
                self.posts += 1
                writer.write(self.on_post(head + body))
                await writer.drain()
                break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def echo_garbage(request: bytes) -> bytes:
    return request  # not HTTP at all: the parser error quotes it, with the request headers


def echo_in_500(request: bytes) -> bytes:
    return b"HTTP/1.1 500 Oops\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(request) + request


def echo_in_400(request: bytes) -> bytes:
    body = json.dumps({"error": {"message": request.decode()}}).encode()
    return b"HTTP/1.1 400 Bad\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body


@pytest.mark.parametrize("answer", [echo_garbage, echo_in_500, echo_in_400])
@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_an_echoing_upstream_never_gets_a_secret_into_bodies_status_or_logs(
    caplog: pytest.LogCaptureFixture, answer: Callable[[bytes], bytes], side: str
) -> None:
    caplog.set_level(logging.DEBUG)
    seen: list[str] = []

    async def go() -> None:
        bad = RawUpstream(answer)
        await bad.start()
        try:
            async with stubs(1) as (good,):
                pre, dec = ([bad], [good]) if side == "prefill" else ([good], [bad])
                async with proxy(pre, dec, upstream_api_key=UPSTREAM_KEY, admin_api_key=ADMIN_KEY) as (s, url, c):
                    seen.append(repr(s.config))
                    for headers in ({"Authorization": f"Bearer {CLIENT_TOKEN}"}, {}):  # the 2nd: our upstream key
                        await wait_for(lambda: bool(s.pool.available(side)))
                        async with c.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                          headers=headers) as r:
                            assert r.status in (400, 502), await r.text()
                            seen.append(await r.text())
                        seen.append(await (await c.get(url + "/status")).text())
                        seen.append(await (await c.get(url + "/health")).text())
                        seen.append(await (await c.get(url + "/metrics")).text())
                    assert bad.posts == 2
        finally:
            await bad.stop()

    run(go)
    seen.append(caplog.text)
    everything = "\n".join(seen)
    assert "instance" in everything  # the errors still say what failed
    for secret in SECRETS:
        assert secret not in everything, f"{secret} leaked"


def test_config_repr_hides_keys() -> None:
    from mooncake_vllm.proxy.server import ProxyConfig

    text = repr(ProxyConfig(model=MODEL, admin_api_key=ADMIN_KEY, upstream_api_key=UPSTREAM_KEY))
    assert ADMIN_KEY not in text and UPSTREAM_KEY not in text


def test_deeply_nested_json_is_400_for_requests_and_admin_bodies() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000

    async def go() -> None:
        async with stubs(1) as ps, stubs(1) as ds, proxy(ps, ds, admin_api_key=ADMIN_KEY) as (s, url, c):
            hdrs = {"Content-Type": "application/json"}
            for body in (deep, b'{"prompt": ' + b"[" * 300 + b"]" * 300 + b"}"):
                async with c.post(url + "/v1/completions", data=body, headers=hdrs) as r:
                    assert r.status == 400
                    assert "deeper than 128 levels" in (await r.json())["error"]["message"]
            admin_deep = b"[" * 20_000 + b"]" * 20_000  # under the 64 KiB admin body limit
            async with c.post(url + "/instances/add", data=admin_deep, headers={**hdrs, "X-API-Key": ADMIN_KEY}) as r:
                assert r.status == 400 and "deeper than" in (await r.json())["error"]["message"]
            async with c.post(url + "/instances/add", data=deep, headers={**hdrs, "X-API-Key": ADMIN_KEY}) as r:
                assert r.status == 413 and "limit of 65536 bytes" in (await r.json())["error"]["message"]
            assert ps[0].received == [] and ds[0].received == []
            metrics = await (await c.get(url + "/metrics")).text()
            assert 'route="/v1/completions",status="400"} 2' in metrics

    run(go)


def test_oversized_body_is_413_with_the_fix_and_recorded_as_413() -> None:
    async def go() -> None:
        async with stubs(1) as ps, stubs(1) as ds, proxy(ps, ds) as (s, url, c):
            big = json.dumps({"prompt": "x" * (64 << 20)}).encode()  # just over the default 64 MiB
            async with c.post(url + "/v1/completions", data=big, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 413
                assert "--max-body-mb" in (await r.json())["error"]["message"]
            metrics = await (await c.get(url + "/metrics")).text()
            assert 'mooncake_proxy_requests_total{route="/v1/completions",status="413"} 1' in metrics
            assert 'status="500"' not in metrics

    run(go)


def test_half_sent_request_is_answered_408_and_closed_and_idle_connections_are_capped() -> None:
    async def go() -> None:
        async with stubs(1) as ps, stubs(1) as ds, proxy(ps, ds, header_timeout=1.0, max_connections=8) as (s, url, c):
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + CLIENT_TOKEN.encode())
            answer = await asyncio.wait_for(reader.read(), 5)  # EOF: the proxy closed it
            assert answer.startswith(b"HTTP/1.1 408") and CLIENT_TOKEN.encode() not in answer
            writer.close()
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]  # more than the cap
            async with aiohttp.ClientSession() as fresh:  # still served: the oldest idle ones made room
                async with fresh.get(url + "/health") as r:
                    assert r.status == 200
            await wait_for(lambda: s.guard.open_connections <= 8)
            for _r, w in idle:
                w.close()

    run(go)
