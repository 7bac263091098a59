"""Loads in flight, as the scheduler tracks them: pure logic with a fake clock."""

from __future__ import annotations

from mooncake_vllm.v1.inflight import InflightLoads


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_chunk_is_brought_by_the_first_load_that_planned_it() -> None:
    clock = Clock()
    loads = InflightLoads(clock, expire_after=120.0)
    loads.add("a", ["x", "y"], 32)
    loads.add("b", ["y", "z"], 32)
    assert loads.brought_by_another("b", ["y"]) and not loads.brought_by_another("a", ["x", "y"])
    assert not loads.brought_by_another("c", ["w"]) and loads.tokens() == 64
    clock.now += 0.5
    assert loads.over(["a", "nobody"]) == [("a", 32, 0.5)]
    assert not loads.brought_by_another("b", ["y"]) and loads.tokens() == 32
    assert loads.over(["a"]) == []  # reported twice: once is what counts


def test_a_load_never_reported_over_stops_counting_after_expire_after() -> None:
    clock = Clock()
    loads = InflightLoads(clock, expire_after=120.0)
    loads.add("a", ["x"], 16)
    clock.now += 119.0
    assert loads.tokens() == 16 and loads.brought_by_another("b", ["x"])
    clock.now += 2.0
    assert loads.tokens() == 0 and not loads.brought_by_another("b", ["x"])
