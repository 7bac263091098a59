"""KvRouter's decisions without sockets: queued prefill work, settling it, the engines' own
counts, and the ``no_events`` fallback for an instance that publishes nothing."""

from __future__ import annotations

import logging
import time

import pytest

from mooncake_vllm.errors import ConfigError
from mooncake_vllm.proxy.engine_load import EngineLoad
from mooncake_vllm.proxy.instances import Instance, parse_endpoint
from mooncake_vllm.proxy.kv_events import ReplayAnswer
from mooncake_vllm.proxy.kv_hashes import PromptHasher
from mooncake_vllm.proxy.kv_policy import KvRouter, PromptKey
from mooncake_vllm.proxy.scheduling import KvAwarePolicy
from mooncake_vllm.proxy.server import ProxyConfig, ProxyServer

BS = 4
DOC = list(range(100, 140))  # 10 full blocks


def _stored(tokens: list[int]) -> dict:
    hashes = PromptHasher("sha256", "vllm-none-hash").block_hashes(tokens, BS)
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": tokens[: len(hashes) * BS], "block_size": BS, "medium": "GPU", "extra_keys": None}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _fleet(n: int) -> list[Instance]:
    return [Instance("decode", parse_endpoint(f"127.0.0.1:{9000 + i}")) for i in range(n)]


def _router() -> tuple[KvRouter, KvAwarePolicy]:
    router = KvRouter("tcp://127.0.0.1:1")  # never started: batches are handed in directly
    router.configure("0.32.0", {})
    return router, KvAwarePolicy(router, "decode")


def _key(tokens: list[int]) -> PromptKey:
    return PromptKey(b"", list(tokens))


def test_routed_work_queues_until_settled() -> None:
    router, policy = _router()
    a, b = _fleet(2)
    router.on_batch(a.key, 0, [_stored(DOC)])
    router.on_batch(b.key, 0, [_stored([7] * 4)])
    key = _key(DOC + [1, 2, 3, 4])
    assert policy.select([a, b], key) is a  # 40 of 44 tokens local: 4 tokens of work
    assert router.backlog.work[a.key] == pytest.approx(4.0)
    # 20 cold prompts' worth of work queued on a: a cold prompt is sooner on b
    router.backlog.work[a.key] += 20 * 44
    cold = _key(list(range(500, 544)))
    assert policy.select([a, b], cold) is b
    router.settle("decode", key)
    router.settle("decode", key)  # idempotent
    assert router.backlog.work[a.key] == pytest.approx(20 * 44)
    router.settle("decode", cold)
    assert b.key not in router.backlog.work


def test_requests_the_engine_reports_beyond_ours_count_as_queued_work() -> None:
    router, policy = _router()
    a, b = _fleet(2)
    router.on_batch(a.key, 0, [_stored(DOC)])
    router.on_batch(b.key, 0, [_stored(DOC)])
    for _ in range(4):  # the mean work per request: cold prompts
        key = _key(list(range(900, 944)))
        policy.select([a, b], key)
        router.settle("decode", key)
    a.engine = EngineLoad(at=1e18, max_age=1e18, waiting=3)  # other clients' requests on a
    assert router.queued(a) > router.queued(b)
    assert policy.select([a, b], _key(DOC)) is b


def test_a_cold_prompt_goes_where_it_stalls_fewer_requests_in_flight() -> None:
    """a: 3 requests in flight, nothing queued (decoding); b: 1 in flight and 40 tokens of
    prefill queued. The cold prompt waits less on a, but its 44 tokens would stall a's 3."""
    router, policy = _router()
    a, b = _fleet(2)
    router.on_batch(a.key, 0, [_stored([7] * 4)])
    router.on_batch(b.key, 0, [_stored([8] * 4)])
    first = _key(list(range(900, 944)))
    policy.select([a, b], first)  # the mean prompt: 44 tokens
    router.settle("decode", first)
    for _ in range(3):
        a.acquire()
    b.acquire()
    router.backlog.add(b.key, 40.0)
    assert router.queued(a) < router.queued(b)
    assert policy.select([a, b], _key(list(range(500, 544)))) is b


