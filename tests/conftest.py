"""Shared pytest fixtures: REAL services on free 127.0.0.1 ports, stopped by PID.

Fixtures never skip: a missing binary fails with the setup command to run.
The logs of every process a failing test used are attached to its report, and
nothing is left running after the session (also on failure or Ctrl-C).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn, TypeVar

import pytest

from mooncake_vllm.services import (
    SETUP_HINT,
    LocalStack,
    ManagedProcess,
    ServiceError,
    running,
    start_etcd,
    start_holder,
    start_http_metadata,
    start_master,
    start_redis,
    started,
    stop_all,
)
from mooncake_vllm.stats import STRICT_ENV

T = TypeVar("T")

#: counting an undeclared counter name raises, in every test and every engine a test starts
os.environ.setdefault(STRICT_ENV, "1")

#: client_ttl of the test masters: dead clients are noticed within ~5 s, and a holder starved
#: of CPU for a few seconds on a loaded 2-core box is not declared dead (with 2 s it was:
#: its whole segment was unmounted mid-test)
TEST_CLIENT_TTL = 5
#: Pool sizes used by the fixtures (memory is touched lazily; keep them modest).
TEST_SEGMENT = 256 << 20
TEST_LOCAL_BUFFER = 64 << 20
#: holders of the stack fixtures: every test's pool is spread over several processes
TEST_HOLDERS = 2


def _fail_setup(exc: BaseException) -> NoReturn:
    pytest.fail(f"{exc}\n(if a binary or package is missing, run `{SETUP_HINT}`)", pytrace=False)


def _start(launch: Callable[[], T]) -> T:
    """Run a launcher; a service that does not come up fails the test (never skips it)."""
    try:
        return launch()
    except ServiceError as exc:
        _fail_setup(exc)


# -- work directories ---------------------------------------------------------------
@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A per-test directory for service logs, data and configs."""
    d = tmp_path / "work"
    d.mkdir()
    return d


# -- Mooncake ---------------------------------------------------------------------------
@pytest.fixture
def mooncake_master(workdir: Path) -> Iterator[ManagedProcess]:
    """A real mooncake_master (short client_ttl); ``.address`` is its master_server_address."""
    proc = _start(lambda: start_master(workdir, client_ttl=TEST_CLIENT_TTL))
    yield proc
    proc.stop()


@pytest.fixture
def metadata_server(workdir: Path) -> Iterator[ManagedProcess]:
    """Mooncake's own HTTP metadata server (the wheel's mooncake_http_metadata_server)."""
    proc = _start(lambda: start_http_metadata(workdir, "mooncake"))
    yield proc
    proc.stop()


@pytest.fixture
def metadata_url(metadata_server: ManagedProcess) -> str:
    """``http://127.0.0.1:P/metadata`` of a running Mooncake HTTP metadata server."""
    assert metadata_server.url is not None
    return metadata_server.url


@pytest.fixture
def pool_holder(workdir: Path, mooncake_master: ManagedProcess, metadata_url: str) -> Iterator[ManagedProcess]:
    """A mooncake_client process holding TEST_SEGMENT bytes of pool memory for pure clients."""
    master = str(mooncake_master.address)
    proc = _start(lambda: start_holder(workdir, master, metadata_url, TEST_SEGMENT, TEST_LOCAL_BUFFER))
    yield proc
    proc.stop()


def _stack(workdir: Path) -> Iterator[LocalStack]:
    stack = _start(LocalStack(workdir, segment_size=TEST_SEGMENT, local_buffer_size=TEST_LOCAL_BUFFER,
                              client_ttl=TEST_CLIENT_TTL, holders=TEST_HOLDERS).start)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def local_stack(workdir: Path) -> Iterator[LocalStack]:
    """master + Mooncake HTTP metadata + TEST_HOLDERS holders, with ``.config_path`` (V1
    mooncake_config.json)."""
    yield from _stack(workdir)


@pytest.fixture(scope="module")
def module_local_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """Like ``local_stack`` but shared by a test module (faster; tests must use distinct keys)."""
    yield from _stack(tmp_path_factory.mktemp("module-stack"))


