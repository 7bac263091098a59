"""The metadata server under hostile or unlucky clients (issue 13, items 8 and 9), on the real server process:
half-sent requests on raw sockets, a real 64-descriptor limit, the bearer token our own client sends,
the memory backend's total size cap, deeply nested JSON."""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mooncake_vllm.metadata.backends import HttpBackend, http_request
from tests.md_services import child_env, readline, stop

RAM = b'{"buffers":[],"name":"127.0.0.1:12345","protocol":"tcp"}'


class Proc:
    """``python -m mooncake_vllm.metadata.server`` with its own environment and descriptor limit."""

    def __init__(self, log: Path, env: dict[str, str] | None = None, nofile: int | None = None) -> None:
        def limit() -> None:
            if nofile:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mooncake_vllm.metadata.server", "--port", "0", "--backend", "memory"],
            stdout=subprocess.PIPE, stderr=open(log, "wb"), stdin=subprocess.DEVNULL, env=child_env(**(env or {})),
            start_new_session=True, preexec_fn=limit,
        )
        self.ready_line = readline(self.proc, 20.0)
        self.url = self.ready_line.split("ready at ", 1)[1].split(" ", 1)[0] if "ready at " in self.ready_line else ""
        self.port = int(self.url.split(":")[2].split("/")[0]) if self.url else 0

    def key_url(self, key: str) -> str:
        return f"{self.url}?key={key.replace('/', '%2F')}"


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    procs: list[Proc] = []

    def make(**kw) -> Proc:
        procs.append(Proc(tmp_path / f"server-{len(procs)}.log", **kw))
        assert procs[-1].url, f"server did not start: {procs[-1].ready_line!r}; {procs[-1].log.read_text()}"
        return procs[-1]

    yield make
    for p in procs:
        stop(p.proc)


def poll(pred: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)


def health_ok(port: int) -> bool:
    try:
        return http_request("GET", f"http://127.0.0.1:{port}/health", timeout=1.0)[0] == 200
    except Exception:  # noqa: BLE001 - refused/timed out: not yet
        return False


@contextlib.contextmanager
def raw_sockets(port: int, n: int) -> Iterator[list[socket.socket]]:
    socks = []
    try:
        for _ in range(n):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        yield socks
    finally:
        for s in socks:
            s.close()


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    out = b""
    while True:
        chunk = sock.recv(4096)  # socket.timeout if the server keeps it open
        if not chunk:
            return out
        out += chunk


def test_half_sent_request_gets_408_and_is_closed(launch) -> None:
    server = launch(env={"MC_METADATA_HEADER_TIMEOUT": "1"})
    with raw_sockets(server.port, 1) as (sock,):
        sock.sendall(b"PUT /metadata?key=mooncake%2Fram%2Fx HTTP/1.1\r\nHost: x\r\n")  # no blank line, ever
        t0 = time.monotonic()
        answer = read_until_closed(sock, timeout=10)
    assert time.monotonic() - t0 < 5
    assert answer.startswith(b"HTTP/1.1 408") and b"MC_METADATA_HEADER_TIMEOUT" in answer


def test_half_sent_body_gets_408(launch) -> None:
    server = launch(env={"MC_METADATA_BODY_TIMEOUT": "1"})
    with raw_sockets(server.port, 1) as (sock,):
        sock.sendall(b"PUT /metadata?key=mooncake%2Fram%2Fx HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"a\"")
        answer = read_until_closed(sock, timeout=10)
    assert answer.startswith(b"HTTP/1.1 408") and b"MC_METADATA_BODY_TIMEOUT" in answer
    assert http_request("GET", server.key_url("mooncake/ram/x"))[0] == 404  # nothing stored


def test_idle_and_half_sent_connections_cannot_starve_health_under_64_descriptors(launch) -> None:
    server = launch(env={"MC_METADATA_HEADER_TIMEOUT": "2"}, nofile=64)
    with raw_sockets(server.port, 70) as socks:
        for s in socks[::2]:
            s.sendall(b"GET /metadata?key=mooncake%2Fram%2Fx HTTP/1.1\r\n")  # half a request head
        # /health answers while the 70 connections are still open on our side
        poll(lambda: health_ok(server.port), 8.0, "/health answers with 70 idle/half-sent connections open")
        assert http_request("PUT", server.key_url("mooncake/ram/y"), RAM)[0] == 200
        assert http_request("GET", server.key_url("mooncake/ram/y")) == (200, RAM)
    assert server.log.read_text().count("Traceback") == 0, server.log.read_text()[:2000]


def test_token_is_enforced_when_configured_and_our_client_sends_it(launch, monkeypatch) -> None:
    token = "md-token-5b1f0e2a"
    server = launch(env={"MC_METADATA_HTTP_TOKEN": token})
    status, body = http_request("PUT", server.key_url("mooncake/ram/a"), RAM)
    assert status == 401 and b"MC_METADATA_HTTP_TOKEN" in body and token.encode() not in body
    status, body = http_request("GET", server.key_url("mooncake/ram/a"), headers={"Authorization": "Bearer nope"})
    assert status == 401 and b"wrong bearer token" in body
    assert health_ok(server.port)  # liveness needs no token
    monkeypatch.setenv("MC_METADATA_HTTP_TOKEN", token)
    client = HttpBackend(server.url)  # sends Authorization: Bearer $MC_METADATA_HTTP_TOKEN
    client.put("mooncake/ram/a", RAM)
    assert client.get("mooncake/ram/a") == RAM
    assert client.list() == ["mooncake/ram/a"]
    assert token not in repr(client) and token not in server.log.read_text()


def test_memory_backend_total_size_cap_507_and_body_cap_413(launch) -> None:
    server = launch(env={"MC_METADATA_MAX_TOTAL_BYTES": "1000", "MC_METADATA_MAX_BODY_BYTES": "600"})
    value = json.dumps({"pad": "x" * 550}).encode()  # 561 bytes: two are over 1000
    assert http_request("PUT", server.key_url("mooncake/ram/1"), value)[0] == 200
    status, body = http_request("PUT", server.key_url("mooncake/ram/2"), value)
    assert status == 507 and b"MC_METADATA_MAX_TOTAL_BYTES" in body and b"metadata gc" in body
    assert http_request("GET", server.key_url("mooncake/ram/2"))[0] == 404
    status, body = http_request("PUT", server.key_url("mooncake/ram/3"), json.dumps({"pad": "x" * 700}).encode())
    assert status == 413 and b"MC_METADATA_MAX_BODY_BYTES" in body
    assert http_request("DELETE", server.key_url("mooncake/ram/1"))[0] == 200
    assert http_request("PUT", server.key_url("mooncake/ram/2"), value)[0] == 200  # deleting made room


def test_deeply_nested_json_put_is_400_with_reason(launch) -> None:
    server = launch()
    for depth in (200, 100_000):
        status, body = http_request("PUT", server.key_url("mooncake/ram/deep"), b"[" * depth + b"]" * depth)
        assert status == 400 and b"deeper than 128 levels" in body, (depth, status, body[:200])
    assert http_request("GET", server.key_url("mooncake/ram/deep"))[0] == 404
    assert server.log.read_text().count("Traceback") == 0, server.log.read_text()[:2000]


def test_bad_limit_in_the_environment_is_one_clear_error(tmp_path: Path) -> None:
    proc = Proc(tmp_path / "bad.log", env={"MC_METADATA_MAX_TOTAL_BYTES": "lots"})
    assert proc.proc.wait(20) == 2
    err = (tmp_path / "bad.log").read_text()
    assert "MC_METADATA_MAX_TOTAL_BYTES" in err and "positive integer" in err
