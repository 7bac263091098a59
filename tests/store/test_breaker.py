"""The circuit breaker policy: immutable, closed only by a reset, cool-down backed off.

Pure logic (a policy object and explicit times); the breaker on a real hung master
is tested in ``test_health.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from mooncake_vllm.store.breaker import Breaker


def test_closed_allows_open_refuses_however_long_it_stays_open() -> None:
    closed = Breaker(cooldown=1.0)
    assert closed.allows() and not closed.is_open
    tripped = closed.trip(10.0, "rpc failed")
    assert closed.allows(), "trip returns a new policy; the old one is unchanged"
    assert not tripped.allows() and tripped.is_open and tripped.reason == "rpc failed"
    assert tripped.probe_due(11.0) and not tripped.allows()  # only a probe may test the pool
    assert tripped.reset().allows()


def test_allows_needs_no_time() -> None:
    """Whether a call may go depends on the state only (the clock is the probe's business)."""
    assert Breaker().allows() is True
    with pytest.raises(TypeError):
        Breaker().allows(0.0)  # type: ignore[call-arg]


def test_the_probe_waits_a_cooldown_that_doubles_per_consecutive_trip_up_to_the_cap() -> None:
    b = Breaker(cooldown=1.0, max_cooldown=3.0)
    assert not b.probe_due(100.0)  # closed: nothing to probe
    b = b.trip(0.0, "x")
    assert not b.probe_due(0.99) and b.probe_due(1.0)
    b = b.trip(1.0, "x")  # the probe failed
    assert b.current_cooldown() == 2.0 and not b.probe_due(2.9) and b.probe_due(3.0)
    b = b.trip(3.0, "x")
    assert b.current_cooldown() == 3.0  # capped
    assert b.reset().trips == 0 and b.reset().trip(0.0, "x").current_cooldown() == 1.0


def test_the_policy_is_immutable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Breaker().opened_at = 1.0  # type: ignore[misc]
