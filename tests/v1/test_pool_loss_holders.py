"""A REAL holder's segment dropped under the scheduler (v1/pool_loss.py): real master
(client_ttl 5 s, as the soak's) + two holders, one SIGSTOPped 10 s. The master drops its
segment and every block on it while the pool keeps answering; the scheduler's next lookup
of a document it had found misses those blocks, and the chunks "vLLM's prefix cache"
still holds are saved back by the sweep (those requests are never scheduled), byte for byte.
Before: nothing re-saved them until a request recomputed them (soak run I: 34.8 s)."""

from __future__ import annotations

import os
import signal
import sys
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
from test_pool_loss import empty_output

from mooncake_vllm.config import load_store_config
from mooncake_vllm.keys import KeyNamespace
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.store import StoreClient
from mooncake_vllm.v1.namespace import RankNamespaces
from mooncake_vllm.v1.scheduler import SchedulerLogic

BS = 16
CHUNKS = 8
STALL = 10.0  # the soak's holder_stop, past the test master's client_ttl (5 s)


def _request(req_id: str, tokens: list[int], name: str) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, lora_request=None,
                           cache_salt=None, mm_features=[],
                           block_hashes=[f"{name}{i}" for i in range(CHUNKS)])


def _kv(seed: int) -> list[np.ndarray]:
    return [np.random.default_rng(seed + i).standard_normal((2 * CHUNKS, 2, BS, 64), dtype=np.float32)
            for i in range(2)]


def test_a_dropped_holder_segment_is_refilled_from_vllms_cache(local_stack: Any) -> None:
    client = StoreClient.connect(load_store_config(local_stack.config_path), timeout=5)
    try:
        hbm = _kv(0)  # "vLLM's KV cache": document R in blocks 0-7, S in 8-15
        layout = BlockLayout.from_kv_caches(hbm)
        client.register_layout(layout)
        ns = RankNamespaces((KeyNamespace("loss", "float32", layout.fingerprint, BS, 0, 1, 0),))
        logic = SchedulerLogic(ns, BS, client.exists, can_load=True, can_save=True,
                               pool_ready=lambda: client.healthy)
        docs = {"r": list(range(CHUNKS * BS + 1)), "s": list(range(10_000, 10_000 + CHUNKS * BS + 1))}
        keys: dict[str, list[str]] = {}
        cache: dict[str, int] = {}
        for base, name in ((0, "r"), (CHUNKS, "s")):  # computed and saved by this instance
            req = _request(name, docs[name], name)
            assert logic.get_num_new_matched_tokens(req, 0) == (0, False)
            keys[name] = ns.keys_for(logic.requests[name].digests)
            assert client.put_blocks(keys[name], layout, list(range(base, base + CHUNKS))) == CHUNKS
            logic.request_finished(req)
            cache.update({f"{name}{i}": base + i for i in range(CHUNKS)})
        logic.refill.resolve = cache.get
        # R and S served again: their lookups find every chunk (what a later miss is judged by)
        for name in docs:
            got = logic.get_num_new_matched_tokens(_request(f"{name}1", docs[name], name), 0)
            assert got[0] == CHUNKS * BS, got
        logic.build_connector_meta(empty_output())
        both = keys["r"] + keys["s"]
        places = client.transport.holders._where(both)
        assert places is not None and None not in places, places
        # one chunk missed is enough here (the threshold is the unit tests'): which of the 16
        # chunks the stopped holder got is the master's choice (none of them: 2**-16)
        logic.refills.losses.min_vanished = 1
        os.kill(local_stack.holders[0].pid, signal.SIGSTOP)
        try:
            time.sleep(STALL)
        finally:
            os.kill(local_stack.holders[0].pid, signal.SIGCONT)
        present = client.exists(both)
        lost = [k for k, here in zip(both, present) if not here]
        assert lost, "the master kept the stalled holder's blocks"
        assert len({w for w, here in zip(places, present) if not here}) == 1  # one holder's
        # a request for R and one for S, looked up but never scheduled (so nothing of theirs is
        # saved): their lookups miss what the earlier ones found
        logic.get_num_new_matched_tokens(_request("r2", docs["r"], "r"), 0)
        logic.get_num_new_matched_tokens(_request("s2", docs["s"], "s"), 0)
        assert 0 < logic.counters["pool_vanished_chunks"] <= len(lost)
        deadline = time.monotonic() + 30
        while logic.counters["pool_loss_refills"] == 0 or logic.refill.sweeping:
            assert time.monotonic() < deadline, f"no refill: {dict(logic.counters)}"
            for job in logic.build_connector_meta(empty_output()).saves:  # the workers' puts
                assert job.unheld
                client.put_blocks(ns.keys_for(job.digests), layout, job.block_ids)
            time.sleep(0.2)
        assert all(client.exists(both)), "the sweep did not save the lost chunks back"
        assert logic.counters["pool_loss_refills"] == 1
        assert logic.counters["pool_loss_refill_chunks"] >= len(lost)
        assert "blocks lost while the pool stayed up (a lookup missed" in logic.refill.last_line
        back = _kv(99)  # read back into another "KV cache": the bytes that were saved
        other = BlockLayout.from_kv_caches(back)
        client.register_layout(other)
        assert all(client.get_blocks(keys["r"] + keys["s"], other, list(range(2 * CHUNKS))))
        assert all(np.array_equal(a, b) for a, b in zip(back, hbm))
    except AssertionError as exc:  # said before close(), which may crash Mooncake on calls still in flight
        print(f"FAILED: {exc}", file=sys.stderr, flush=True)
        raise
    finally:
        client.close()

