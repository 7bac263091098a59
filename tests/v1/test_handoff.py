"""The store flow's prefill → decode hand-off: offers, markers, bounded deferred lookups.

Pure logic runs two real ``SchedulerLogic`` objects (a prefill and a decode) over a
fake pool and a fake clock; the marker path runs real workers and waiters against
a REAL master + holder. The engine-level proof (1P1D through the proxy, exact hit
counts) is tests/proxy/test_vllm.py.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from mooncake_vllm.handoff_protocol import HANDOFF_PARAM, Offer, ask_params, handoff_key, marker_value
from mooncake_vllm.keys import KeyNamespace, chunk_keys
from mooncake_vllm.v1.handoff import STALL_BOUND, MarkerWaiter, WaitResult, store_probe
from mooncake_vllm.v1.metadata import MooncakeConnectorMetadata
from mooncake_vllm.v1.namespace import RankNamespaces
from mooncake_vllm.v1.scheduler import SchedulerLogic
from mooncake_vllm.v1.worker import WorkerLogic
from tests.v1.test_worker import (  # noqa: F401
    EXPECTED,
    _cache,
    _GatedClient,
    _Source,
    _wait_idle,
    pool,
    workers,
)

#: ``pool`` and ``workers`` are test_worker's fixtures (a real shared client, worker cleanup)

BS = 4
TOKENS = list(range(200, 218))  # 18 tokens: 4 full chunks (16 tokens) + 2
NS = KeyNamespace("m", "float32", "cpu:vec:float32:L2:2x4x64", BS)


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


class Pool:
    """Chunk keys and markers: ``lookup`` for the scheduler, ``probe`` for the waiter."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.markers: dict[str, bytes] = {}
        self.lookups = 0

    def lookup(self, keys: Any) -> list[bool]:
        self.lookups += 1
        return [k in self.keys for k in keys]

    def probe(self, keys: Any) -> list[bytes | None]:
        return [self.markers.get(k) for k in keys]


def _request(req_id: str, params: dict[str, Any] | None, tokens: list[int] = TOKENS) -> Any:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, lora_request=None,
                           cache_salt=None, mm_features=[], kv_transfer_params=params)


def _new(req_id: str, tokens: int, computed: int = 0) -> Any:
    return SimpleNamespace(req_id=req_id, block_ids=([10, 11, 12, 13, 14],),
                           num_computed_tokens=computed)


def _step(logic: SchedulerLogic, new: list[Any] = (), cached: Any = None,
          scheduled: dict[str, int] | None = None) -> MooncakeConnectorMetadata:
    cached = cached or SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                       num_computed_tokens=[])
    return logic.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=list(new), scheduled_cached_reqs=cached,
        num_scheduled_tokens=scheduled or {}, preempted_req_ids=None,
        kv_connector_block_state=None))


class Blocks:
    def get_block_ids(self) -> tuple[list[int], ...]:
        return ([10, 11, 12, 13, 14],)


def _prefill(pool: Pool, ready: bool = True) -> SchedulerLogic:
    return SchedulerLogic(RankNamespaces((NS,)), BS, pool.lookup, can_load=False,
                          can_save=True, pool_ready=lambda: ready)


def _decode(pool: Pool, clock: Clock, *, timeout: float = 2.0, waiter: bool = True,
            ranks: tuple[KeyNamespace, ...] = (NS,)) -> tuple[SchedulerLogic, MarkerWaiter]:
    w = MarkerWaiter(pool.probe, clock=clock, background=False)
    logic = SchedulerLogic(RankNamespaces(ranks), BS, pool.lookup, can_load=True,
                           can_save=False, load_async=True, waiter=w if waiter else None,
                           handoff_timeout=timeout)
    return logic, w


