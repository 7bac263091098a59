"""Audits of vLLM's own prefix-cache hits on their own thread (v1/audits.py).

The synchronous order (an answer before the request's first saves are planned) is covered
by test_scheduler.py's audit tests, which run the lane inline; here the lane's thread
answers late, as the master's round trip does in serving.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from mooncake_vllm.keys import chunk_keys
from mooncake_vllm.v1.audits import AuditLane, LaneAsk
from mooncake_vllm.v1.namespace import RankNamespaces
from mooncake_vllm.v1.scheduler import SchedulerLogic
from tests.v1.test_scheduler import BS, TOKENS, FakePool, _ns, _output, _request


class GatedPool(FakePool):
    """The pool's existence query, held until ``gate`` opens (a slow master)."""

    def __init__(self, keys: set[str], fail: str = "") -> None:
        super().__init__(keys)
        self.gate = threading.Event()
        self.fail = fail  #: "raise" or "none": the query fails that way

    def __call__(self, keys):  # noqa: ANN001, ANN204 - the lookup callable
        assert self.gate.wait(10)
        if self.fail == "raise":
            raise TimeoutError("the master did not answer")
        if self.fail == "none":
            self.calls.append(list(keys))
            return None  # StoreClient.audit_exists: the pool gave no answer
        return super().__call__(keys)


def _producer(pool: FakePool, lane: AuditLane) -> SchedulerLogic:
    # a producer: no lookup of its own, so only the audit asks the pool
    return SchedulerLogic(RankNamespaces((_ns(),)), BS, pool, can_load=False, can_save=True,
                          audit_lane=lane)


def _digests(keys: list[str]) -> list[str]:
    return [k.rsplit("/", 1)[1] for k in keys]


def _answered(logic: SchedulerLogic, pool: GatedPool, calls: int = 1) -> None:
    """Open the gate and wait until the lane has answered ``calls`` queries."""
    pool.gate.set()
    deadline = time.monotonic() + 10
    while len(pool.calls) < calls and pool.fail != "raise":
        assert time.monotonic() < deadline
        time.sleep(0.005)
    time.sleep(0.05)  # the answer is queued right after the call returns


def _decode_step(req_id: str, computed: int) -> SimpleNamespace:
    cached = SimpleNamespace(req_ids=[req_id], resumed_req_ids=set(), new_block_ids=[None],
                             num_computed_tokens=[computed])
    return _output(cached=cached, scheduled={req_id: 1})


def test_an_audit_never_holds_vllms_thread_and_a_loss_is_saved_with_the_next_step() -> None:
    keys = chunk_keys(_ns(), TOKENS)
    pool = GatedPool({keys[0], keys[3]})  # chunks 1 and 2 lost
    lane = AuditLane(pool)
    logic = _producer(pool, lane)
    try:
        started = time.monotonic()
        assert logic.get_num_new_matched_tokens(_request("r", TOKENS), 12) == (0, False)
        assert time.monotonic() - started < 1.0  # the master has not answered yet
        assert logic.counters["pool_audits"] == 1
        new = SimpleNamespace(req_id="r", block_ids=([3, 4, 5, 6, 7],), num_computed_tokens=12)
        meta = logic.build_connector_meta(_output([new], scheduled={"r": 6}))
        # no answer yet: chunks 0-2 are vLLM's own hits, only the computed chunk 3 is saved
        assert [(j.digests, j.block_ids) for j in meta.saves] == [(_digests(keys[3:4]), [6])]
        _answered(logic, pool)
        meta = logic.build_connector_meta(_decode_step("r", 18))
        assert [(j.req_id, j.digests, j.block_ids) for j in meta.saves] == \
            [("r", _digests(keys[1:3]), [4, 5])]  # from the request's own blocks
        assert logic.counters["pool_refill_chunks"] == 2 and logic.requests["r"].has_saves
        assert logic.audits.audit.due_from(_digests(keys[:1])) is None  # chunk 0: found
        assert logic.build_connector_meta(_decode_step("r", 19)).saves == []  # once
    finally:
        lane.close()


def test_an_answer_that_comes_after_its_request_finished_leaves_the_chunks_due() -> None:
    keys = chunk_keys(_ns(), TOKENS)
    pool = GatedPool({keys[0]})
    lane = AuditLane(pool)
    logic = _producer(pool, lane)
    try:
        logic.get_num_new_matched_tokens(_request("r", TOKENS), 12)
        logic.request_finished(_request("r", TOKENS))
        _answered(logic, pool)
        assert logic.build_connector_meta(_decode_step("x", 1)).saves == []
        assert logic.counters["pool_audits_late"] == 1
        logic.get_num_new_matched_tokens(_request("s", TOKENS), 12)
        assert logic.counters["pool_audits"] == 2  # asked again, from the first lost chunk
        _answered(logic, pool, calls=2)
        assert pool.calls[1] == keys[1:3]
    finally:
        lane.close()


