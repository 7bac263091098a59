"""SpeedTracker: prefill throughput from an engine's cumulative counters polled on a fake clock,
relative speeds bounded and drifting back to the fleet's mean. Driven through
``KvRouter.calibrate`` (the proxy's poll loop) with the engines' ``/metrics`` answers."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from mooncake_vllm.proxy.engine_load import EngineLoad
from mooncake_vllm.proxy.instances import Instance, parse_endpoint
from mooncake_vllm.proxy.kv_policy import KvRouter
from mooncake_vllm.proxy.kv_speed import Backlog, SpeedTracker


@dataclass
class FakeEngine:
    """A vLLM engine computing ``speed`` prefill tokens/s, shared evenly by the prefills running
    (processor sharing over its steps), with its ``/metrics`` histogram sums; ``decoding``
    requests count in ``running`` and take no prefill time."""

    speed: float
    tokens: float = 0.0  # vllm:request_prefill_kv_computed_tokens_sum
    seconds: float = 0.0  # vllm:request_prefill_time_seconds_sum
    decoding: int = 0
    prefills: list[list[float]] = field(default_factory=list)  # [tokens left, tokens, started at]

    def start(self, tokens: float, now: float) -> None:
        self.prefills.append([tokens, tokens, now])

    def step(self, now: float, dt: float) -> None:
        """Advance ``dt`` seconds in small slices; a prefill's tokens and time count when it ends."""
        slices = 100
        for k in range(1, slices + 1):
            if not self.prefills:
                return
            share = self.speed * dt / slices / len(self.prefills)
            t = now + dt * k / slices
            for p in list(self.prefills):
                p[0] -= share
                if p[0] <= 1e-9:
                    self.prefills.remove(p)
                    self.tokens += p[1]
                    self.seconds += t - p[2]

    def answer(self, at: float) -> EngineLoad:
        return EngineLoad(at=at, max_age=3.0, running=len(self.prefills) + self.decoding,
                          prefill_tokens=self.tokens, prefill_seconds=self.seconds)


class Fleet:
    """Instances with fake engines behind one router, polled every ``interval`` fake seconds."""

    def __init__(self, speeds: list[float], interval: float = 1.0) -> None:
        self.router = KvRouter("tcp://127.0.0.1:1")  # never started
        self.insts = [Instance("decode", parse_endpoint(f"127.0.0.1:{9000 + i}")) for i in range(len(speeds))]
        self.engines = [FakeEngine(s) for s in speeds]
        self.now, self.interval = 0.0, interval

    def poll(self) -> None:
        for inst, eng in zip(self.insts, self.engines):
            inst.engine = eng.answer(self.now)
        self.router.calibrate(self.insts)

    def run(self, seconds: float) -> None:
        for _ in range(round(seconds / self.interval)):
            for eng in self.engines:
                eng.step(self.now, self.interval)
            self.now += self.interval
            self.poll()

    def busy(self, rounds: int, seconds: float = 3.0, engines: slice = slice(None)) -> None:
        """``rounds`` times: each engine in ``engines`` takes ``seconds`` of prefill alone, then idles 1 s."""
        for _ in range(rounds):
            for eng in self.engines[engines]:
                eng.start(eng.speed * seconds, self.now)
            self.run(seconds + 1)

    def relative(self) -> list[float]:
        return self.router.speeds.relative([i.key for i in self.insts])

    def rate(self, i: int) -> float | None:
        return self.router.speeds.rate(self.insts[i].key)


def test_concurrent_prefills_do_not_read_slower() -> None:
    """Equal engines; one takes three 3000-token recomputes at once (each takes three times as
    long), the other one at a time: both read 1000 tokens/s (the per-request rate: 333 vs 1000)."""
    fleet = Fleet([1000.0, 1000.0])
    fleet.poll()
    a, b = fleet.engines
    for _ in range(3):
        a.start(3000, fleet.now)
    b.start(3000, fleet.now)
    fleet.run(3)
    b.start(3000, fleet.now)
    fleet.run(3)
    b.start(3000, fleet.now)
    fleet.run(4)
    assert a.seconds == pytest.approx(27.0, rel=0.02) and b.seconds == pytest.approx(9.0, rel=0.02)
    assert fleet.rate(0) == pytest.approx(1000.0, rel=0.05)
    assert fleet.rate(1) == pytest.approx(1000.0, rel=0.05)
    assert fleet.relative() == pytest.approx([1.0, 1.0], rel=0.05)