def _prefill_offer(pool: Pool, *, ready: bool = True, tokens: list[int] = TOKENS,
                   chunked: bool = False) -> tuple[dict[str, Any], MooncakeConnectorMetadata]:
    """Run an asked prefill request to its end: (its answer's params, the declaring step)."""
    pre = _prefill(pool, ready)
    req = _request("p", ask_params(), tokens)
    pre.get_num_new_matched_tokens(req, 0)
    pre.update_state_after_alloc(req, Blocks(), 0)
    if chunked:  # two steps: 8 tokens, then the rest; only the second declares
        first = _step(pre, [_new("p", len(tokens))], scheduled={"p": 8})
        assert first.handoffs == {} and len(first.saves) == 1
        cached = SimpleNamespace(req_ids=["p"], resumed_req_ids=set(), new_block_ids=[None],
                                 num_computed_tokens=[8])
        meta = _step(pre, cached=cached, scheduled={"p": len(tokens) - 8})
    else:
        meta = _step(pre, [_new("p", len(tokens))], scheduled={"p": len(tokens)})
    _, params = pre.request_finished(req)
    assert params is not None
    return params, meta


def _publish(pool: Pool, params: dict[str, Any], present: int | None = None) -> None:
    """What the prefill worker does after its saves: chunk keys, then the marker."""
    offer = Offer.from_params(params)
    assert isinstance(offer, Offer)
    keys = chunk_keys(NS, TOKENS)[:offer.chunks if present is None else present]
    pool.keys.update(keys)
    pool.markers[handoff_key(NS.prefix(), offer.handoff_id)] = marker_value(offer.chunks, len(keys))


def _waiting(**kw: Any) -> tuple[Pool, Clock, dict[str, Any], SchedulerLogic, MarkerWaiter, Any]:
    """A decode request with a fresh prefill's offer, deferred once: (pool, clock, offer
    params, decode logic, its waiter, the request)."""
    pool, clock = Pool(), Clock()
    params, _ = _prefill_offer(pool)
    dec, waiter = _decode(pool, clock, **kw)
    req = _request("d", params)
    assert dec.get_num_new_matched_tokens(req, 0) == (None, False)
    return pool, clock, params, dec, waiter, req


# ---------------------------------------------------------------------- prefill side
@pytest.mark.parametrize("chunked", [False, True])
def test_an_asked_prefill_declares_after_its_last_full_chunk_and_offers_it(chunked: bool) -> None:
    params, meta = _prefill_offer(Pool(), chunked=chunked)
    offer = Offer.from_params(params)
    assert isinstance(offer, Offer)
    assert (offer.chunks, offer.state, offer.namespaces) == (4, "saving", (NS.prefix(),))
    (hid, digests), = meta.handoffs.values()
    assert hid == offer.handoff_id and len(digests) == 4
    # the declaring step's saves come first in the metadata, the marker after them
    assert meta.saves and meta.saves[-1].digests[-1] == digests[-1]


def test_an_asked_prefill_saves_its_local_prefix_hits_too() -> None:
    """The decode reads every chunk from the pool: vLLM's own prefix hits are saved again."""
    pre = _prefill(Pool())
    req = _request("p", ask_params())
    pre.get_num_new_matched_tokens(req, 8)  # chunks 0-1 from vLLM's prefix cache
    pre.update_state_after_alloc(req, Blocks(), 0)
    meta = _step(pre, [_new("p", 18, computed=8)], scheduled={"p": 10})
    assert [j.block_ids for j in meta.saves] == [[10, 11, 12, 13]]
    assert pre.counters["local_hit_chunks_not_saved"] == 0 and meta.handoffs


def test_a_prefill_not_asked_offers_nothing_and_declares_nothing() -> None:
    pre = _prefill(Pool())
    req = _request("p", None)
    pre.update_state_after_alloc(req, Blocks(), 0)
    meta = _step(pre, [_new("p", 18)], scheduled={"p": 18})
    assert meta.handoffs == {} and meta.saves
    assert pre.request_finished(req) == (True, None)


def test_a_prefill_without_pool_or_full_chunk_says_do_not_wait() -> None:
    params, meta = _prefill_offer(Pool(), ready=False)
    assert params[HANDOFF_PARAM]["state"] == "unavailable" and params[HANDOFF_PARAM]["chunks"] == 0
    params, meta = _prefill_offer(Pool(), tokens=TOKENS[:3])
    assert params[HANDOFF_PARAM]["state"] == "none" and meta.handoffs == {}