def test_an_instance_that_publishes_nothing_turns_routing_to_prefix(caplog: pytest.LogCaptureFixture) -> None:
    router, policy = _router()
    a, b = _fleet(2)
    router.on_batch(a.key, 0, [_stored(DOC)])  # a publishes; b never does
    caplog.set_level(logging.WARNING)
    for i in range(12):
        key = _key([1000 + i] * 8)
        policy.select([a, b], key)
        router.settle("decode", key)
    assert router.unheard_requests[b.key] >= router.silent_after
    assert router.counters[("fallbacks", "decode", "no_events")] > 0
    assert f"instance {b.key} published no KV events" in caplog.text
    # its first batch (or an answer from its replay socket) ends the fallback
    router.on_batch(b.key, 0, [])
    before = router.counters[("fallbacks", "decode", "no_events")]
    policy.select([a, b], _key(DOC))
    assert router.counters[("fallbacks", "decode", "no_events")] == before
    # leaving rotation forgets that it was heard
    router.sync("decode", [a])
    assert b.key not in router.heard


def test_the_pool_costs_what_the_instances_really_load() -> None:
    """Predicted pool tokens the instances recompute instead (their load policy declined) make
    the pool cost like a recompute; loaded ones keep ``weights.pool``."""
    router, _ = _router()
    a, b = _fleet(2)
    a.engine = EngineLoad(at=1e18, max_age=1e18, pool_hit_tokens=1000)
    b.engine = EngineLoad(at=1e18, max_age=1e18)
    router.calibrate([a, b])  # the starting point
    router._pool_predicted += 1000  # routed for 1000 pool tokens, none loaded
    for _ in range(10):
        router.calibrate([a, b])
        router._pool_predicted += 1000
    assert router.pool_realized < 0.05
    assert router.effective_weights().pool > 0.95
    a.engine = EngineLoad(at=1e18, max_age=1e18, pool_hit_tokens=0)  # restarted: counters from 0
    router.calibrate([a, b])
    for k in range(1, 11):  # now every predicted token is loaded
        router._pool_predicted += 1000
        a.engine = EngineLoad(at=1e18, max_age=1e18, pool_hit_tokens=1000 * k)
        router.calibrate([a, b])
    assert router.pool_realized > 0.95
    assert abs(router.effective_weights().pool - router.weights.pool) < 0.05


def test_the_holder_of_a_document_takes_no_more_than_its_share_of_requests() -> None:
    router, policy = _router()
    a, b, c = _fleet(3)
    router.on_batch(a.key, 0, [_stored(DOC)])
    for inst, n in zip((a, b, c), (6, 1, 0)):
        inst.in_flight = n
    # a holds the document: 4 tokens of work there against 44 recomputed, whatever a's 6 requests
    # in flight weigh; but 7 of 8 would be over 2x the mean, so the next turn goes to the least costly other
    policy.select([a, b, c], _key(DOC + [1, 2, 3, 4])).acquire()
    assert c.in_flight == 1
    assert router.counters[("bounded", "decode")] == 1
    a.in_flight = 5  # within the bound again: the holder; its engine's 6 came while 6 of ours ran there
    a.engine = EngineLoad(at=1e18, max_age=1e18, running=6, ours=6)
    assert policy.select([a, b, c], _key(DOC + [5, 6, 7, 8])) is a
    assert router.counters[("bounded", "decode")] == 1


def test_the_fallback_keeps_the_bound_too() -> None:
    router, policy = _router()
    fleet = _fleet(3)
    router.on_batch(fleet[0].key, 0, [_stored(DOC)])
    key = PromptKey(b"the same document", None)  # not tokenized: routes like prefix
    owner = policy.select(fleet, key)
    owner.in_flight = 4  # prefix's slack (4 over the least loaded) would keep it; 5 of 5 is over 2x the mean
    assert policy.select(fleet, key) is not owner
    assert router.counters[("fallbacks", "decode", "no_tokens")] == 2