def test_a_fresh_proxy_does_not_inherit_another_runs_concurrency() -> None:
    """The engines' totals when the proxy starts carry no wall time (issue 29's speed-ab2: a
    prefix run had loaded one instance with concurrent recomputes, and a fresh kv_aware proxy
    read it 3x slower and sent it 3 of 144 requests): they are a baseline, not a rate."""
    fleet = Fleet([1000.0, 1000.0])
    a, b = fleet.engines
    a.tokens, a.seconds = 30_000, 90.0  # the run before: three at a time
    b.tokens, b.seconds = 30_000, 30.0  # one at a time
    fleet.poll()  # the new proxy's first reads
    assert fleet.relative() == [1.0, 1.0]
    a.start(1500, fleet.now)
    b.start(1500, fleet.now)
    fleet.run(2)
    assert fleet.relative() == [1.0, 1.0]  # 1500 tokens each: under min_tokens, not trusted yet
    a.start(1500, fleet.now)
    b.start(1500, fleet.now)
    fleet.run(2)
    assert fleet.relative() == pytest.approx([1.0, 1.0], rel=0.05)


def test_decoding_requests_do_not_make_an_instance_read_faster() -> None:
    """``running`` counts decodes too: an engine busy decoding while one prefill at a time runs
    reads its real rate (a rate times the running count would read it 4x faster)."""
    fleet = Fleet([500.0])
    fleet.poll()
    eng = fleet.engines[0]
    eng.decoding = 3
    for _ in range(4):
        eng.start(1500, fleet.now)
        fleet.run(5)  # 3 s of prefill, 2 s of decodes alone
    assert fleet.rate(0) == pytest.approx(500.0, rel=0.05)


def test_a_long_prefill_spanning_many_polls_is_timed_by_its_wall_time() -> None:
    """A prefill's tokens and seconds come at its end; the busy polls before join them."""
    fleet = Fleet([200.0])
    fleet.poll()
    eng = fleet.engines[0]
    for _ in range(2):  # two 10 s recomputes, two at a time: 2000 tokens in 10 s
        eng.start(1000, fleet.now)
        eng.start(1000, fleet.now)
        fleet.run(12)
    assert fleet.rate(0) == pytest.approx(200.0, rel=0.05)


def test_relative_speed_is_within_half_and_twice_the_fleet_mean() -> None:
    fleet = Fleet([300.0, 3000.0, 3000.0])
    fleet.poll()
    fleet.busy(3)
    assert fleet.rate(0) == pytest.approx(300.0, rel=0.05)
    rel = fleet.relative()  # measured 1 s ago: a deviation still 98 % of its own
    assert rel[0] == pytest.approx(0.5, rel=0.03)  # 0.22x the mean, bounded
    assert rel[1] == pytest.approx(rel[2]) and 1.0 < rel[1] <= 2.0


def test_an_instance_that_gets_no_requests_drifts_back_to_the_fleet_mean() -> None:
    """Measured slow, then sent nothing: half of its deviation goes every 30 s of computing
    nothing, so it is tried again (and re-measured) instead of starved all run."""
    fleet = Fleet([250.0, 1000.0, 1000.0])
    fleet.poll()
    fleet.busy(3)
    assert fleet.relative()[0] == pytest.approx(0.5, rel=0.03)  # 0.4x the mean, bounded
    fleet.busy(20, seconds=2.0, engines=slice(1, None))  # 60 s: the slow one gets nothing
    assert fleet.relative()[0] == pytest.approx(0.5 ** 0.25, rel=0.01)  # two half-lives
    fleet.engines[0].start(750, fleet.now)  # measured again: as slow as it was
    fleet.run(4)
    assert fleet.relative()[0] == pytest.approx(0.5, rel=0.03)