# ---------------------------------------------------------------------- decode side
def test_decode_defers_until_the_marker_then_claims_exactly_what_is_there() -> None:
    pool, clock, params, dec, waiter, req = _waiting()
    waiter.poll_once()
    clock.now += 0.5
    assert dec.get_num_new_matched_tokens(req, 0) == (None, False)
    assert pool.lookups == 0  # no lookup (and no claim) while the blocks may be in flight
    _publish(pool, params)
    clock.now += 0.01
    waiter.poll_once()
    assert dec.get_num_new_matched_tokens(req, 0) == (16, True)
    dec.update_state_after_alloc(req, Blocks(), 16)
    _, report = dec.request_finished(req)
    assert report == {HANDOFF_PARAM: {"outcome": "ready", "wait_ms": 510.0, "hit_tokens": 16}}
    assert dec.counters["handoff_ready"] == 1 and dec.counters["handoff_wait_us"] == 510000
    assert not any(k.startswith("handoff_fallback") for k in dec.counters)


def test_decode_gives_up_at_the_bound_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mooncake_vllm.v1.handoff"):
        pool, clock, params, dec, waiter, req = _waiting(timeout=2.0)
        pool.keys.update(chunk_keys(NS, TOKENS)[:2])  # what a dead prefill got out
        clock.now += 1.99
        waiter.poll_once()  # the poller looked just before the bound: no marker
        assert dec.get_num_new_matched_tokens(req, 0) == (None, False)
        clock.now += 0.02  # past the bound, looked recently: the wait is over
        assert dec.get_num_new_matched_tokens(req, 0) == (8, True)
        assert dec.get_num_new_matched_tokens(req, 8) == (0, False)  # asked again: no new wait
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "did not arrive within handoff_timeout" in lines[0]
    assert dec.counters["handoff_fallback_timeout"] == 1
    assert dec.request_finished(req)[1][HANDOFF_PARAM]["outcome"] == "timeout"


def test_without_a_look_near_the_bound_the_wait_ends_stall_bound_past_it() -> None:
    """No poll since long before the bound (a hung probe, a stalled poller): the scheduler
    still ends the wait, STALL_BOUND after it first found the bound passed."""
    pool, clock, params, dec, waiter, req = _waiting(timeout=2.0)
    clock.now += 2.01
    assert dec.get_num_new_matched_tokens(req, 0) == (None, False)
    clock.now += STALL_BOUND
    assert dec.get_num_new_matched_tokens(req, 0) == (0, False)
    assert dec.counters["handoff_fallback_timeout"] == 1


def test_a_failed_prefill_ends_the_wait_at_once_and_is_counted() -> None:
    pool, clock, params, dec, waiter, req = _waiting()
    _publish(pool, params, present=1)  # the marker says: 1 of 4 chunks got out
    waiter.poll_once()
    assert dec.get_num_new_matched_tokens(req, 0) == (4, True)
    assert dec.counters["handoff_fallback_prefill_failed"] == 1

    # an unavailable prefill: no wait at all
    params, _ = _prefill_offer(pool, ready=False)
    assert dec.get_num_new_matched_tokens(_request("e", params), 0) == (4, True)
    assert dec.counters["handoff_fallback_prefill_unavailable"] == 1


def test_blocks_gone_after_the_marker_are_never_claimed() -> None:
    pool, clock, params, dec, waiter, req = _waiting()
    _publish(pool, params)
    pool.keys.discard(chunk_keys(NS, TOKENS)[2])  # evicted between the marker and the lookup
    waiter.poll_once()
    assert dec.get_num_new_matched_tokens(req, 0) == (8, True)
    assert dec.counters["handoff_fallback_missing"] == 1


def test_foreign_or_malformed_offers_and_plain_requests_never_wait() -> None:
    pool, clock = Pool(), Clock()
    params, _ = _prefill_offer(pool)
    pool.keys.update(chunk_keys(NS, TOKENS))
    other = KeyNamespace("m", "float32", "cpu:vec:float32:L2:2x4x64", BS, 0, 2)
    dec, _ = _decode(pool, clock, ranks=(NS, other))
    assert dec.get_num_new_matched_tokens(_request("a", params), 0) == (0, False)  # rank 1 lacks them
    assert dec.counters["handoff_fallback_namespace_mismatch"] == 1
    dec, _ = _decode(pool, clock)
    bad = {HANDOFF_PARAM: {**params[HANDOFF_PARAM], "id": "not-hex"}}
    assert dec.get_num_new_matched_tokens(_request("b", bad), 0) == (16, True)
    assert dec.counters["handoff_fallback_bad_offer"] == 1
    plain = _request("c", None)
    assert dec.get_num_new_matched_tokens(plain, 0) == (16, True)
    assert dec.request_finished(plain)[1] is None  # a plain client's answer is as today


