"""Real services for the metadata tests: redis, etcd, mooncake_master, our server, Mooncake clients.

Services come from the shared launchers in :mod:`mooncake_vllm.services` (free
127.0.0.1 ports, own process group, stopped by PID, logs attached to failing
tests by tests/conftest.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from md_services import Client

from mooncake_vllm.services import (
    SETUP_HINT,
    ManagedProcess,
    ServiceError,
    start_etcd,
    start_http_metadata,
    start_master,
    start_redis,
)


@pytest.fixture(scope="session")
def md_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("metadata-services")


def _started(start: Callable[[], ManagedProcess]) -> ManagedProcess:
    try:
        return start()
    except ServiceError as exc:
        pytest.fail(f"{exc}\n(if a binary is missing, run `{SETUP_HINT}`)", pytrace=False)


# Session-scoped on purpose: these tests use distinct keys, and one etcd/redis/master
# for the whole module set saves ~3 s of start/stop per test on 2 shared cores.
@pytest.fixture(scope="session")
def md_redis_url(md_workdir: Path) -> Iterator[str]:
    """A real redis-server; ``redis://127.0.0.1:P``."""
    proc = _started(lambda: start_redis(md_workdir))
    yield str(proc.url)
    proc.stop()


@pytest.fixture(scope="session")
def md_etcd_url(md_workdir: Path) -> Iterator[str]:
    """A real etcd 3.4; ``etcd://127.0.0.1:P``."""
    proc = _started(lambda: start_etcd(md_workdir))
    yield f"etcd://{proc.address}"
    proc.stop()


@pytest.fixture(scope="session")
def md_master(md_workdir: Path) -> Iterator[str]:
    """A real mooncake_master (client_ttl 2 s); its ``master_server_address``."""
    proc = _started(lambda: start_master(md_workdir, client_ttl=2))
    yield str(proc.address)
    proc.stop()


@pytest.fixture
def md_server(tmp_path: Path) -> Iterator:
    """Factory: ``md_server(backend)`` starts our server (``.url``); all are stopped after the test."""
    servers: list[ManagedProcess] = []

    def make(backend: str = "memory") -> ManagedProcess:
        servers.append(_started(lambda: start_http_metadata(tmp_path, "embedded", backend)))
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