def test_nothing_to_measure_yet_a_restart_and_forgetting() -> None:
    s = SpeedTracker(horizon=10_000, min_tokens=1000)
    s.update("a", 0, 0, at=0.0)  # no prefill yet (or a release without the histograms)
    s.update("a", 500, 1.0, at=1.0)  # too few tokens to trust
    assert s.rate("a") is None and s.relative(["a", "b"]) == [1.0, 1.0]
    s.update("a", 5000, 10.0, at=10.0)
    s.update("a", 5000, 10.0, at=10.0)  # the same answer again (a failed scrape): nothing new
    assert s.rate("a") == pytest.approx(500.0)
    s.update("a", 3000, 1.0, at=11.0)  # counters went back: a restarted engine, a new baseline
    assert s.rate("a") is None
    s.update("a", 6000, 4.0, at=14.0)
    assert s.rate("a") == pytest.approx(1000.0)
    assert 'mooncake_proxy_kv_aware_prefill_rate{instance="a"} 1000.0' in s.render()
    s.forget("a")
    assert s.rate("a") is None


def _recomputes(t: SpeedTracker, now: float, totals: list[float], n: int) -> float:
    """``n`` 2000-token recomputes one after another at 500 tokens/s (4 s each, then a poll with the
    engine idle), polled each second; ``totals`` (tokens, seconds, requests) are bumped in place."""
    for _ in range(n):
        for k in range(5):
            now += 1.0
            if k == 4:
                totals[0], totals[1], totals[2] = totals[0] + 2000.0, totals[1] + 4.0, totals[2] + 1.0
            t.update("a", totals[0], totals[1], now, running=1.0 if k < 4 else 0.0, requests=totals[2])
    return now


def test_an_answer_whose_counters_went_back_and_came_back_is_skipped_not_a_restart() -> None:
    """A /metrics answer cut before the prefill histograms reads 0 tokens and 0 seconds. Taken for
    a restarted engine, the next whole answer brought the engine's whole history (60000 tokens of
    the runs before) as one poll's prefill: ~60000 tokens/s, decaying over the next minute (issue
    29: the CPU bench read 2026-19568 where recomputes ran at 250-900). Counters back where they
    were are the same engine, the answer between is skipped; a restarted engine's stay low."""
    t = SpeedTracker(min_tokens=1000.0)
    totals = [60_000.0, 300.0, 80.0]  # the engine's history when this proxy starts: a baseline
    t.update("a", totals[0], totals[1], at=0.0, requests=totals[2])
    now = _recomputes(t, 0.0, totals, 4)
    assert t.rate("a") == pytest.approx(500.0, rel=0.02)
    t.update("a", 0.0, 0.0, now + 0.5, running=1.0)  # a cut answer
    now = _recomputes(t, now, totals, 1)
    assert t.rate("a") == pytest.approx(500.0, rel=0.02)
    t.update("a", 0.0, 0.0, now + 0.5, running=1.0)  # two cut answers in a row
    t.update("a", 0.0, 0.0, now + 0.8, running=1.0)
    now = _recomputes(t, now, totals, 1)
    assert t.rate("a") == pytest.approx(500.0, rel=0.02)
    totals = [0.0, 0.0, 0.0]  # a restarted engine: a new baseline, measured on its own counters
    t.update("a", 0.0, 0.0, now + 1.0)
    assert t.rate("a") is None
    _recomputes(t, now + 1.0, totals, 2)
    assert t.rate("a") == pytest.approx(500.0, rel=0.02)


