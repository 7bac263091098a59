"""The claim policy: pure logic over made-up measurements and a fake clock."""

from __future__ import annotations

import pytest

from mooncake_vllm.v1.claims import ClaimAdvisor, ClaimRules, Decision
from tests.v1.claim_samples import BS, Clock, loads, prefill_steps


def advisor(clock: Clock, **rules: object) -> ClaimAdvisor:
    return ClaimAdvisor(ClaimRules(**rules), clock=clock)  # type: ignore[arg-type]


def test_a_prompt_longer_than_any_measured_prefill_is_weighed_against_a_floor() -> None:
    """Past the reach only a floor of the recompute is known: a load that beats it is claimed,
    one that does not is recomputed once (reach_probe), and then the model knows that far."""
    clock = Clock()
    short = [s for s in prefill_steps() if s[2] <= 8192]
    slow = advisor(clock, explore_every=1e9)
    slow.background = False
    slow.observe(steps=short, loads=loads(rate=20_000.0))
    assert slow.decide(0, 8192, BS).reason == "slow_pool"
    d = slow.decide(0, 16384, BS)
    assert (d.tokens, d.reason) == (0, "reach_probe")
    slow.observe(steps=[s for s in prefill_steps() if s[2] == 16384])  # vLLM recomputed it
    assert slow.decide(0, 16384, BS).reason == "slow_pool"
    assert slow.counts == {"slow_pool": 2, "reach_probe": 1}
    fast = advisor(clock, explore_every=1e9)
    fast.background = False
    fast.observe(steps=short, loads=loads(rate=400_000.0))
    d = fast.decide(0, 32768, BS)
    assert (d.tokens, d.reason) == (32768, "claimed")


def test_unmeasured_claims_everything_then_a_slow_pool_is_declined_and_a_fast_one_claimed() -> None:
    clock = Clock()
    a = advisor(clock)
    assert (a.decide(0, 8192, BS).tokens, a.decide(0, 8192, BS).reason) == (8192, "unmeasured")
    a.observe(steps=prefill_steps(), loads=loads(rate=20_000.0))  # 8k tokens: 0.41 s vs 0.24 s
    d = a.decide(0, 8192, BS)
    assert (d.tokens, d.reason) == (0, "slow_pool") and d.predicted_load > d.predicted_recompute
    fast = advisor(clock)
    fast.observe(steps=prefill_steps(), loads=loads(rate=400_000.0))  # 8k: ~0.03 s
    d = fast.decide(0, 8192, BS)
    assert (d.tokens, d.reason) == (8192, "claimed") and d.predicted_load < d.predicted_recompute
    assert fast.counts == {"claimed": 1}


def test_the_margin_declines_a_load_that_saves_too_little() -> None:
    clock = Clock()
    for margin, expected in ((0.0, "claimed"), (0.5, "slow_pool")):
        a = advisor(clock, margin=margin, explore_every=1e9)
        # a load costs ~80 % of the recompute
        recompute_8k = 2e-5 * 8192 + 1e-9 * 8192 * 4096
        rate = 8192 / (0.8 * recompute_8k - 0.01)
        a.observe(steps=prefill_steps(), loads=loads(rate=rate, l0=0.0))
        a.background = False
        assert a.decide(0, 8192, BS).reason == expected


def test_a_pool_that_slows_down_stops_being_claimed_and_comes_back_after_recovery() -> None:
    clock = Clock()
    a = advisor(clock, half_life=5.0, explore_every=10.0)
    a.observe(steps=prefill_steps(), loads=loads(rate=400_000.0))
    assert a.decide(0, 8192, BS).reason == "claimed"
    clock.now += 1
    a.observe(loads=[(8192.0, 3.0)] * 2)  # a busy holder: 8k tokens took 3 s, twice
    assert a.decide(0, 8192, BS).reason == "slow_pool"
    clock.now += 5
    assert a.decide(0, 8192, BS).reason == "slow_pool"  # within explore_every of the samples
    clock.now += 5
    probe = a.decide(0, 8192, BS)
    assert (probe.reason, probe.tokens) == ("explore", 2048)  # a quarter measures it again
    assert a.decide(0, 8192, BS).reason == "slow_pool"  # not two in a row
    clock.now += 1
    a.observe(loads=loads(rate=400_000.0)[:1])  # the probe was fast: one is not enough
    assert a.decide(0, 8192, BS).reason == "slow_pool"
    clock.now += 10
    assert a.decide(0, 8192, BS).reason == "explore"
    a.observe(loads=loads(rate=400_000.0)[:2])  # two more fast probes: the median is fast
    assert a.decide(0, 8192, BS).reason == "claimed"