# -- etcd / redis ---------------------------------------------------------------------
@pytest.fixture
def etcd_server(workdir: Path) -> Iterator[str]:
    """A real single-member etcd; returns its client endpoint ``127.0.0.1:P``."""
    proc = _start(lambda: start_etcd(workdir))
    yield str(proc.address)
    proc.stop()


@pytest.fixture
def redis_server(workdir: Path) -> Iterator[str]:
    """A real redis-server without persistence; returns ``redis://127.0.0.1:P``."""
    proc = _start(lambda: start_redis(workdir))
    yield str(proc.url)
    proc.stop()


# -- metadata services and Mooncake client processes (tests/metadata, tests/store/test_bridge.py)
# Session-scoped on purpose: these tests use distinct keys, and one etcd/redis/master
# for the whole module set saves ~3 s of start/stop per test on 2 shared cores.
@pytest.fixture(scope="session")
def md_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("metadata-services")


@pytest.fixture(scope="session")
def md_redis_url(md_workdir: Path) -> Iterator[str]:
    """A real redis-server; ``redis://127.0.0.1:P``."""
    proc = _start(lambda: start_redis(md_workdir))
    yield str(proc.url)
    proc.stop()


@pytest.fixture(scope="session")
def md_etcd_url(md_workdir: Path) -> Iterator[str]:
    """A real etcd 3.4; ``etcd://127.0.0.1:P``."""
    proc = _start(lambda: start_etcd(md_workdir))
    yield f"etcd://{proc.address}"
    proc.stop()


@pytest.fixture(scope="session")
def md_master(md_workdir: Path) -> Iterator[str]:
    """A real mooncake_master (client_ttl 2 s); its ``master_server_address``."""
    proc = _start(lambda: start_master(md_workdir, client_ttl=TEST_CLIENT_TTL))
    yield str(proc.address)
    proc.stop()


@pytest.fixture
def md_server(tmp_path: Path) -> Iterator:
    """Factory: ``md_server(backend)`` starts our server (``.url``); all are stopped after the test."""
    servers: list[ManagedProcess] = []

    def make(backend: str = "memory") -> ManagedProcess:
        servers.append(_start(lambda: start_http_metadata(tmp_path, "embedded", backend)))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


@pytest.fixture
def md_clients(tmp_path: Path) -> Iterator:
    """Factory: ``md_clients(metadata, master, segment_mb=...)``; all quit after the test."""
    # imported here: tests/test_services.py runs a copy of this file outside the repository
    from tests.md_services import Client

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


# -- the tiny model -------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The offline tiny Llama + tokenizer, built once per parameter set and cached between runs."""
    try:
        from mooncake_vllm.demo.tiny_model import cached_tiny_model

        return cached_tiny_model()
    except ImportError as exc:  # transformers / tokenizers / torch missing
        _fail_setup(exc)


# -- logs on failure, cleanup ----------------------------------------------------------
_LOG_LINES = int(os.environ.get("MOONCAKE_VLLM_TEST_LOG_LINES", "60"))


_FIRST = pytest.StashKey[int]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_FIRST] = len(started())  # before this test's fixtures start anything


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    first = item.stash.get(_FIRST, len(started()))
    history = started()
    mine = history[first:]  # started by this test (or its function-scoped fixtures)
    shared = [p for p in running() if p not in mine]  # module/session fixtures still up
    for proc in [*shared, *mine]:
        state = "alive" if proc.alive() else f"exit code {proc.returncode}"
        title = f"{proc.name} pid {proc.pid} ({state}) log {proc.log_path}"
        report.sections.append((title, proc.log_tail(_LOG_LINES) or "(empty log)"))


def pytest_configure(config: pytest.Config) -> None:
    # JUnit files record commit, wheels, device and each test's level markers (compat table);
    # a copy of this conftest run outside the repository (tests of the fixtures) has no such file
    try:
        from tests.junit_provenance import register
    except ModuleNotFoundError:
        return
    register(config)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    stop_all()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``gpu`` tests skip cleanly where torch sees no CUDA device (CI)."""
    try:
        import torch

        has_cuda = bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - no torch, or a broken CUDA runtime
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
