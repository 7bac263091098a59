"""Our HTTP metadata server: Mooncake's protocol exactly, bad input, load, signals, and real Mooncake clients."""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from typing import Any

import aiohttp
import pytest

from mooncake_vllm.metadata.backends import backend_for, http_request
from tests.md_services import Server

RPC = b'{"ip_or_host_name":"127.0.0.1","rpc_port":15228}'
RAM = b'{"buffers":[{"addr":1,"length":2,"name":"127.0.0.1:12345"}],"name":"127.0.0.1:12345","protocol":"tcp"}'


def req(server: Any, method: str, key: str | None, body: bytes | None = None, raw_query: str | None = None):
    query = raw_query if raw_query is not None else ("" if key is None else "key=" + urllib.parse.quote(key, safe=""))
    return http_request(method, f"{server.url}?{query}" if query else server.url, body,
                        headers={"Content-Type": "application/json"})


def test_ready_line_port_0_health_and_loopback_default(tmp_path) -> None:
    server = Server("memory", tmp_path / "server.log")  # python -m ... --port 0, no --host
    assert server.url.startswith("http://127.0.0.1:")
    assert server.ready_line.startswith("mooncake-vllm metadata server ready at http://127.0.0.1:")
    assert server.ready_line.endswith("(backend memory)")
    status, body = http_request("GET", server.url.replace("/metadata", "/health"))
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert server.stop() == 0


@pytest.mark.parametrize("backend_name", ["memory", "redis", "etcd"])
def test_protocol_exactly(md_server, request: pytest.FixtureRequest, backend_name: str, unique: str) -> None:
    backend = {"memory": lambda: "memory", "redis": lambda: request.getfixturevalue("md_redis_url") + "/4",
               "etcd": lambda: request.getfixturevalue("md_etcd_url")}[backend_name]()
    server = md_server(backend)
    ram, rpc = f"mooncake/{unique}/ram/127.0.0.1:12345", f"mooncake/{unique}/rpc_meta/127.0.0.1:12345"
    assert req(server, "GET", ram)[0] == 404
    assert req(server, "PUT", ram, RAM)[0] == 200
    status, body = req(server, "GET", ram)
    assert (status, body) == (200, RAM)  # byte for byte
    status, body, ctype = _get_with_type(server, ram)
    assert ctype.startswith("application/json")
    assert req(server, "PUT", rpc, RPC)[0] == 200
    assert req(server, "PUT", rpc, RPC)[0] == 200  # identical rpc_meta re-publish
    assert req(server, "PUT", rpc, b'{"rpc_port":15228,"ip_or_host_name":"127.0.0.1"}')[0] == 200  # same JSON
    status, body = req(server, "PUT", rpc, b'{"ip_or_host_name":"127.0.0.1","rpc_port":9}')
    assert status == 400 and b"conflicting rpc_meta" in body
    assert req(server, "GET", rpc)[1] == RPC  # the conflict changed nothing
    assert req(server, "PUT", ram, b'{"v":2}')[0] == 200  # ram entries may change
    assert req(server, "DELETE", ram)[0] == 200
    assert req(server, "DELETE", ram)[0] == 200  # missing key
    assert req(server, "GET", ram)[0] == 404
    assert req(server, "POST", ram, RAM)[0] == 405
    # the listing extension, via the HttpBackend
    assert backend_for(server.url).list(f"mooncake/{unique}/") == [rpc]
    req(server, "DELETE", rpc)


def _get_with_type(server: Any, key: str) -> tuple[int, bytes, str]:
    import http.client

    parts = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
    conn.request("GET", f"{parts.path}?key={urllib.parse.quote(key, safe='')}")
    resp = conn.getresponse()
    out = resp.status, resp.read(), resp.getheader("Content-Type", "")
    conn.close()
    return out


@pytest.mark.parametrize(
    ("method", "query", "body", "reason"),
    [
        ("PUT", "key=", RAM, b"empty key"),
        ("PUT", None, RAM, b"missing query parameter 'key'"),
        ("PUT", "key=" + urllib.parse.quote("other/ram/x", safe=""), RAM, b"is not under 'mooncake/'"),
        ("PUT", "key=mooncake%2F", RAM, b"is not under 'mooncake/'"),
        ("PUT", "key=mooncake%2F" + "a" * 1100, RAM, b"the limit is 1024"),
        ("PUT", "key=mooncake%2Fram%2F%01x", RAM, b"control characters"),
        ("PUT", "key=mooncake%2Fram%2Fgood", b"{not json", b"not JSON"),
        ("PUT", "key=mooncake%2Fram%2Fgood", b"", b"empty"),
        ("GET", "key=", None, b"empty key"),
        ("DELETE", "key=elsewhere", None, b"is not under 'mooncake/'"),
    ],
)
def test_malformed_requests_get_400_with_reason_and_change_nothing(
    md_server, method: str, query: str | None, body: bytes | None, reason: bytes
) -> None:
    server = md_server("memory")
    good = "mooncake/ram/good"
    assert req(server, "PUT", good, RAM)[0] == 200
    status, text = req(server, method, None, body, raw_query=query or "")
    assert status == 400, text
    assert reason in text
    assert req(server, "GET", good) == (200, RAM)
    assert backend_for(server.url).list() == [good]