def test_backlog_counts_against_the_claim() -> None:
    clock = Clock()
    a = advisor(clock, explore_every=1e9)
    a.observe(steps=prefill_steps(), loads=loads(rate=100_000.0))  # 2k: 0.025 s vs 0.05 s
    assert a.decide(0, 2048, BS).reason == "claimed"
    assert a.decide(0, 2048, BS, backlog=64_000).reason == "slow_pool"  # 0.66 s queued ahead


def test_what_a_claimed_load_took_around_its_transfer_counts_against_the_next_claim() -> None:
    """H200, 2026-12-05: an 8k hit was claimed at a predicted 117 ms (transfer + one 17 ms
    step) against 177 ms of recompute; it took 238 ms (transfer 157) against 203. Claimed
    loads reported over 2-5 steps after their transfer would end make the next claims
    weigh that, not one step."""
    from mooncake_vllm.v1.claims import ELAPSED_WINDOW

    clock = Clock()
    a = advisor(clock, explore_every=1e9)
    a.observe(steps=prefill_steps(), loads=loads(rate=100_000.0))  # 2k: 0.025 s vs 0.05 s
    assert a.wait(clock()) == pytest.approx(0.01)  # one step until measured
    assert a.decide(0, 2048, BS).reason == "claimed"
    transfer = a.loads.seconds(2048)
    assert transfer is not None
    for _ in range(ELAPSED_WINDOW):
        a.observe_elapsed(2048, transfer + 0.04)
    assert a.wait(clock()) == pytest.approx(0.04)
    assert a.decide(0, 2048, BS).reason == "slow_pool"
    assert a.decide(0, 16384, BS).reason == "claimed"  # a long hit still pays
    for _ in range(ELAPSED_WINDOW):  # the steps around loads got short again
        a.observe_elapsed(2048, transfer + 0.002)
    assert a.decide(0, 2048, BS).reason == "claimed"


def test_long_prompts_pay_where_short_ones_do_not() -> None:
    """Recompute grows faster than linearly (attention); a load does not."""
    clock = Clock()
    a = advisor(clock, explore_every=1e9)
    a.background = False
    a.observe(steps=prefill_steps(c0=0.01, c1=2e-5, c2=4e-9), loads=loads(rate=30_000.0, l0=0.0))
    assert a.decide(0, 2048, BS).reason == "slow_pool"
    d = a.decide(0, 32768, BS)
    assert d.reason == "claimed" and d.tokens == 32768


def test_always_and_never() -> None:
    clock = Clock()
    for policy, want in (("always", (8192, "always")), ("never", (0, "never"))):
        a = advisor(clock, policy=policy)
        a.observe(steps=prefill_steps(), loads=loads(rate=1.0))
        d = a.decide(0, 8192, BS)
        assert (d.tokens, d.reason) == want
    with pytest.raises(ValueError, match="load_policy"):
        ClaimRules(policy="sometimes")


def test_small_prefills_teach_no_per_token_cost() -> None:
    """On the H200 three 64-token prefills (16-41 ms, launch-bound, beside 19 ms decodes)
    fitted 210 us/token, 10x the truth: every 2k hit looked like 0.43 s of recompute and was
    claimed (2x slower than recomputing it). Such steps are not fitted."""
    clock = Clock()
    a = advisor(clock)
    a.observe(steps=[(1.0, 100.0, 100.0, 0.019)] * 9, loads=loads(rate=40_000.0))
    a.observe(steps=[(64.0, 2048.0, 64.0, 0.0415), (64.0, 2048.0, 64.0, 0.0202),
                     (64.0, 2048.0, 64.0, 0.0162)])
    assert a.decide(0, 2032, BS).reason == "unmeasured"
    a.observe(steps=[(8192.0, 8192 * 4096.0, 8192.0, 0.21), (7808.0, 7808 * (8192 + 3904.0), 16000.0, 0.27),
                     (4096.0, 4096 * 2048.0, 4096.0, 0.1)])
    recompute = a.prefill.recompute(clock(), 0, 2032)
    assert recompute is not None and 0.03 < recompute < 0.07  # truth on the H200: ~0.05 s
    assert a.decide(0, 2032, BS).reason in ("slow_pool", "explore")