def test_hits_that_finish_during_a_recompute_leave_it_its_busy_time() -> None:
    """Hits finishing while a recompute runs are no samples, but the wall time before them was the
    recompute's too: dropping it with them left the recompute the time since the last hit, and
    read a 500 tokens/s engine at 2000 (issue 29). Wall time of hits alone between recomputes
    does not slow the rate: the recomputes' own seconds bound it."""
    t = SpeedTracker(min_tokens=1000.0)
    t.update("a", 0.0, 0.0, 0.0)
    tokens = seconds = requests = now = 0.0
    for _ in range(4):  # a 2000-token recompute at 500 tokens/s; a hit finishes in each of its first 3 s
        for k in range(1, 5):
            now += 1.0
            if k < 4:
                tokens, seconds, requests = tokens + 100.0, seconds + 0.2, requests + 1.0
            else:
                tokens, seconds, requests = tokens + 2000.0, seconds + 4.0, requests + 1.0
            t.update("a", tokens, seconds, now, running=1.0 if k < 4 else 0.0, requests=requests)
    assert t.rate("a") == pytest.approx(500.0, rel=0.02)
    for _ in range(20):  # 20 s of hits alone, then a recompute alone
        now, tokens, seconds, requests = now + 1.0, tokens + 100.0, seconds + 0.2, requests + 1.0
        t.update("a", tokens, seconds, now, requests=requests)
    for k in range(1, 5):
        now += 1.0
        if k == 4:
            tokens, seconds, requests = tokens + 2000.0, seconds + 4.0, requests + 1.0
        t.update("a", tokens, seconds, now, running=1.0 if k < 4 else 0.0, requests=requests)
    assert t.rate("a") == pytest.approx(500.0, rel=0.02)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _rated(rate: float | None) -> SpeedTracker:
    speeds = SpeedTracker()
    if rate is not None:  # one prefill at a time over 100 s of polls
        speeds.update("a", 0.0, 0.0, 0.0)
        speeds.update("a", rate * 100, 100.0, 100.0)
    return speeds


def test_the_backlog_drains_at_the_measured_rate_and_settles_first_in_first_out() -> None:
    clock = FakeClock()
    backlog = Backlog(_rated(250.0), clock)
    backlog.add("a", 2000.0)  # a recompute: 8 s at 250 tokens/s
    assert backlog.left("a") == pytest.approx(2000.0)
    clock.now = 6.0
    assert backlog.left("a") == pytest.approx(500.0)  # 2 s of it left
    backlog.add("a", 40.0)  # a hit behind it
    assert backlog.left("a") == pytest.approx(540.0)
    clock.now = 20.0
    assert backlog.left("a") == 0.0  # never below nothing, however long
    backlog.remove("a", 2000.0)  # the recompute's first token: the hit was computed too
    assert backlog.left("a") == 0.0 and backlog.work["a"] == pytest.approx(40.0)
    backlog.remove("a", 40.0)
    assert "a" not in backlog.work
    clock.now = 30.0  # idle time earns nothing towards the next request
    backlog.add("a", 100.0)
    assert backlog.left("a") == pytest.approx(100.0)


def test_an_unmeasured_engine_drains_nothing_and_settling_a_slow_head_keeps_the_rest() -> None:
    clock = FakeClock()
    backlog = Backlog(_rated(None), clock)
    backlog.add("a", 2000.0)
    clock.now = 60.0
    assert backlog.left("a") == pytest.approx(2000.0)  # no rate yet: all of it until its first token
    backlog = Backlog(_rated(100.0), clock)
    backlog.add("a", 2000.0)
    backlog.add("a", 500.0)
    clock.now = 65.0  # 500 of the first computed
    backlog.remove("a", 2000.0)
    assert backlog.left("a") == pytest.approx(500.0)


def test_hits_last_tokens_are_not_what_a_recompute_costs() -> None:
    """A hit computes its last ~100 tokens in one short step, far cheaper per token than a
    recompute: intervals whose finished prefills computed fewer than min_prefill tokens each
    on average are not samples of the rate, their busy time neither."""
    t = SpeedTracker(min_tokens=1000.0)
    t.update("a", 0.0, 0.0, 0.0, requests=0.0)
    t.update("a", 2000.0, 4.0, 4.0, running=1.0, requests=1.0)  # a 2k recompute: 500 tokens/s
    assert t.rate("a") == pytest.approx(500.0)
    now, tokens, seconds, requests = 4.0, 2000.0, 4.0, 1.0
    for _ in range(20):  # a hit a second: 100 tokens in 0.02 s each (5000 tokens/s)
        now, tokens, seconds, requests = now + 1.0, tokens + 100.0, seconds + 0.02, requests + 1.0
        t.update("a", tokens, seconds, now, running=0.0, requests=requests)
    assert t.rate("a") == pytest.approx(500.0)
    # an engine whose /metrics has no request count is measured as before
    u = SpeedTracker(min_tokens=1000.0)
    u.update("b", 0.0, 0.0, 0.0)
    u.update("b", 2000.0, 4.0, 4.0, running=1.0)
    u.update("b", 2100.0, 4.02, 5.0)
    assert u.rate("b") == pytest.approx(2100.0 / 4.02, rel=0.01)
