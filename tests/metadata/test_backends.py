"""Every metadata backend against the real thing: redis-server, etcd 3.4, our HTTP server."""

from __future__ import annotations

import json

import pytest

from mooncake_vllm.errors import ConfigError, StoreError, StoreUnavailableError
from mooncake_vllm.metadata.backends import (
    HttpBackend,
    MemoryBackend,
    MetadataBackend,
    RedisBackend,
    backend_for,
    redact_url,
)
from mooncake_vllm.metadata.etcd import EtcdBackend
from mooncake_vllm.services import start_http_metadata
from tests.md_services import free_port


@pytest.fixture(params=["memory", "redis", "etcd", "http"])
def backend(request: pytest.FixtureRequest, unique: str) -> MetadataBackend:
    kind = request.param
    if kind == "memory":
        b: MetadataBackend = MemoryBackend()
    elif kind == "redis":
        b = backend_for(request.getfixturevalue("md_redis_url") + "/3")
    elif kind == "etcd":
        b = backend_for(request.getfixturevalue("md_etcd_url"))
    else:
        b = backend_for(request.getfixturevalue("md_server")("memory").url)
    yield b
    for key in b.list(f"mooncake/{unique}/"):
        b.delete(key)
    b.close()


def test_roundtrip_list_delete(backend: MetadataBackend, unique: str) -> None:
    root = f"mooncake/{unique}/"
    ram = f"{root}ram/127.0.0.1:12345"
    rpc = f"{root}rpc_meta/127.0.0.1:12345"
    body = json.dumps({"name": "127.0.0.1:12345", "buffers": [{"addr": 1, "length": 2}]}, separators=(",", ":"))
    assert backend.get(ram) is None
    backend.put(ram, body.encode())
    backend.put(rpc, b'{"ip_or_host_name":"127.0.0.1","rpc_port":1}')
    assert backend.get(ram) == body.encode()  # verbatim
    assert backend.list(root) == [ram, rpc]
    assert backend.list(f"{root}rpc_meta/") == [rpc]
    backend.put(ram, b'{"v":2}')  # overwrite
    assert backend.get(ram) == b'{"v":2}'
    backend.delete(ram)
    backend.delete(ram)  # missing key: fine
    assert backend.get(ram) is None
    assert backend.list(root) == [rpc]


def test_binary_and_odd_keys(backend: MetadataBackend, unique: str) -> None:
    """Keys with URL/glob specials survive, and a prefix with glob characters matches literally."""
    key = f"mooncake/{unique}/ram/[fe80::1]:80?x=&y*"
    backend.put(key, "{\"ü\": \"\\u0000\"}".encode())
    assert backend.get(key) == "{\"ü\": \"\\u0000\"}".encode()
    assert backend.list(f"mooncake/{unique}/ram/[fe80") == [key]
    assert backend.list(f"mooncake/{unique}/ram/*") == []


def test_factory_parsing(md_redis_url: str, md_etcd_url: str) -> None:
    port = md_etcd_url.rsplit(":", 1)[1]
    assert isinstance(backend_for(md_etcd_url), EtcdBackend)
    bare = backend_for(f"127.0.0.1:{port}")  # no scheme = etcd, as Mooncake does
    assert isinstance(bare, EtcdBackend) and bare.endpoints == [f"http://127.0.0.1:{port}"]
    multi = backend_for(f"etcd://127.0.0.1:{free_port()},127.0.0.1:{port}")
    assert multi.get("mooncake/none") is None  # the dead first endpoint is skipped
    assert isinstance(backend_for(md_redis_url + "/2"), RedisBackend)
    assert isinstance(backend_for("http://127.0.0.1:1/metadata"), HttpBackend)
    assert isinstance(backend_for("memory"), MemoryBackend)
    assert redact_url("redis://u:secret@h:1/0") == "redis://***@h:1/0"


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("P2PHANDSHAKE", ["P2PHANDSHAKE needs no metadata server"]),
        ("", ["empty metadata server"]),
        ("zk://h:1", ["unknown metadata scheme 'zk://'"]),
        ("etcd://host-without-port", ["'host-without-port' is not host:port"]),
        ("redis://h:1/abc", ["database 'abc' is not a number"]),
        ("http:///metadata", ["no host"]),
    ],
)
def test_factory_errors_name_field_and_fix(url: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        backend_for(url)
    text = str(info.value)
    assert "metadata_server" in text and "fix:" in text
    for w in words:
        assert w in text


def test_unreachable_backends_raise_connection_errors() -> None:
    port = free_port()
    for url in (f"redis://127.0.0.1:{port}", f"etcd://127.0.0.1:{port}", f"http://127.0.0.1:{port}/metadata"):
        with pytest.raises(StoreUnavailableError, match=f"127.0.0.1:{port}"):
            backend_for(url, timeout=1.0).get("mooncake/ram/x")
        assert issubclass(StoreUnavailableError, ConnectionError)


def test_redis_credentials_from_env(md_redis_url: str) -> None:
    """MC_REDIS_DB_INDEX selects the database, like Mooncake's redis plugin."""
    b5 = RedisBackend(md_redis_url, env={"MC_REDIS_DB_INDEX": "5"})
    b0 = RedisBackend(md_redis_url, env={})
    b5.put("mooncake/envdb", b"{}")
    try:
        assert b0.get("mooncake/envdb") is None
        assert RedisBackend(md_redis_url + "/5").get("mooncake/envdb") == b"{}"
    finally:
        b5.delete("mooncake/envdb")


def test_http_list_against_mooncakes_own_server_says_why(tmp_path) -> None:
    """Mooncake's bundled server has no listing: the error says what to use instead."""
    proc = start_http_metadata(tmp_path, "mooncake")
    try:
        b = HttpBackend(str(proc.url))
        b.put("mooncake/ram/1.2.3.4:5", b'{"a":1}')
        assert b.get("mooncake/ram/1.2.3.4:5") == b'{"a":1}'
        with pytest.raises(StoreError, match="mooncake-vllm metadata serve"):
            b.list()
        b.delete("mooncake/ram/1.2.3.4:5")
        b.delete("mooncake/ram/1.2.3.4:5")  # its 404 on a missing key is tolerated
    finally:
        proc.stop()


def test_a_runaway_http_answer_is_bounded(monkeypatch) -> None:  # noqa: ANN001
    """A real HTTP listener that answers 8 MiB: with a 1 MiB cap the client stops reading and says so."""
    import http.server
    import threading

    from mooncake_vllm.metadata import backends, base

    class Flood(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(8 << 20))
            self.end_headers()
            try:
                for _ in range(8):
                    self.wfile.write(b"{" * (1 << 20))
            except OSError:
                pass  # the client stopped reading

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Flood)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(base, "MAX_RESPONSE_BYTES", 1 << 20)
    try:
        with pytest.raises(StoreError, match="more than 1 MiB"):
            backends.HttpBackend(f"http://127.0.0.1:{server.server_port}/metadata").get("mooncake/ram/x")
    finally:
        server.shutdown()
        server.server_close()
