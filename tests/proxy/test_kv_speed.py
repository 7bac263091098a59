"""SpeedTracker: prefill rates from an engine's cumulative counters, relative speeds."""

from __future__ import annotations

import pytest

from mooncake_vllm.proxy.kv_speed import SpeedTracker


def test_the_engines_totals_seed_the_rate_and_new_work_soon_outweighs_them() -> None:
    s = SpeedTracker(horizon=10_000, min_tokens=1000)
    s.update("a", 100_000, 100.0)  # 1000 tokens/s since it started, capped to the horizon's weight
    assert s.rate("a") == pytest.approx(1000.0)
    for k in range(1, 6):  # from now on it computes at 250 tokens/s
        s.update("a", 100_000 + 10_000 * k, 100.0 + 40.0 * k)
    assert s.rate("a") == pytest.approx(250.0, rel=0.05)


def test_nothing_to_measure_yet_or_a_restart() -> None:
    s = SpeedTracker(horizon=10_000, min_tokens=1000)
    s.update("a", 0, 0)  # no prefill yet (or a release without the histograms)
    s.update("b", 500, 1.0)  # too few tokens to trust
    assert s.rate("a") is None and s.rate("b") is None
    s.update("b", 5000, 10.0)
    s.update("b", 5000, 10.0)  # the same answer again: nothing new
    assert s.rate("b") == pytest.approx(500.0)
    s.update("b", 3000, 1.0)  # counters went back: a restarted engine, measured afresh
    assert s.rate("b") == pytest.approx(3000.0)
    s.forget("b")
    assert s.rate("b") is None


def test_relative_speeds_are_over_the_measured_ones_and_clamped() -> None:
    s = SpeedTracker(min_tokens=1, clamp=4.0)
    assert s.relative(["a", "b"]) == [1.0, 1.0]
    s.update("a", 1000, 1.0)
    s.update("b", 4000, 1.0)
    assert s.relative(["a", "b", "new"]) == pytest.approx([0.5, 2.0, 1.0])
    s.update("c", 1_000_000, 1.0)
    assert s.relative(["a", "c"])[1] == 4.0  # at most clamp x the mean
    assert 'mooncake_proxy_kv_aware_prefill_rate{instance="b"} 4000.0' in s.render()