@pytest.mark.parametrize("fail", ["raise", "none"])
def test_an_unanswered_audit_is_asked_again(fail: str) -> None:
    pool = GatedPool(set(), fail=fail)  # nothing there: an answer would say "lost"
    lane = AuditLane(pool)
    logic = _producer(pool, lane)
    try:
        logic.get_num_new_matched_tokens(_request("r", TOKENS), 12)
        logic.get_num_new_matched_tokens(_request("s", TOKENS), 12)
        assert logic.counters["pool_audits"] == 1  # trusted while asked
        _answered(logic, pool)
        logic.build_connector_meta(_decode_step("r", 13))
        logic.get_num_new_matched_tokens(_request("t", TOKENS), 12)
        assert logic.counters["pool_audits"] == 2 and logic.counters["pool_refill_chunks"] == 0
    finally:
        lane.close()


def test_a_busy_lane_asks_no_more_and_the_chunks_stay_due() -> None:
    prompts = [list(range(200 * i, 200 * i + 18)) for i in range(1, 5)]
    pool = GatedPool(set())
    lane = AuditLane(pool, max_queued=1)
    logic = _producer(pool, lane)
    try:
        logic.get_num_new_matched_tokens(_request("a", prompts[0]), 12)  # the thread takes it
        deadline = time.monotonic() + 5
        while lane._asked.qsize():  # noqa: SLF001 - until the thread holds the first one
            assert time.monotonic() < deadline
            time.sleep(0.005)
        logic.get_num_new_matched_tokens(_request("b", prompts[1]), 12)  # queued
        logic.get_num_new_matched_tokens(_request("c", prompts[2]), 12)  # refused: full
        assert logic.counters["pool_audits"] == 2
        digests_c = logic.requests["c"].digests
        assert logic.audits.audit.due_from(digests_c[:3]) == 0  # not asked: still due
    finally:
        pool.gate.set()
        lane.close()


def test_an_inline_lane_answers_at_once() -> None:
    keys = chunk_keys(_ns(), TOKENS)
    pool = FakePool({keys[0]})
    lane = AuditLane(pool, threaded=False)
    logic = _producer(pool, lane)
    logic.get_num_new_matched_tokens(_request("r", TOKENS), 12)
    assert logic.requests["r"].pool_gap == 1 and lane.take() == []


def _lost_after_first_saves(pool: GatedPool) -> tuple[SchedulerLogic, AuditLane]:
    """Request "r" (chunks 0-2 vLLM's own hits, blocks 3-7) audited; its first saves planned
    before the answer, which says chunks 1 and 2 are gone."""
    lane = AuditLane(pool)
    logic = _producer(pool, lane)
    logic.get_num_new_matched_tokens(_request("r", TOKENS), 12)
    new = SimpleNamespace(req_id="r", block_ids=([3, 4, 5, 6, 7],), num_computed_tokens=12)
    logic.build_connector_meta(_output([new], scheduled={"r": 6}))
    _answered(logic, pool)
    return logic, lane


def test_a_request_that_does_not_run_is_never_saved_from_its_old_blocks() -> None:
    """Preempted where the release does not say so (< 0.14): its blocks may be another
    request's now. The lost chunks wait for a step that runs it, from its blocks then."""
    keys = chunk_keys(_ns(), TOKENS)
    logic, lane = _lost_after_first_saves(GatedPool({keys[0], keys[3]}))
    try:
        other = SimpleNamespace(req_id="x", block_ids=([4, 5],), num_computed_tokens=0)
        logic.get_num_new_matched_tokens(_request("x", list(range(900, 906))), 0)
        out = _output([other], scheduled={"x": 6})
        del out.preempted_req_ids  # r was preempted and its blocks 4, 5 went to x, unreported
        assert [j.req_id for j in logic.build_connector_meta(out).saves] == ["x"]
        assert list(logic.audits.pending()) == [("r", 1, 3)]
        # r runs again with new blocks, all its prompt computed again by this step
        cached = SimpleNamespace(req_ids=["r"], resumed_req_ids={"r"}, new_block_ids=[([20, 21, 22, 23, 24],)],
                                 num_computed_tokens=[0])
        meta = logic.build_connector_meta(_output(cached=cached, scheduled={"r": 18}))
        assert [(j.digests, j.block_ids) for j in meta.saves if j.block_ids[:1] == [21]] == \
            [(_digests(keys[1:3]), [21, 22])]
        assert not list(logic.audits.pending())
    finally:
        lane.close()


