"""Scheduling policies (pure logic)."""

from __future__ import annotations

from collections import Counter

import pytest

from mooncake_vllm.errors import ConfigError
from mooncake_vllm.proxy.instances import Instance, parse_endpoint
from mooncake_vllm.proxy.scheduling import (
    LeastLoadedPolicy,
    PrefixAwarePolicy,
    RoundRobinPolicy,
    make_policy,
    under_bound,
)


def _insts(n: int) -> list[Instance]:
    return [Instance("decode", parse_endpoint(f"10.0.0.{i}:8000")) for i in range(n)]


def test_round_robin_cycles() -> None:
    insts, rr = _insts(3), RoundRobinPolicy()
    assert Counter(rr.select(insts, b"").key for _ in range(9)) == Counter({i.key: 3 for i in insts})


def test_least_loaded_prefers_fewest_in_flight_and_spreads_ties() -> None:
    insts, ll = _insts(3), LeastLoadedPolicy()
    insts[0].in_flight, insts[1].in_flight, insts[2].in_flight = 5, 1, 3
    assert all(ll.select(insts, b"") is insts[1] for _ in range(5))
    for i in insts:
        i.in_flight = 0
    assert len({ll.select(insts, b"").key for _ in range(3)}) == 3


def test_prefix_policy_is_sticky_stable_and_load_bounded() -> None:
    insts, pp = _insts(4), PrefixAwarePolicy(slack=2)
    prefixes = [f"system prompt {k}".encode() for k in range(40)]
    first = {p: pp.select(insts, p) for p in prefixes}
    assert len(set(first.values())) >= 3  # spreads different prefixes
    assert all(pp.select(insts, p) is first[p] for p in prefixes)  # sticky
    # removing one instance only moves the prefixes that were on it
    smaller = insts[:3]
    moved = [p for p in prefixes if first[p] in smaller and pp.select(smaller, p) is not first[p]]
    assert moved == []
    # overloaded owner: the least loaded instance takes the request
    p = prefixes[0]
    first[p].in_flight = 10
    assert pp.select(insts, p) is not first[p]


def test_make_policy_names_the_choices() -> None:
    assert isinstance(make_policy("prefix"), PrefixAwarePolicy)
    with pytest.raises(ConfigError, match="use one of round_robin, least_loaded, prefix"):
        make_policy("random")


def test_under_bound_keeps_each_instance_within_the_factor_of_the_mean() -> None:
    insts = _insts(3)
    for i, n in zip(insts, (4, 2, 1)):
        i.in_flight = n
    # 7 in flight + this one over 3 instances, x1.5: at most 4 each, so the one at 4 is out
    assert under_bound(insts, 1.5) == insts[1:]
    assert under_bound(insts, 2.0) == insts  # at most 6 each
    for i in insts:
        i.in_flight = 0
    assert under_bound(insts, 1.5) == insts  # an idle fleet: anyone
    insts[0].in_flight = 9
    assert under_bound(insts[:1], 1.5) == insts[:1]  # the only one takes it, however loaded