def test_before_any_block_is_published_untokenized_first_turns_spread_by_load() -> None:
    from mooncake_vllm.proxy.scheduling import PrefixAwarePolicy

    router, policy = _router()  # a fresh proxy: no instance published anything yet
    fleet = _fleet(3)
    # six documents that prefix's hash would all give the same instance
    owner = fleet[0]
    docs = [p for p in (f"document {k}".encode() for k in range(200))
            if PrefixAwarePolicy().select(fleet, p) is owner][:6]
    for doc in docs:
        policy.select(fleet, PromptKey(doc, None)).acquire()  # all in flight at once, as 8 clients start
    assert [i.in_flight for i in fleet] == [2, 2, 2]
    assert router.counters[("fallbacks", "decode", "no_tokens")] == 6


def _measured(router: KvRouter, fleet: list[Instance], rates: list[float]) -> None:
    """The engines computed at ``rates`` (prefill tokens/s, one prefill at a time) over 100 s
    of the proxy's polls (their totals before its first poll are a baseline only)."""
    for at, seconds in ((0.0, 0.0), (100.0, 100.0)):
        for inst, rate in zip(fleet, rates):
            inst.engine = EngineLoad(at=at, max_age=1e18, prefill_tokens=rate * seconds,
                                     prefill_seconds=seconds)
        router.calibrate(fleet)


def test_before_any_block_is_published_first_turns_spread_by_measured_speed() -> None:
    """Three instances, one twice as fast as the others (the CPU bench: two share a core):
    8 cold documents at once go 4 / 2 / 2, not 3 / 3 / 2 by count."""
    router, policy = _router()
    fleet = _fleet(3)
    _measured(router, fleet, [500.0, 1000.0, 500.0])
    assert router.speeds.relative([i.key for i in fleet]) == pytest.approx([0.794, 1.587, 0.794], abs=1e-3)
    for d in range(8):
        policy.select(fleet, _key(list(range(1000 * d, 1000 * d + 2000)))).acquire()
    assert [i.in_flight for i in fleet] == [2, 4, 2]
    assert router.counters[("decisions", "decode", "cold")] == 8
    assert f'mooncake_proxy_kv_aware_prefill_rate{{instance="{fleet[1].key}"}} 1000.0' in router.render()


def test_a_slow_holder_keeps_its_hits_but_not_a_queue_worth_a_recompute_elsewhere() -> None:
    router, policy = _router()
    a, b = _fleet(2)
    _measured(router, [a, b], [250.0, 1000.0])  # a: 4x slower than b
    router.on_batch(a.key, 0, [_stored(DOC)])
    router.on_batch(b.key, 0, [])
    assert policy.select([a, b], _key(DOC + [1, 2, 3, 4])) is a  # 4 tokens there against 44 recomputed
    router.backlog.work[a.key] += 100  # 100 tokens queued on a: at a quarter of b's speed, b recomputes sooner
    assert policy.select([a, b], _key(DOC + [5, 6, 7, 8])) is b


def test_a_holder_whose_queued_recompute_is_nearly_computed_keeps_its_hit() -> None:
    """The queued work drains at the holder's measured rate: 100 tokens queued on a (250 tokens/s)
    send the next turn to b to be recomputed at first; 0.4 s later they are computed (their first
    token not back yet) and the turn stays on a, where it hits."""
    clock = FakeClock()
    router = KvRouter("tcp://127.0.0.1:1", clock=clock)
    router.configure("0.32.0", {})
    policy = KvAwarePolicy(router, "decode")
    a, b = _fleet(2)
    _measured(router, [a, b], [250.0, 1000.0])
    router.on_batch(a.key, 0, [_stored(DOC)])
    router.on_batch(b.key, 0, [])
    router.backlog.add(a.key, 100.0)  # a cold prompt routed to a at 0 s
    assert policy.select([a, b], _key(DOC + [5, 6, 7, 8])) is b
    router.backlog.remove(b.key, router.backlog.work[b.key])
    clock.now = 0.4
    assert router.queued(a) == 0.0 and router.backlog.work[a.key] == pytest.approx(100.0)
    assert policy.select([a, b], _key(DOC + [1, 2, 3, 4])) is a