def test_a_resumed_request_saves_only_the_chunks_computed_again() -> None:
    """Resumed from scratch, 9 of its tokens computed by this step (block size 4): chunk 1
    is whole, chunk 2 holds one token: saved once a later step completes it."""
    keys = chunk_keys(_ns(), TOKENS)
    logic, lane = _lost_after_first_saves(GatedPool({keys[0], keys[3]}))
    try:
        cached = SimpleNamespace(req_ids=["r"], resumed_req_ids={"r"}, new_block_ids=[([20, 21, 22],)],
                                 num_computed_tokens=[0])
        meta = logic.build_connector_meta(_output(cached=cached, scheduled={"r": 9}))
        assert [(j.digests, j.block_ids) for j in meta.saves] == [(_digests(keys[1:2]), [21])]
        assert list(logic.audits.pending()) == [("r", 2, 3)]
        cached = SimpleNamespace(req_ids=["r"], resumed_req_ids=set(), new_block_ids=[([23, 24],)],
                                 num_computed_tokens=[9])
        meta = logic.build_connector_meta(_output(cached=cached, scheduled={"r": 9}))
        assert (_digests(keys[2:3]), [22]) in [(j.digests, j.block_ids) for j in meta.saves]
        assert not list(logic.audits.pending())
    finally:
        lane.close()


def test_hits_lost_before_a_pool_load_after_them_are_saved_again() -> None:
    """Chunks 0-2 vLLM's own, chunk 3 claimed from the pool: the saves start after the load,
    so the lost hits are saved as a job of their own (the synchronous audit left them out)."""
    keys = chunk_keys(_ns(), TOKENS)
    pool = FakePool({keys[0], keys[3]})
    logic = SchedulerLogic(RankNamespaces((_ns(),)), BS, pool, can_load=True, can_save=True,
                           audit_lane=AuditLane(pool, threaded=False))
    st_req = _request("r", TOKENS)
    assert logic.get_num_new_matched_tokens(st_req, 12) == (4, False)  # chunk 3 from the pool
    logic.update_state_after_alloc(st_req, SimpleNamespace(get_block_ids=lambda: ([3, 4, 5, 6, 7],)), 4)
    new = SimpleNamespace(req_id="r", block_ids=([3, 4, 5, 6, 7],), num_computed_tokens=16)
    meta = logic.build_connector_meta(_output([new], scheduled={"r": 2}))
    assert (_digests(keys[1:3]), [4, 5]) in [(j.digests, j.block_ids) for j in meta.saves]


def test_closing_a_lane_with_a_full_queue_stops_its_thread() -> None:
    pool = GatedPool(set())
    lane = AuditLane(pool, max_queued=2)
    keys = ["k"]
    for i in range(4):
        lane.submit(_audit_of(f"r{i}", keys))
    started = time.monotonic()
    pool.gate.set()
    lane.close()
    assert time.monotonic() - started < 5.0
    assert not [t for t in threading.enumerate() if t.name == "mcv-audit" and t.is_alive()]
    assert lane.submit(_audit_of("late", keys)) is False


def _audit_of(req_id: str, keys: list[str]) -> Any:
    return LaneAsk(req_id, 0, ["d"], keys)


def test_asks_waiting_together_are_answered_by_one_query() -> None:
    """A wave of new requests under ``repeat`` asked the master once each, in turn (a round
    trip and two thread hand-offs a request); those waiting behind the lane's current query now
    go in one, each getting its own part of the answer (and none where the pool gave none)."""
    pool = GatedPool({"k1", "k4"})
    lane = AuditLane(pool)
    try:
        lane.submit(LaneAsk("a", 0, ["d0"], ["k0"]))
        deadline = time.monotonic() + 5
        while lane._asked.qsize():  # noqa: SLF001 - until the thread holds the first one
            assert time.monotonic() < deadline
            time.sleep(0.005)
        lane.submit(LaneAsk("b", 0, ["d1", "d2"], ["k1", "k2"]))
        lane.submit(LaneAsk("c", 3, ["d3", "d4"], ["k3", "k4"]))
        pool.gate.set()
        answers: dict[str, Any] = {}
        while len(answers) < 3:
            assert time.monotonic() < deadline
            answers.update((a.req_id, a.present) for a in lane.take())
            time.sleep(0.005)
        assert pool.calls == [["k0"], ["k1", "k2", "k3", "k4"]]
        assert answers == {"a": [False], "b": [True, False], "c": [False, True]}
    finally:
        pool.gate.set()
        lane.close()
    silent = AuditLane(lambda keys: [True], threaded=False)  # an answer of the wrong length
    silent.submit(LaneAsk("d", 0, ["d0", "d1"], ["k0", "k1"]))
    assert [a.present for a in silent.take()] == [None]
