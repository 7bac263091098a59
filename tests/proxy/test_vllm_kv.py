"""kv_aware over REAL vLLM CPU instances (kv_both, our connector, a real pool) publishing real
KV events: a repeated document goes to the instance that holds it, which reports the hit.

The instances start before the proxy binds its SUB socket (as after a proxy restart): the
first request's batch is published before the instance's PUB has reconnected and learnt the
subscription, so the live stream drops it (the ZMQ slow joiner), and vLLM publishes nothing
more until its next step. Only the replay socket (``--kv-replay``) brings it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from mooncake_vllm.compat import installed_facts
from mooncake_vllm.demo.run import kv_transfer_config
from mooncake_vllm.proxy.kv_events import vllm_args
from mooncake_vllm.proxy.kv_hashes import ALGORITHMS
from mooncake_vllm.proxy.kv_index import LOCAL, POOL
from mooncake_vllm.services import LocalStack, ManagedProcess, free_port, start_vllm_server
from tests.v1.instances import fact

from ._helpers import proxy, run, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(2400)]

FACTS = installed_facts()
#: releases whose block hashes are seeded per process (0.9.2) route by KV only with one
#: PYTHONHASHSEED for the instances and the proxy, and (where vLLM's default is Python's
#: builtin hash) sha256 blocks: what the proxy's start-up line tells an operator to set
SEED_ENV = ({"PYTHONHASHSEED": "0"} if FACTS is not None and FACTS.v1_hash_seed == "seed-required" else {})
#: before 0.10.2 vLLM's events carry only its builtin hash (sha256 stops its publisher), which
#: no other process reproduces: kv_aware says so and routes like prefix_aware
ROUTABLE = fact("sha256_kv_events")
HASH_ARGS = (("--prefix-caching-hash-algo", "sha256")
             if ROUTABLE and FACTS is not None and FACTS.default_hash_algorithm not in ALGORITHMS else ())
DOC = " ".join(f"clause {i}: the parties agree that section {i % 7} applies." for i in range(60))
HEALTH = {"health_interval": 1.0, "health_timeout": 10.0}


@pytest.fixture(scope="module")
def events_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def pair(tiny_model: Path, module_local_stack: LocalStack, events_endpoint: str,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ManagedProcess]]:
    """Two kv_both instances with KV events to the proxy's socket, started in parallel."""
    wd = tmp_path_factory.mktemp("kv-pair")
    env = {"MOONCAKE_CONFIG_PATH": str(module_local_stack.config_path), **SEED_ENV}

    def start(name: str) -> ManagedProcess:
        port = free_port()
        replay = f"tcp://127.0.0.1:{free_port()}"
        proc = start_vllm_server(tiny_model, port, wd, kv_transfer_config("kv_both"), env, name=name,
                                 extra_args=(*vllm_args(events_endpoint, f"127.0.0.1:{port}", replay), *HASH_ARGS),
                                 timeout=900)
        proc.replay = replay  # type: ignore[attr-defined]
        return proc

    with ThreadPoolExecutor(2) as ex:
        futures = [ex.submit(start, f"kv{i}") for i in range(2)]
    procs, errors = [], []
    for fut in futures:
        try:
            procs.append(fut.result())
        except Exception as exc:  # noqa: BLE001 - reported after the others are stopped
            errors.append(str(exc))
    try:
        if errors:
            pytest.fail("vLLM instances did not start:\n" + "\n".join(errors), pytrace=False)
        yield procs
    finally:
        for p in procs:
            p.stop()


def test_a_repeated_document_goes_to_the_instance_that_holds_it(tiny_model: Path, pair: list[ManagedProcess],
                                                                events_endpoint: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SEED_ENV.items():  # the in-process proxy reads it when it configures
        monkeypatch.setenv(name, value)

    async def go() -> None:
        async with proxy([], [str(p.address) for p in pair], model=str(tiny_model), flow="kv_both",
                         scheduling="kv_aware", kv_events=events_endpoint,
                         kv_replay=[f"{p.address}={p.replay}" for p in pair], **HEALTH) as (server, base, client):
            kv = server.kv

            async def ask(prompt: str) -> dict[str, Any]:
                body = {"model": str(tiny_model), "prompt": prompt, "max_tokens": 2, "temperature": 0}
                async with client.post(base + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    return json.loads(await r.read())

            if not ROUTABLE:  # the proxy said why at start, and still serves (like prefix_aware)
                assert kv is not None and not kv.hashers and "vLLM >= 0.10.2" in str(kv.disabled)
                answers = [await ask(DOC + f" Question {k}: who pays?") for k in (1, 2)]
                assert all(a["choices"][0]["finish_reason"] in ("length", "stop") for a in answers)
                return
            assert kv is not None and kv.hashers and not kv.disabled
            first = await ask(DOC + " Question 0: who signs?")
            doc_tokens = first["usage"]["prompt_tokens"]
            holder = max(server.pool.available("decode"), key=lambda i: i.requests)
            await wait_for(lambda: len(kv.indexes.get(holder.key, ())) >= doc_tokens // 32 - 1, timeout=60)
            # detected from vLLM's own events (0.32 sends extra_keys [None, ...]: no extra keys)
            await wait_for(lambda: kv.hasher is not None, timeout=30)
            assert kv.hasher is not None and kv.hasher.algorithm == "sha256"
            before = holder.requests
            answers = [await ask(DOC + f" Question {k}: who pays?") for k in (1, 2)]
            assert holder.requests == before + 2  # both went to the holder
            for a in answers:  # the instance's own report: most of the prompt came from cache
                assert a["usage"]["prompt_tokens_details"]["cached_tokens"] >= (doc_tokens // 32 - 1) * 32
            async with client.get(base + "/metrics") as r:
                text = await r.text()
            got = [ln for ln in text.splitlines() if ln.startswith("mooncake_proxy_kv_aware_got_cached_tokens")]
            assert got and int(got[0].rsplit(" ", 1)[1]) >= 2 * (doc_tokens // 32 - 1) * 32
            # the pool's events (medium MOONCAKE) arrive too, from our connector, where vLLM
            # takes a connector's events (0.10.2+)
            assert kv.indexes[holder.key].count(LOCAL) > 0
            if not fact("connector_kv_events"):
                return

            def pool_events() -> int:
                return sum(i.count(POOL) for i in kv.indexes.values())

            # vLLM takes a connector's events with a step's output: a put that lands after an
            # instance's last step is published with its next one, and a worker whose client
            # was still connecting dropped (and counted) the first saves. New documents give
            # both instances new chunks to save and steps to report them with.
            for k in range(3, 9):
                if pool_events():
                    break
                await ask(f"Appendix {k}. " + DOC)
                try:
                    await wait_for(lambda: pool_events() > 0, timeout=2.0)
                except AssertionError:
                    continue
            assert pool_events() > 0, "no MOONCAKE events from our connector"

    run(go, timeout=600)