def test_one_or_two_loads_decide_nothing_however_slow_the_first_was() -> None:
    """H200, a fresh engine: its first load (1008 tokens) took 0.256 s beside the first saves,
    its second (496 tokens) 0.022 s; a shape over those two priced 8k-32k loads at many times
    their recompute and every later hit was declined (measured loads: 0.30 s for 16k)."""
    clock = Clock()
    a = advisor(clock, explore_every=1e9)
    a.observe(steps=prefill_steps(), loads=[(1008.0, 0.256), (496.0, 0.022)])
    d = a.decide(0, 15984, BS)
    assert (d.tokens, d.reason) == (15984, "unmeasured")
    a.observe(loads=[(15984.0, 0.30)])  # the third: a model now, and the outlier a third of it
    assert a.decide(0, 15984, BS).reason == "claimed"


def test_a_first_time_shape_is_left_out_of_the_recompute_fit() -> None:
    """The H200 reader's warm-up: 1k 32 ms, 2k 49 ms, 4k **382 ms** (its first 4k prefill),
    1k 24 ms, beside 16 ms decodes; fitted as is, a 2k recompute cost 84 ms and every 2k hit
    was claimed (100-111 ms against 54 ms recomputed)."""
    clock = Clock()
    a = advisor(clock)
    a.observe(steps=[(1.0, 100.0, 100.0, 0.0165)] * 9,
              loads=[(256.0, 0.0054), (512.0, 0.0116), (1008.0, 0.013)])  # the load probe
    a.observe(steps=[(1024.0, 524288.0, 1024.0, 0.0323), (2048.0, 2097152.0, 2048.0, 0.0491),
                     (4096.0, 8388608.0, 4096.0, 0.3825), (1024.0, 524288.0, 1024.0, 0.0244)])
    assert a.prefill.outliers == 1
    recompute = a.prefill.recompute(clock(), 0, 2032)
    assert recompute is not None and recompute < 0.045
    assert a.decide(0, 2032, BS).tokens == 0
    # steps that stay that slow are the truth: at most two in a row are left out
    for _ in range(3):
        a.observe(steps=[(4096.0, 8388608.0, 4096.0, 0.3825)])
    assert a.prefill.outliers <= 3 and len(a.prefill.samples) >= 4


def test_a_first_time_shape_is_left_out_before_any_decode_is_measured() -> None:
    """The H200 reader of 2026-12-05 12:00: its warm-up misses came before any decode (no fixed
    step cost yet): 1k 26.7 ms, 2k 49 ms, 4k **298 ms** (2.98x what the first two predicted),
    1k 24.8 ms; fitted as is, an 8k recompute cost 0.75 s (truth ~0.2 s) and an 8k hit whose load
    took 0.21 s was claimed."""
    clock = Clock()
    a = advisor(clock)
    a.observe(loads=[(256.0, 0.043), (512.0, 0.036), (1008.0, 0.022)])  # its load probe
    a.observe(steps=[(1024.0, 524288.0, 1024.0, 0.0267), (2048.0, 2097152.0, 2048.0, 0.049),
                     (4096.0, 8388608.0, 4096.0, 0.2977), (1024.0, 524288.0, 1024.0, 0.0248)])
    assert a.prefill.outliers == 1
    a.observe(steps=[(1.0, 100.0, 100.0, 0.014)] * 9)  # decodes since
    d = a.decide(0, 7984, BS)
    assert d.tokens == 0 and d.predicted_recompute < 0.3  # truth on the H200: ~0.2 s


def test_short_hits_are_not_explored_long_ones_are() -> None:
    """H200, run R of 2026-12-04: the second 2k hit (49 ms to recompute, 2.4 engine steps of
    21 ms) was spent on an exploring quarter-hit load, 102 ms."""
    clock = Clock()
    a = advisor(clock, explore_every=5.0)
    a.observe(steps=[(1.0, 100.0, 100.0, 0.0207)] * 9 + prefill_steps(c0=0.0207, c1=1.7e-5),
              loads=[(256.0, 0.0054), (512.0, 0.0116), (1008.0, 0.013)])
    a.observe(loads=[(2032.0, 0.3)] * 3)  # a slow pool: nothing pays
    clock.now += 10
    short = a.decide(0, 2032, BS)
    assert short.reason == "slow_pool" and short.predicted_recompute < 4 * 0.0207
    probe = a.decide(0, 16000, BS)
    assert probe.reason == "explore" and probe.tokens == 4000