def test_without_deferral_the_decode_behaves_as_before() -> None:
    """Releases before 0.10.2 (no "ask again") or handoff_timeout 0: look up at once."""
    pool, clock = Pool(), Clock()
    params, _ = _prefill_offer(pool)
    for dec in (_decode(pool, clock, waiter=False)[0], _decode(pool, clock, timeout=0)[0]):
        assert dec.get_num_new_matched_tokens(_request("d", params), 0) == (0, False)
        assert dec.counters["handoff_not_waited"] == 1


def test_an_aborted_waiting_request_stops_being_watched() -> None:
    _, _, _, dec, waiter, req = _waiting()
    assert waiter._watches  # noqa: SLF001 - the watch exists ...
    dec.request_finished(req)
    assert not waiter._watches  # noqa: SLF001 - ... and is gone with the request


# ---------------------------------------------------------------------- real pool
def test_marker_follows_the_committed_saves_through_a_real_pool(pool: Any, workers: Any) -> None:
    """A real prefill worker publishes after its saves; a real waiter reads (and removes) it."""
    from mooncake_vllm.v1.metadata import BlockJob

    ns = KeyNamespace("handoff-test", "float32", EXPECTED.fingerprint, 4)
    digests = [f"{i + 7:032x}" for i in range(3)]
    hid = "ef" * 16
    marker = handoff_key(ns.prefix(), hid)
    saver = WorkerLogic(ns, EXPECTED, pool, can_load=False, can_save=True)
    workers(saver)
    saver.register_kv_caches(_cache(3))
    waiter = MarkerWaiter(store_probe(pool), poll_seconds=0.002)
    try:
        waiter.watch("d", [marker], 10.0)
        saver.wait_for_save(MooncakeConnectorMetadata(
            saves=[BlockJob("s", digests, [1, 2, 3])], handoffs={"s": (hid, digests)}))
        _wait_idle(saver, 10)
        deadline = time.monotonic() + 10
        while (res := waiter.result("d")) is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert res is not None and res.outcome == "ready" and res.present == 3, (
            res, str(saver.counters), str(pool.get().stats.snapshot()))
        assert pool.get().exists([f"{ns.prefix()}/{d}" for d in digests]) == [True] * 3
        assert pool.get().exists([marker]) == [False]  # read once, then removed
        assert saver.counters["handoff_markers"] == 1
        assert pool.get().stats.snapshot().get("rejected", 0) == 0  # no box contention
    finally:
        waiter.close()


def test_the_marker_waits_for_a_slow_save_of_its_request(workers: Any) -> None:
    """FIFO: a marker is published only after every save queued before it is committed."""
    from mooncake_vllm.v1.metadata import BlockJob

    class Client(_GatedClient):
        def __init__(self) -> None:
            super().__init__(snapshot=True)
            self.events: list[str] = []

        def commit_save(self, ticket: Any) -> int:
            n = super().commit_save(ticket)
            self.events.append("saved")
            return n

        def publish_marker(self, key: str, keys: Any, value: Any) -> bool:
            self.events.append(f"marker {len(keys)} {json.loads(value(len(keys)))['present']}")
            return True

    client = Client()
    saver = WorkerLogic(NS, EXPECTED, _Source(client), can_load=False, can_save=True)
    workers(saver)
    saver.register_kv_caches(_cache(5))
    digests = [f"{i:032x}" for i in range(2)]
    saver.wait_for_save(MooncakeConnectorMetadata(
        saves=[BlockJob("s", digests, [1, 2])], handoffs={"s": ("ab" * 16, digests)}))
    assert client.started.wait(5)
    time.sleep(0.1)
    assert client.events == []  # the save hangs: no marker yet
    client.gate.set()
    _wait_idle(saver)
    assert client.events == ["saved", "marker 2 2"]