def _capped_server(**cfg: object) -> ProxyServer:
    return ProxyServer(ProxyConfig(model="m", decode=["127.0.0.1:1"], flow="kv_both", **cfg))  # type: ignore[arg-type]


def test_an_instance_at_the_queue_cap_takes_no_more_while_another_has_room() -> None:
    """``kv_queue_cap`` 3: an instance at 3 requests (other clients' requests its engine reports
    count too) takes no prompt it does not hold while another has room; when every instance is
    at the cap the cap picks nothing."""
    server = _capped_server(scheduling="kv_aware", kv_queue_cap=3)
    router, policy = server.kv, server.policies["decode"]
    router.configure("0.32.0", {})
    a, b, c = _fleet(3)
    router.on_batch(a.key, 0, [_stored(DOC)])
    cold = list(range(500, 540))
    a.in_flight, b.in_flight, c.in_flight = 0, 1, 1
    assert policy.select([a, b, c], _key(cold)) is a  # the least queued: nothing cached anywhere
    router.settle("decode", _key(cold))
    router.backlog.work.clear()
    a.in_flight = 3
    assert policy.select([a, b, c], _key(cold + [1, 2, 3, 4])) is not a
    a.in_flight = 1  # and 2 more of other clients, from its engine's last answer
    a.engine = EngineLoad(at=time.monotonic(), max_age=60.0, running=3, ours=1)
    assert a.load == 3 and policy.select([a, b, c], _key(cold + [9, 9, 9, 9])) is not a
    assert router.counters[("capped", "decode")] == 2
    a.engine, a.in_flight, b.in_flight, c.in_flight = None, 3, 3, 3
    assert policy.select([a, b, c], _key(DOC + [8, 8, 8, 8])) is a  # no room anywhere: the holder
    assert router.counters[("capped", "decode")] == 2
    assert 'mooncake_proxy_kv_aware_capped_total{kind="decode"} 2' in router.render()


def test_the_queue_cap_never_moves_a_session_off_the_instance_that_holds_it() -> None:
    """At the cap, a turn that continues a prompt routed to the holder stays there (the cost
    model decides, as without the cap): the cap had sent it elsewhere to recompute the whole
    conversation. A new prompt on the same document goes where there is room, and so does a
    prompt that shares only a first block with the holder's."""
    server = _capped_server(scheduling="kv_aware", kv_queue_cap=3)
    router, policy = server.kv, server.policies["decode"]
    router.configure("0.32.0", {})
    a, b, c = _fleet(3)
    router.on_batch(a.key, 0, [_stored(DOC)])
    turn1 = DOC[:36] + [1, 2, 3, 4, 5]  # the first turn of a conversation on DOC, routed to a
    assert policy.select([a, b, c], _key(turn1)) is a
    router.on_batch(a.key, 1, [_stored(turn1)])  # its blocks are in a's cache
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 1
    turn2 = turn1 + [6, 7, 8, 9, 10, 11, 12]  # the next turn: it continues turn1
    assert policy.select([a, b, c], _key(turn2)) is a
    assert router.counters[("cap_held", "decode")] == 1
    assert router.counters[("capped", "decode")] == 0  # a stayed a candidate: nothing was left out
    assert 'mooncake_proxy_kv_aware_cap_held_total{kind="decode"} 1' in router.render()
    # another conversation on DOC: a holds its document but no turn of it, the cap applies
    assert policy.select([a, b, c], _key(DOC[:36] + [40, 41, 42, 43, 44])) is not a
    assert router.counters[("capped", "decode")] == 1
    # a holds only the first block of this prompt: not a hit worth keeping
    assert policy.select([a, b, c], _key(DOC[:4] + list(range(600, 636)))) is not a
    assert router.counters[("cap_held", "decode")] == 1
    # a holder past the 2x bound is still left out: the bound, not the cap, keeps a hot document in check
    a.in_flight, b.in_flight, c.in_flight = 6, 0, 0
    assert policy.select([a, b, c], _key(turn2 + [13, 14, 15, 16])) is not a
    # an instance that left rotation forgets its sessions: back at the cap, the turn moves
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 1
    a.healthy = False
    policy.select([b, c], _key(turn2))
    a.healthy = True
    router.on_batch(a.key, 0, [_stored(turn1)])
    assert policy.select([a, b, c], _key(turn2 + [17, 18, 19, 20])) is not a