def test_declines_any_hit_answers_without_deciding() -> None:
    """Where even the whole hit is declined no part of it pays (the load/recompute ratio
    falls with length), so the scheduler may skip the lookup; nothing is recorded."""
    clock = Clock()
    fresh = advisor(clock, explore_every=5.0)
    assert not fresh.declines_any_hit(0, 512, BS)  # unmeasured: a hit is claimed
    a = advisor(clock, explore_every=5.0)
    a.observe(steps=[(1.0, 100.0, 100.0, 0.0207)] * 9 + prefill_steps(c0=0.0207, c1=1.7e-5),
              loads=[(256.0, 0.0054), (512.0, 0.0116), (1008.0, 0.013)])
    assert not a.declines_any_hit(0, 16000, BS)  # the probe says the pool pays
    a.observe(loads=[(2032.0, 0.3)] * 3)  # then a slow pool
    clock.now += 10
    for tokens in (64, 512, 2032):
        assert a.declines_any_hit(0, tokens, BS)
        assert all(a.decide(0, n, BS).tokens == 0 for n in range(BS, tokens + 1, BS))
    assert not a.declines_any_hit(0, 16000, BS)  # an explore is due on a long hit
    assert a.declines_any_hit(0, 2032, BS)
    assert a.counts == {"slow_pool": 2032 // BS + 512 // BS + 64 // BS}  # decide() only
    assert a.decide(0, 16000, BS).reason == "explore"
    assert a.declines_any_hit(0, 16000, BS)  # explored: declined until the next is due
    assert not a.declines_any_hit(0, 50000, BS)  # beyond the reach: recomputed once to learn
    for policy in ("always", "never"):
        other = advisor(clock, policy=policy)
        other.observe(steps=prefill_steps(), loads=[(2032.0, 0.3)] * 3)
        assert not other.declines_any_hit(0, 512, BS)


def test_an_engine_that_only_hits_measures_a_prefill_now_and_then() -> None:
    """H200 mixed serving, 2026-12-05: every prompt was a pool or prefix-cache hit, so the
    reader never prefilled and claimed all 384 hits 'unmeasured', 96-token ones too (7-8 ms
    loads where recomputing them costs ~2 ms). With the loads measured, after MEASURE_AFTER
    unmeasured claims a hit long enough to be a sample is recomputed, one per explore_every;
    shorter hits and a fresh engine's first hits are still claimed."""
    from mooncake_vllm.v1.claims import MEASURE_AFTER, MIN_FIT

    clock = Clock()
    a = advisor(clock, explore_every=5.0)
    a.observe(loads=loads(rate=100_000.0))  # a probe at start: the loads are measured
    for _ in range(MEASURE_AFTER):
        assert a.decide(0, 2048, BS).reason == "unmeasured"
    assert (a.decide(2048, 96, BS).tokens, a.counts["unmeasured"]) == (96, MEASURE_AFTER + 1)
    d = a.decide(0, 2048, BS)
    # the rest of the hit is claimed: vLLM computes its last MIN_FIT tokens, one prefill sample
    assert (d.tokens, d.reason) == ((2048 - MIN_FIT) // BS * BS, "measure_probe")
    assert 2048 - d.tokens >= MIN_FIT
    assert a.decide(0, 2048, BS).reason == "unmeasured"  # one per explore_every
    assert a.decide(0, MIN_FIT - BS, BS).reason == "unmeasured"  # too short to be a sample
    clock.now += 5.0
    assert a.decide(0, 2048, BS).reason == "measure_probe"
    a.observe(steps=prefill_steps())  # what vLLM's recomputes taught
    clock.now += 5.0
    assert a.decide(0, 2048, BS).reason in ("claimed", "slow_pool", "explore")
    assert a.decide(2048, 96, BS).reason in ("slow_pool", "claimed")


def test_a_measure_probe_recomputes_only_a_tail_unless_loads_are_synchronous() -> None:
    """Dev box, 2026-12-05: an engine that only hit the pool recomputed its ninth hit, 8k
    tokens, in 7.3 s where its load took 0.24 s. A measure probe claims all but the last
    MIN_FIT tokens (whole chunks); a hit too short to keep any chunk, or synchronous loads
    (the step computing the tail would time the load too), recompute the whole hit."""
    from mooncake_vllm.v1.claims import MEASURE_AFTER, MIN_FIT

    for background, want in ((True, 8000 - MIN_FIT), (False, 0)):
        clock = Clock()
        a = ClaimAdvisor(ClaimRules(), clock=clock, background=background)
        a.observe(loads=loads(rate=100_000.0))
        for _ in range(MEASURE_AFTER):
            a.decide(0, 8000, 16)
        d = a.decide(0, 8000, 16)
        assert (d.tokens, d.reason) == (want, "measure_probe")
    clock.now += 10.0
    a = advisor(clock)
    a.observe(loads=loads(rate=100_000.0))
    for _ in range(MEASURE_AFTER):
        a.decide(0, 2048, BS)
    assert a.decide(0, MIN_FIT, BS) == Decision(0, "measure_probe")  # no whole chunk left to claim


def test_no_measure_probe_before_the_loads_are_measured() -> None:
    """A CPU engine has no load probe: its first hits measure the pool, and are claimed."""
    from mooncake_vllm.v1.claims import MEASURE_AFTER

    clock = Clock()
    a = advisor(clock)
    for _ in range(2 * MEASURE_AFTER):
        assert a.decide(0, 2048, BS).reason == "unmeasured"


def test_a_measure_probe_is_decided_at_the_lookup_not_by_skipping_it() -> None:
    """declines_any_hit lets the scheduler skip a lookup as 'slow_pool'; a hit due for a
    measure probe is not that (its lookup decides it, counted as measure_probe)."""
    from mooncake_vllm.v1.claims import MEASURE_AFTER, MIN_FIT

    clock = Clock()
    a = advisor(clock)
    a.observe(loads=loads(rate=100_000.0))
    for _ in range(MEASURE_AFTER):
        a.decide(0, 2048, BS)
    assert not a.declines_any_hit(0, MIN_FIT, BS)
    assert a.decide(0, MIN_FIT, BS).reason == "measure_probe"
    assert "load_wait" in a.snapshot() and a.snapshot()["elapsed"] == []


def test_a_hand_off_decode_is_never_the_measure_probe() -> None:
    """CI, 1P1D on the CPU engine: the decode never prefills, so after 8 unmeasured claims
    measure probes recomputed 3 of 24 hand-offs. A decode exists not to prefill."""
    from mooncake_vllm.v1.claims import MEASURE_AFTER

    clock = Clock()
    a = advisor(clock)
    a.observe(loads=loads(rate=100_000.0))
    for _ in range(2 * MEASURE_AFTER):
        assert a.decide(0, 2048, BS, probe=False).reason == "unmeasured"
    assert a.decide(0, 2048, BS).reason == "measure_probe"  # another request may be


def test_blind_claims_do_not_queue_behind_each_other() -> None:
    """H100 mixed serving, 2026-12-05: a fresh reader (loads measured by its probe, no prefill
    yet) claimed 8 documents' 2k hits in one burst; one loader took them in turn and reported
    them over 75-630 ms after their claims, where each recompute took ~50 ms. With a load in
    flight, a blind hit long enough to be a sample is recomputed instead (and measures the
    prefills); alone, a short one, or a hand-off's decode is still claimed."""
    from mooncake_vllm.v1.claims import MIN_FIT

    clock = Clock()
    a = advisor(clock)
    a.observe(loads=loads(rate=100_000.0))
    assert a.decide(0, 2048, BS).reason == "unmeasured"  # nothing in flight
    d = a.decide(0, 2048, BS, backlog=2048)
    assert (d.tokens, d.reason) == (0, "measure_probe")
    assert a.decide(0, 2048, BS, backlog=2048).reason == "measure_probe"  # every one of a burst
    assert a.decide(0, MIN_FIT - BS, BS, backlog=2048).reason == "unmeasured"  # not a sample
    assert a.decide(0, 2048, BS, backlog=2048, probe=False).reason == "unmeasured"
    b = advisor(clock)  # loads unmeasured too (a CPU engine): its first hits measure the pool
    assert b.decide(0, 2048, BS, backlog=2048).reason == "unmeasured"


def test_where_workers_probe_a_declining_policy_explores_without_a_request() -> None:
    """H100, 2026-12-05: an 8k hit whose quarter was claimed to measure the pool (explore)
    took 259 ms against 211 to recompute. Where the workers run background probes, no part
    of a request's hit is claimed to explore: the scheduler asks for a probe instead, after a
    decline, at most once per explore_every since the last probe or load."""
    clock = Clock()
    a = advisor(clock, half_life=5.0, explore_every=10.0)
    a.observe(steps=prefill_steps(), loads=loads(rate=400_000.0), probes=True)
    assert a.probes_available and a.decide(0, 8192, BS).reason == "claimed"
    clock.now += 1
    a.observe(loads=[(8192.0, 3.0)] * 2)  # a busy holder
    assert not a.take_probe()  # nothing declined yet
    assert a.decide(0, 8192, BS).reason == "slow_pool"
    assert not a.take_probe()  # within explore_every of the last load
    clock.now += 10
    assert a.decide(0, 8192, BS).reason == "slow_pool"  # no quarter claimed: no explore
    assert a.take_probe() and not a.take_probe()  # one probe, then explore_every again
    clock.now += 1
    a.observe(loads=loads(rate=400_000.0)[:3])  # the probe's three loads were fast
    assert a.decide(0, 8192, BS).reason == "claimed"
    assert a.counts["background_probe"] == 1 and "explore" not in a.counts


def test_only_a_declined_hit_worth_exploring_asks_for_a_probe() -> None:
    """A short span is declined whatever the pool's speed (its load's fixed cost): most of a
    serving engine's lookups are those, and a probe every explore_every for them would
    measure the pool for nothing. A declined hit whose recompute costs EXPLORE_STEPS engine
    steps asks for one."""
    clock = Clock()
    a = advisor(clock, explore_every=10.0)
    a.observe(steps=prefill_steps(), loads=loads(rate=10_000.0), probes=True)  # a slow pool
    clock.now += 10
    assert a.declines_any_hit(0, 256, BS)  # the scheduler skips this lookup
    assert a.decide(0, 256, BS).reason == "slow_pool"
    assert not a.take_probe()
    assert a.decide(0, 16000, BS).reason == "slow_pool"
    assert a.take_probe()


def test_a_declined_hit_found_after_its_skipped_lookup_asks_for_a_probe() -> None:
    """The scheduler no longer looks up a long span no hit of which would be claimed: the
    admission's answer tells the policy later (note_declined), which then measures the pool
    again, as after a decided decline — so claims come back when the pool recovers."""
    clock = Clock()
    a = advisor(clock, explore_every=10.0)
    a.observe(steps=prefill_steps(), loads=loads(rate=10_000.0), probes=True)  # a slow pool
    clock.now += 10
    assert a.declines_any_hit(0, 16000, BS)  # the scheduler skips this lookup
    assert not a.take_probe()  # declines_any_hit records nothing
    a.note_declined(0, 256)  # a short hit: never worth a probe
    assert not a.take_probe()
    a.note_declined(0, 16000)
    assert a.take_probe() and a.counts["slow_pool_unasked"] == 2


def test_two_prefills_decide_a_fresh_engines_short_hits() -> None:
    """The H100 of 2026-12-06: a fresh reader had its load probe (256 / 512 / 1008 tokens in
    5 / 10 / 16 ms), decodes of 11 ms and two warm-up prefills (1k 26.5 ms, 2k 47.8 ms); waiting
    for a third, it claimed its 2k hits blind: 63-68 ms against 46 recomputed. Two decide:
    the 2k hit is declined, the 8k and 16k hits (0.72 and 0.52 of their recompute) claimed."""
    clock = Clock()
    a = advisor(clock)
    a.observe(steps=[(1.0, 100.0, 100.0, 0.0111)] * 9,
              loads=[(256.0, 0.00477), (512.0, 0.00971), (1008.0, 0.01601)])
    a.observe(steps=[(1024.0, 524288.0, 1024.0, 0.02653)])
    assert a.decide(0, 2032, BS).reason == "unmeasured"  # one prefill fits nothing
    a.observe(steps=[(2048.0, 2097152.0, 2048.0, 0.04779)])
    d = a.decide(0, 2032, BS)
    assert (d.tokens, d.reason) == (0, "slow_pool")
    assert 0.030 < d.predicted_recompute < 0.040  # measured: 35.6 ms by the later, fuller fit
    for hit in (7984, 15984):
        d = a.decide(0, hit, BS)
        assert (d.tokens, d.reason) == (hit, "claimed")


def test_a_recompute_fit_needs_at_least_two_prefills() -> None:
    with pytest.raises(ValueError, match="min_prefills"):
        ClaimRules(min_prefills=1)
