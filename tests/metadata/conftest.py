"""Real services for the metadata tests: redis, etcd, mooncake_master, our server, Mooncake clients.

Every process runs on a free 127.0.0.1 port in its own session and is stopped
by its process-group id (never by name).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from md_services import BIN, Client, Server, free_port, start, stop, wait_port


@pytest.fixture(scope="session")
def md_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("metadata-services")


@pytest.fixture(scope="session")
def md_redis_url(md_workdir: Path) -> Iterator[str]:
    port = free_port()
    proc = start(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                  "--dir", str(md_workdir)], md_workdir / "redis.log")
    wait_port(port, proc, "redis-server")
    yield f"redis://127.0.0.1:{port}"
    stop(proc)


@pytest.fixture(scope="session")
def md_etcd_url(md_workdir: Path) -> Iterator[str]:
    port, peer = free_port(), free_port()
    proc = start(["etcd", "--name", "mdtest", "--data-dir", str(md_workdir / "etcd"),
                  "--listen-client-urls", f"http://127.0.0.1:{port}",
                  "--advertise-client-urls", f"http://127.0.0.1:{port}",
                  "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                  "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                  "--initial-cluster", f"mdtest=http://127.0.0.1:{peer}"], md_workdir / "etcd.log")
    wait_port(port, proc, "etcd")
    yield f"etcd://127.0.0.1:{port}"
    stop(proc)


@pytest.fixture(scope="session")
def md_master(md_workdir: Path) -> Iterator[str]:
    port = free_port()
    proc = start([str(BIN / "mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={port}",
                  "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}", "--client_ttl=2"],
                 md_workdir / "master.log")
    wait_port(port, proc, "mooncake_master")
    yield f"127.0.0.1:{port}"
    stop(proc)


@pytest.fixture
def md_server(tmp_path: Path) -> Iterator:
    """Factory: ``md_server(backend)`` starts our server; all are stopped after the test."""
    servers: list[Server] = []

    def make(backend: str = "memory") -> Server:
        servers.append(Server(backend, tmp_path / f"server-{len(servers)}.log"))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


@pytest.fixture
def md_clients(tmp_path: Path) -> Iterator:
    """Factory: ``md_clients(metadata, master, segment_mb=...)``; all quit after the test."""
    clients: list[Client] = []

    def make(metadata: str, master: str, **kw) -> Client:
        clients.append(Client(metadata, master, tmp_path / f"client-{len(clients)}.log", **kw))
        return clients[-1]

    yield make
    for c in clients:
        c.quit()


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:12]