def test_a_marker_is_published_when_due_even_if_a_save_before_it_hangs(workers: Any) -> None:
    """Issue 27: a put may take its whole time box (op_timeout + size/MIN_RATE >= the decode's
    5 s handoff_timeout); the marker behind it came after the decode gave up, with nothing
    saved. It is due at ``marker_due``: published then with the chunks present so far (none:
    the decode stops waiting and recomputes at once), and never a second time."""
    from mooncake_vllm.v1.metadata import BlockJob

    class Client(_GatedClient):
        def __init__(self) -> None:
            super().__init__(snapshot=True)
            self.markers: list[tuple[str, int, float]] = []

        def publish_marker(self, key: str, keys: Any, value: Any) -> bool:
            present = json.loads(value(0 if not self.gate.is_set() else len(keys)))["present"]
            self.markers.append((key, present, time.monotonic()))
            return True

    client = Client()
    saver = WorkerLogic(NS, EXPECTED, _Source(client), can_load=False, can_save=True,
                        marker_due=0.3)
    workers(saver)
    saver.register_kv_caches(_cache(5))
    digests = [f"{i:032x}" for i in range(2)]
    start = time.monotonic()
    saver.wait_for_save(MooncakeConnectorMetadata(
        saves=[BlockJob("s", digests, [1, 2])], handoffs={"s": ("ab" * 16, digests)}))
    assert client.started.wait(5)
    deadline = time.monotonic() + 5
    while not client.markers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [(k, p) for k, p, _ in client.markers] == [(handoff_key(NS.prefix(), "ab" * 16), 0)]
    assert 0.3 <= client.markers[0][2] - start < 2.0  # when due, the put still hanging
    assert saver.counters["handoff_markers_due"] == 1
    client.gate.set()
    _wait_idle(saver)
    assert len(client.markers) == 1  # the save thread does not publish it again
    assert saver.counters["handoff_markers"] == 1


def test_a_worker_without_pool_fails_its_marker_and_the_wait_stays_bounded(workers: Any) -> None:
    saver = WorkerLogic(NS, EXPECTED, _Source(None), can_load=False, can_save=True)
    workers(saver)
    saver.register_kv_caches(_cache(4))
    saver.wait_for_save(MooncakeConnectorMetadata(handoffs={"s": ("ab" * 16, ["00" * 16])}))
    _wait_idle(saver)
    assert saver.counters["handoff_markers_failed"] == 1
    hung = threading.Event()
    waiter = MarkerWaiter(lambda keys: [None] * len(keys) if hung.wait(5) else [])
    try:
        start = time.monotonic()
        waiter.watch("d", ["k"], 0.2)
        while (res := waiter.result("d")) is None:
            time.sleep(0.01)
        # bounded although the probe is still hung: no look since the deadline, so at most
        # STALL_BOUND past it
        assert res.outcome == "timeout" and time.monotonic() - start < 0.2 + STALL_BOUND + 0.5
    finally:
        hung.set()
        waiter.close()


def test_a_wait_whose_deadline_passed_during_a_stall_looks_once_more() -> None:
    """The decode's poller last looked well before the deadline, then this process (or the
    machine) stood still past it; meanwhile the prefill's marker came. Before, the first
    settle after the stall timed the wait out unlooked (CI: 5.003 s, the marker published
    the same moment); now one more look finds it. Without a marker it times out then."""
    clock, markers = Clock(), {}
    w = MarkerWaiter(lambda keys: [markers.get(k) for k in keys], clock=clock, background=False)
    w.watch("d", ["k"], 2.0)
    w.watch("e", ["j"], 2.0)
    clock.now += 0.5
    w.poll_once()
    clock.now += 4.5  # resumed after the stall: both deadlines passed, nothing looked since
    assert w.result("d") is None and w.result("e") is None
    markers["k"] = marker_value(3, 3)
    w.poll_once()
    assert w.result("d") == WaitResult("ready", 5.0, 3)
    assert w.result("e").outcome == "timeout"
