"""Reaching the pool (store/connect.py): preflight and a setup that fails fast.

A dead or hung master against a REAL metadata server: a ``StoreUnavailableError``
within the timeout, never Mooncake's own ~90 s of retries.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from mooncake_vllm import placement
from mooncake_vllm.config import load_store_config
from mooncake_vllm.errors import StoreUnavailableError
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.placement import THREAD_AFFINITY_ENV, note_compute_cores
from mooncake_vllm.services import LocalStack
from mooncake_vllm.store import StoreClient
from mooncake_vllm.store.connect import pick_local_hostname, tcp_reachable
from tests.store.configs import client_config


def test_a_local_master_is_reached_over_loopback() -> None:
    for host in ("127.0.0.1", "localhost", "::1", ""):
        assert pick_local_hostname(host) == "127.0.0.1"


def test_tcp_reachable_says_why_not() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        assert tcp_reachable("127.0.0.1", server.getsockname()[1], 1.0) is None
        port = server.getsockname()[1]
    reason = tcp_reachable("127.0.0.1", port, 1.0)  # closed now
    assert reason and "refused" in reason.lower()


def test_dead_master_fails_fast_with_clear_error(
        module_local_stack: LocalStack, tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=f"no Mooncake master at 127.0.0.1:{port}"):
        StoreClient.connect(load_store_config(client_config(tmp_path, f"127.0.0.1:{port}",
                                                      module_local_stack.metadata_url)))
    assert time.monotonic() - start < 2  # a refused port is known at once


def test_hung_master_fails_within_timeout(module_local_stack: LocalStack, tmp_path: Path) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:  # accepts and never answers
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            StoreClient.connect(load_store_config(client_config(
                tmp_path, f"127.0.0.1:{server.getsockname()[1]}", module_local_stack.metadata_url)),
                timeout=4.0)
        assert time.monotonic() - start < 4.5  # the 4 s time-box, not Mooncake's own retries
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        server.close()


def _thread_cpus() -> dict[int, frozenset[int]]:
    """Every live thread of this process and the CPUs it may run on."""
    out: dict[int, frozenset[int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = frozenset(os.sched_getaffinity(int(tid)))
        except OSError:  # it exited meanwhile
            pass
    return out


def _comm(tid: int) -> str:
    try:
        return f"{tid} " + Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except OSError:
        return str(tid)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_mooncakes_threads_start_off_vllms_cores(module_local_stack: LocalStack,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A client and its lanes opened from vLLM's thread (pinned to a compute core): every
    thread Mooncake starts runs on the other cores (its TCP threads keep the CPUs of the
    thread that called setup)."""
    cores = frozenset(os.sched_getaffinity(0))
    if len(cores) < 2 or set(range(os.cpu_count() or 1)) != cores:
        pytest.skip("needs two cores this process may use")
    monkeypatch.delenv(THREAD_AFFINITY_ENV, raising=False)
    monkeypatch.setattr(placement, "_decided", None)
    compute = min(cores)
    before = set(_thread_cpus())
    seen: dict[int, frozenset[int]] = {}
    errors: list[BaseException] = []

    def vllm_thread() -> None:
        try:
            os.sched_setaffinity(0, {compute})
            note_compute_cores()
            client = StoreClient.connect(load_store_config(module_local_stack.config_path))
            try:
                kv = [torch.zeros((2, 4, 16, 2, 64)) for _ in range(2)]
                client.register_layout(BlockLayout.from_kv_caches(kv), clients=2)
                assert client.lanes == 2
                me = threading.get_native_id()
                seen.update({t: c for t, c in _thread_cpus().items() if t not in before and t != me})
            finally:
                client.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=vllm_thread)
    thread.start()
    thread.join(60)
    assert not errors, errors
    assert len(seen) > 3  # the clients' own threads (Mooncake's, the time-boxes')
    on_compute = {_comm(t): sorted(c) for t, c in seen.items() if compute in c}
    assert not on_compute, f"threads on vLLM's core {compute}: {on_compute}"
