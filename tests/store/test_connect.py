"""Reaching the pool (store/connect.py): preflight and a setup that fails fast.

A dead or hung master against a REAL metadata server: a ``StoreUnavailableError``
within the timeout, never Mooncake's own ~90 s of retries.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from mooncake_vllm.config import load_store_config
from mooncake_vllm.errors import StoreUnavailableError
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