@pytest.mark.parametrize("cap", [-1, "4", 2.5, True, None])
def test_a_queue_cap_that_is_not_a_count_is_refused_naming_the_field(cap: object) -> None:
    with pytest.raises(ConfigError, match="--kv-queue-cap.*whole number of requests") as info:
        _capped_server(scheduling="kv_aware", kv_queue_cap=cap)
    assert info.value.fields == ["--kv-queue-cap"]


def test_a_queue_cap_is_refused_where_nothing_would_use_it() -> None:
    with pytest.raises(ConfigError, match="--kv-queue-cap.*only --scheduling kv_aware"):
        _capped_server(scheduling="prefix", kv_queue_cap=4)
    assert _capped_server(scheduling="prefix", kv_queue_cap=0).kv is None


class _ScriptedReplay:
    """A replay client whose fetches answer from a script: ``(first seq, batches, complete)``."""

    endpoint, timeout = "tcp://127.0.0.1:2", 1.0

    def __init__(self, answers: list[tuple[int, int, bool]]) -> None:
        self.answers, self.starts = answers, []

    def fetch(self, start: int) -> ReplayAnswer | None:
        self.starts.append(start)
        first, n, complete = self.answers.pop(0)
        return ReplayAnswer([(first + i, [_stored([first + i] * BS)]) for i in range(n)], complete, 1)


def test_live_batches_wait_while_a_partial_replay_gets_somewhere() -> None:
    topic = "127.0.0.1:9000"
    router = KvRouter("tcp://127.0.0.1:1", replay={topic: "tcp://127.0.0.1:2"})
    router.on_batch(topic, 6, [_stored(DOC)])  # live, past a gap (0-5 not heard): waits for the replay
    replay = _ScriptedReplay([(0, 3, False), (3, 3, True)])
    assert router.catch_up(topic, replay)  # 0-2 came; the live batch keeps waiting
    assert router.indexes[topic].last_seq == 2 and router._pending[topic] and router._wake.is_set()
    assert router.catch_up(topic, replay)
    assert replay.starts == [0, 3]
    assert router.indexes[topic].last_seq == 6 and topic not in router._pending
    assert not any(key[0] == "index_drops" for key in router.counters)
    assert router.counters[("replays", "partial")] == 1 and router.counters[("replays", "ok")] == 1
    # a partial replay that got nothing lets the waiting batches in (the gap drops the index)
    router.on_batch(topic, 9, [_stored(DOC)])
    assert router.catch_up(topic, _ScriptedReplay([(7, 0, False)]))
    assert router.indexes[topic].last_seq == 9 and router.counters[("index_drops", "gap")] == 1


def test_prefills_still_running_do_not_make_an_instance_silent() -> None:
    """On a slow fleet several prompts reach an instance before its first prefill ends: only
    prefills done without any event count (the 2-core box's bench fell back to prefix in two
    of three repeats when routing itself counted)."""
    router, policy = _router()
    a, b = _fleet(2)
    router.on_batch(a.key, 0, [_stored(DOC)])
    keys = [_key([2000 + i] * 8) for i in range(6)]
    for key in keys:
        policy.select([a, b], key)  # routed, prefills running: nothing settled
    assert router.counters[("fallbacks", "decode", "no_events")] == 0
    assert sum(router.unheard_requests.values()) == 0
    on_b = [k for k in keys if k.unheard.get("decode") == b.key]
    assert len(on_b) >= router.silent_after  # the cost spread them: b got its share
    router.on_batch(b.key, 0, [])  # b's first prefill ended and published
    for key in keys:
        router.settle("decode", key)
    assert sum(router.unheard_requests.values()) == 0  # heard by the time they settled
