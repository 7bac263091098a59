"""``save_admission: "repeat"`` decided by the V1 scheduler before any capture (v1/admission.py),
and under ``all`` the spans not looked up (every hit declined) asked on the same lane.

The lane runs inline (its answer is there at the next hook) or on its thread behind a gate
(a slow master); the pool's existence query is a fake. The same policy against a real pool
and the real engine: tests/store/test_admission.py and test_connector.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mooncake_vllm.handoff_protocol import ask_params
from mooncake_vllm.keys import chunk_keys, seen_key
from mooncake_vllm.v1.admission import NEW, PRESENT, SEEN, UNANSWERED, Verdicts, may_end_this_step
from mooncake_vllm.v1.audits import AuditLane
from mooncake_vllm.v1.metadata import MooncakeConnectorMetadata
from mooncake_vllm.v1.metrics import scheduler_counters
from mooncake_vllm.v1.namespace import RankNamespaces
from mooncake_vllm.v1.scheduler import SchedulerLogic
from tests.v1.test_audits import GatedPool, _answered, _decode_step, _digests
from tests.v1.test_scheduler import BS, TOKENS, FakePool, _Clock, _measured, _ns, _output

KEYS = chunk_keys(_ns(), TOKENS)  # 4 full chunks
DIGESTS = _digests(KEYS)


def _request(req_id: str, max_tokens: int = 16, produced: int = 0, **extra: object) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=TOKENS, lora_request=None,
                           cache_salt=None, mm_features=[], max_tokens=max_tokens,
                           num_output_tokens=produced, **extra)


def _logic(pool: FakePool, lane: AuditLane | None = None, admission: str = "repeat",
           ranks: tuple = (_ns(),)) -> SchedulerLogic:  # noqa: ANN001 - a tuple of namespaces
    return SchedulerLogic(RankNamespaces(ranks), BS, pool, can_load=False, can_save=True,
                          save_admission=admission, admission_lane=lane)


def _prefill(logic: SchedulerLogic, request: SimpleNamespace) -> MooncakeConnectorMetadata:
    """vLLM looks the request up, then one step computes its whole prompt in blocks 10-14."""
    assert logic.get_num_new_matched_tokens(request, 0) == (0, False)
    new = SimpleNamespace(req_id=request.request_id, block_ids=([10, 11, 12, 13, 14],),
                          num_computed_tokens=0)
    return logic.build_connector_meta(_output([new], scheduled={request.request_id: len(TOKENS)}))


def test_first_sightings_are_marked_and_never_captured() -> None:
    pool = FakePool()
    logic = _logic(pool)
    meta = _prefill(logic, _request("a"))
    assert meta.saves == [] and meta.marks == DIGESTS
    assert pool.calls == [KEYS + [seen_key(k) for k in KEYS]]  # one query: chunks and marks
    assert logic.counters["admission_first_seen_chunks"] == 4
    assert scheduler_counters(logic)["admission_first_seen_chunks"] == 4  # in /metrics
    assert logic.request_finished(_request("a")) == (False, None)  # nothing holds its blocks


def test_seen_chunks_are_saved_present_ones_skipped() -> None:
    pool = FakePool({seen_key(KEYS[0]), seen_key(KEYS[1]), KEYS[2], seen_key(KEYS[2])})
    logic = _logic(pool)
    meta = _prefill(logic, _request("a"))
    (job,) = meta.saves
    assert (job.digests, job.block_ids, job.ask_admission) == (DIGESTS[:2], [10, 11], False)
    assert meta.marks == [DIGESTS[3]]
    assert logic.counters["admission_present_chunks"] == 1
    assert logic.counters["admission_repeat_chunks"] == 2
    assert logic.request_finished(_request("a"))[0]  # its save reads its blocks


def test_a_mark_of_one_rank_is_not_seen() -> None:
    r0, r1 = _ns(0, 2), _ns(1, 2)
    k0, k1 = chunk_keys(r0, TOKENS), chunk_keys(r1, TOKENS)
    pool = FakePool({seen_key(k) for k in k0} | {seen_key(k1[0])})
    meta = _prefill(_logic(pool, ranks=(r0, r1)), _request("a"))
    (job,) = meta.saves
    assert job.digests == DIGESTS[:1] and meta.marks == DIGESTS[1:]


def test_every_block_is_stored_under_the_default() -> None:
    pool = FakePool()
    meta = _prefill(_logic(pool, admission="all"), _request("a"))
    (job,) = meta.saves
    assert job.digests == DIGESTS and meta.marks == [] and pool.calls == []


def test_a_hand_off_is_always_stored() -> None:
    logic = _logic(FakePool())
    meta = _prefill(logic, _request("h", kv_transfer_params=ask_params()))
    (job,) = meta.saves
    assert job.digests == DIGESTS and not job.ask_admission and meta.marks == []


def test_without_an_answer_the_save_waits_for_a_later_step_that_runs_the_request() -> None:
    keys_seen = {seen_key(k) for k in KEYS[:2]}
    pool = GatedPool(keys_seen)
    lane = AuditLane(pool, name="mcv-admission")
    logic = _logic(pool, lane)
    try:
        meta = _prefill(logic, _request("a"))
        assert meta.saves == [] and meta.marks == []  # nothing captured, nothing decided
        _answered(logic, pool)
        meta = logic.build_connector_meta(_decode_step("a", len(TOKENS)))
        (job,) = meta.saves
        assert job.digests == DIGESTS[:2] and job.block_ids == [10, 11]
        assert meta.marks == DIGESTS[2:]
        assert logic.build_connector_meta(_decode_step("a", len(TOKENS) + 1)).saves == []
    finally:
        logic.close()


def test_a_last_step_without_an_answer_lets_the_save_thread_decide() -> None:
    pool = GatedPool(set())
    logic = _logic(pool, AuditLane(pool))
    try:
        meta = _prefill(logic, _request("a", max_tokens=1))
        (job,) = meta.saves
        assert job.digests == DIGESTS and job.ask_admission and meta.marks == []
        assert logic.counters["admission_decided_at_save_chunks"] == 4
    finally:
        pool.gate.set()
        logic.close()


def test_a_request_over_before_its_answer_counts_its_lost_saves() -> None:
    pool = GatedPool(set())
    logic = _logic(pool, AuditLane(pool))
    try:
        assert _prefill(logic, _request("a")).saves == []
        assert logic.request_finished(_request("a")) == (False, None)
        assert logic.counters["admission_late_chunks"] == 4
        _answered(logic, pool)
        logic.build_connector_meta(_output())  # the late answer is dropped: no verdict for "a"
        assert logic.admission is not None
        assert logic.admission.plan("a", 0, 4, last_step=True).at_save
    finally:
        logic.close()


def test_an_unanswered_query_stores_nothing_and_marks_nothing() -> None:
    pool = GatedPool(set(), fail="none")
    logic = _logic(pool, AuditLane(pool))
    try:
        _prefill(logic, _request("a"))
        _answered(logic, pool)
        meta = logic.build_connector_meta(_decode_step("a", len(TOKENS)))
        assert meta.saves == [] and meta.marks == []
        assert logic.counters["admission_unanswered"] == 1
        assert logic.counters["admission_unanswered_chunks"] == 4
    finally:
        logic.close()


def test_verdicts_outside_the_asked_span_are_unanswered() -> None:
    v = Verdicts(2, SEEN + NEW + PRESENT)
    assert [v.of(c) for c in range(6)] == [UNANSWERED, UNANSWERED, SEEN, NEW, PRESENT, UNANSWERED]


@pytest.mark.parametrize(("request_fields", "last"), [
    ({"max_tokens": 1, "num_output_tokens": 0}, True),
    ({"max_tokens": 2, "num_output_tokens": 0}, False),
    ({"max_tokens": 5, "num_output_tokens": 4}, True),
    ({"sampling_params": SimpleNamespace(max_tokens=3)}, False),
    ({}, True),  # unknown budget: it may end
])
def test_may_end_this_step(request_fields: dict, last: bool) -> None:  # noqa: ANN001
    assert may_end_this_step(SimpleNamespace(**request_fields)) is last


def test_a_save_waiting_for_its_answer_after_a_preemption_reads_the_blocks_computed_again() -> None:
    pool = GatedPool({seen_key(k) for k in KEYS[:2]})
    logic = _logic(pool, AuditLane(pool))
    try:
        assert _prefill(logic, _request("a")).saves == []  # computed in blocks 10-13, no answer
        logic.build_connector_meta(_output(preempted={"a"}))  # vLLM frees (and reuses) them
        _answered(logic, pool)
        assert logic.get_num_new_matched_tokens(_request("a"), 0) == (0, False)  # asked once only
        cached = SimpleNamespace(req_ids=["a"], resumed_req_ids={"a"}, new_block_ids=[([20, 21, 22, 23, 24],)],
                                 num_computed_tokens=[0])
        meta = logic.build_connector_meta(_output(cached=cached, scheduled={"a": 8}))  # chunks 0-1 again
        (job,) = meta.saves
        assert (job.digests, job.block_ids) == (DIGESTS[:2], [20, 21]) and meta.marks == []
        cached = SimpleNamespace(req_ids=["a"], resumed_req_ids=set(), new_block_ids=[None],
                                 num_computed_tokens=[8])
        meta = logic.build_connector_meta(_output(cached=cached, scheduled={"a": 10}))
        assert meta.saves == [] and meta.marks == DIGESTS[2:]
        assert len(pool.calls) == 1
    finally:
        logic.close()


def test_verdicts_count_a_leading_run_inside_their_span_only() -> None:
    v = Verdicts(2, PRESENT * 3 + NEW + PRESENT)
    assert v.leading(PRESENT, 2, 10) == 3 and v.leading(PRESENT, 3, 4) == 1
    assert v.leading(PRESENT, 5, 10) == 0 and v.leading(PRESENT, 6, 10) == 1
    assert v.leading(PRESENT, 0, 10) == 0  # before the span: unanswered
    assert v.leading(PRESENT, 2, 2) == 0


def _declining(pool: FakePool, lane: AuditLane, admission: str = "all") -> SchedulerLogic:
    """A saving side whose claim policy declines every hit (a slow pool), every span long."""
    clock = _Clock()
    return SchedulerLogic(RankNamespaces((_ns(),)), BS, pool, can_load=True, can_save=True,
                          claims=_measured("auto", 5.0, clock), clock=clock, skip_lookup_upto=0,
                          save_admission=admission, admission_lane=lane)


def test_a_declined_span_is_asked_off_vllms_thread_and_saves_only_what_the_pool_lacks() -> None:
    """H100 mixed serving: every recomputed document was a lookup on vLLM's thread before a
    declined claim. The lane asks instead; the step that computes the span plans nothing, the
    next (the request still runs: its blocks are its own) saves what the pool lacks."""
    pool = GatedPool({KEYS[0], KEYS[2]})
    logic = _declining(pool, AuditLane(pool, name="mcv-admission"))
    try:
        meta = _prefill(logic, _request("a"))
        assert meta.saves == [] and logic.counters["lookups"] == 0  # vLLM's thread never asked
        assert logic.counters["presence_lookups"] == 1
        _answered(logic, pool)
        assert pool.calls == [KEYS]  # chunk keys only: no marks under "all"
        meta = logic.build_connector_meta(_decode_step("a", len(TOKENS)))
        (job,) = meta.saves
        assert (job.digests, job.block_ids, job.ask_admission) == (
            [DIGESTS[1], DIGESTS[3]], [11, 13], False)
        assert meta.marks == []
        assert logic.counters["presence_present_chunks"] == 2
        assert logic.counters["presence_absent_chunks"] == 2
        # the leading chunk was a hit declined: counted, and the claim policy told
        assert logic.counters["claims_declined_slow_pool"] == 1
        assert logic.counters["declined_tokens"] == BS
        assert logic.claims.counts["slow_pool_unasked"] == 1
        assert logic.request_finished(_request("a"))[0]
        assert logic.counters["presence_late_chunks"] == 0
    finally:
        pool.gate.set()
        logic.close()


def test_a_declined_span_unanswered_by_its_last_step_is_captured_whole() -> None:
    pool = GatedPool(set(KEYS))
    logic = _declining(pool, AuditLane(pool))
    try:
        meta = _prefill(logic, _request("a", max_tokens=1))
        (job,) = meta.saves  # the put skips what the pool holds; no mark is asked for
        assert job.digests == DIGESTS and not job.ask_admission and meta.marks == []
        assert logic.counters["presence_decided_at_save_chunks"] == 4
    finally:
        pool.gate.set()
        logic.close()


def test_a_declined_span_the_pool_gives_no_answer_for_is_saved() -> None:
    """Under ``all`` the question never costs a save: no answer → captured, the put skips what
    the pool holds (counted, and in /metrics)."""
    pool = GatedPool(set(KEYS), fail="none")
    logic = _declining(pool, AuditLane(pool))
    try:
        assert _prefill(logic, _request("a")).saves == []
        _answered(logic, pool)
        (job,) = logic.build_connector_meta(_decode_step("a", len(TOKENS))).saves
        assert job.digests == DIGESTS and not job.ask_admission
        assert scheduler_counters(logic)["presence_unanswered_chunks"] == 4
        assert logic.counters["declined_tokens"] == 0  # nothing known to be declined
    finally:
        logic.close()


def test_requests_looked_up_or_not_asked_never_wait_for_an_answer() -> None:
    """Under ``all`` only a skipped lookup's request waits: a span short enough to capture
    again, or a pool whose hits pay, plans its saves in the step that computes them."""
    pool = GatedPool(set())
    short = SchedulerLogic(RankNamespaces((_ns(),)), BS, pool, can_load=True, can_save=True,
                           claims=_measured("auto", 5.0, _Clock()), admission_lane=AuditLane(pool))
    pays = SchedulerLogic(RankNamespaces((_ns(),)), BS, FakePool(), can_load=True, can_save=True,
                          claims=_measured("auto", 0.01, _Clock()), skip_lookup_upto=0,
                          admission_lane=AuditLane(pool))
    try:
        for logic in (short, pays):
            (job,) = _prefill(logic, _request("a")).saves
            assert job.digests == DIGESTS and logic.counters["presence_lookups"] == 0
    finally:
        pool.gate.set()
        short.close()
        pays.close()


def test_repeat_skips_a_declined_lookup_its_own_answer_covers() -> None:
    """Under ``repeat`` every request is asked anyway: its answer (chunks and marks) spares the
    saves, so a declined span is not looked up on vLLM's thread either."""
    pool = FakePool({KEYS[0], KEYS[1], seen_key(KEYS[2])})
    logic = _declining(pool, AuditLane(pool, threaded=False), admission="repeat")
    meta = _prefill(logic, _request("a"))
    assert logic.counters["lookups"] == 0 and len(pool.calls) == 1  # the admission's one query
    (job,) = meta.saves
    assert job.digests == [DIGESTS[2]] and meta.marks == [DIGESTS[3]]
    assert logic.counters["declined_tokens"] == 2 * BS and logic.counters["presence_lookups"] == 0


def test_a_request_looked_up_again_after_its_answer_counts_its_decline_from_that_answer() -> None:
    """A preempted request is looked up again when it comes back; no second answer comes (one
    per request), so that lookup's declined hit is counted from the answer already read."""
    pool = FakePool({KEYS[0], KEYS[1], seen_key(KEYS[2])})
    logic = _declining(pool, AuditLane(pool, threaded=False), admission="repeat")
    _prefill(logic, _request("a"))
    assert logic.counters["declined_tokens"] == 2 * BS
    assert logic.get_num_new_matched_tokens(_request("a"), 0) == (0, False)  # back, from 0
    assert logic.counters["declined_tokens"] == 4 * BS
    assert logic.counters["claims_declined_slow_pool"] == 2 and len(pool.calls) == 1
    assert logic.requests["a"].unasked_from is None