@pytest.mark.parametrize("backend_name", ["memory", "redis"])
def test_1000_concurrent_put_get_lose_nothing(md_server, request: pytest.FixtureRequest, backend_name: str) -> None:
    """1000 simultaneous connections PUT, then 1000 GET; redis exercises the server's thread pool."""
    backend = "memory"
    if backend_name == "redis":
        backend = request.getfixturevalue("md_redis_url") + "/13"  # a database of its own, emptied first
        store = backend_for(backend)
        for key in store.list():
            store.delete(key)
    server = md_server(backend)

    async def run() -> tuple[list[int], list[bytes]]:
        conn = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=conn) as session:
            async def put(i: int) -> int:
                async with session.put(server.url, params={"key": f"mooncake/ram/10.0.{i // 256}.{i % 256}:1"},
                                       data=json.dumps({"i": i}).encode()) as r:
                    return r.status

            async def get(i: int) -> bytes:
                async with session.get(server.url, params={"key": f"mooncake/ram/10.0.{i // 256}.{i % 256}:1"}) as r:
                    return await r.read() if r.status == 200 else b""

            puts = await asyncio.gather(*(put(i) for i in range(1000)))
            gets = await asyncio.gather(*(get(i) for i in range(1000)))
            return puts, gets

    puts, gets = asyncio.run(run())
    assert puts == [200] * 1000
    assert [json.loads(g)["i"] if g else None for g in gets] == list(range(1000))
    assert len(backend_for(server.url).list("mooncake/ram/")) == 1000


def test_sigterm_stops_cleanly_and_redis_keeps_data(md_server, md_redis_url: str, unique: str) -> None:
    key = f"mooncake/{unique}/ram/1.1.1.1:1"
    server = md_server(md_redis_url + "/4")
    assert req(server, "PUT", key, RAM)[0] == 200
    assert server.stop() == 0  # SIGTERM
    again = md_server(md_redis_url + "/4")
    assert req(again, "GET", key) == (200, RAM)  # it was in redis, not in the process
    req(again, "DELETE", key)


def test_bad_backend_fails_fast_with_reason(tmp_path) -> None:
    from tests.md_services import free_port

    with pytest.raises(RuntimeError, match="did not start"):
        Server(f"redis://127.0.0.1:{free_port()}", tmp_path / "bad.log")
    assert "not usable" in (tmp_path / "bad.log").read_text()


@pytest.mark.parametrize("backend_name", ["memory", "redis", "etcd"])
def test_two_real_mooncake_clients_share_metadata_through_our_server(
    md_server, md_clients, md_master: str, request: pytest.FixtureRequest, backend_name: str, unique: str
) -> None:
    """Process A mounts a segment and puts; process B (no segment) reads A's bytes back over TCP."""
    backend = {"memory": lambda: "memory", "redis": lambda: request.getfixturevalue("md_redis_url") + "/6",
               "etcd": lambda: request.getfixturevalue("md_etcd_url")}[backend_name]()
    server = md_server(backend)
    writer = md_clients(server.url, md_master, segment_mb=32)
    reader = md_clients(server.url, md_master, segment_mb=0)
    assert writer.call("put", unique, 20) == 20
    assert reader.call("get", unique, 20) == 20
    assert reader.call("get", unique + "-absent", 3) == 0  # a test that can fail
    # both clients published their segment through our server, into the chosen backend
    store = backend_for(backend) if backend_name != "memory" else backend_for(server.url)
    keys = store.list("mooncake/")
    for client in (writer, reader):
        assert f"mooncake/ram/{client.hostname}" in keys
        assert f"mooncake/rpc_meta/{client.hostname}" in keys
    reader.quit()
    writer.quit()
    remaining = store.list("mooncake/")  # a clean close removes the client's own entries
    assert f"mooncake/ram/{writer.hostname}" not in remaining
