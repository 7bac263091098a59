"""Counters: every name declared once, undeclared ones refused when strict, the rendering."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

from mooncake_vllm import stats
from mooncake_vllm.errors import UndeclaredCounterError
from mooncake_vllm.stats import STORE_COUNTERS, CounterNames, Counters, StoreStats
from mooncake_vllm.store.codes import Code
from mooncake_vllm.v1 import scheduler, worker

_SRC = Path(stats.__file__).parent


def _names_used(pattern: str, path: Path) -> set[str]:
    """Literal counter names a call pattern (one group) counts in a source file or package."""
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return {m for f in files for m in re.findall(pattern, f.read_text())}


def test_the_suite_runs_strict() -> None:
    assert stats.strict_counters() and StoreStats().strict


def test_an_undeclared_store_counter_raises_when_strict_and_counts_otherwise() -> None:
    with pytest.raises(UndeclaredCounterError, match="no_such_counter"):
        StoreStats(strict=True).add("no_such_counter")
    lax = StoreStats(strict=False)
    lax.add("no_such_counter", 2)
    assert lax.snapshot()["no_such_counter"] == 2


def test_every_store_counter_the_sources_count_is_declared() -> None:
    used = _names_used(r'stats\.add\(\s*"([a-z_]+)"', _SRC / "store")
    assert len(used) > 15  # the scan finds the call sites
    assert {n for n in used if not STORE_COUNTERS.declares(n)} == set()
    assert set(STORE_COUNTERS.initial) | STORE_COUNTERS.later == used


@pytest.mark.parametrize("op", ["put", "get"])
def test_each_mooncake_code_names_a_declared_failure_counter(op: str) -> None:
    for code in Code:
        assert STORE_COUNTERS.declares(f"{op}_failed_{code.name.lower()}")
    assert STORE_COUNTERS.declares(f"{op}_failed_other")
    assert not STORE_COUNTERS.declares(f"{op}_failed_")


def test_store_stats_start_with_the_initial_counters_only() -> None:
    assert StoreStats().snapshot() == dict.fromkeys(STORE_COUNTERS.initial, 0)


@pytest.mark.parametrize("module, pattern", [
    (worker, r'_count\(\s*"([a-z_]+)"'),
    (scheduler, r'counters\[\s*f?"([a-z_]+)"\]'),
], ids=["worker", "scheduler"])
def test_every_v1_counter_the_sources_count_is_declared(module, pattern: str) -> None:
    used = _names_used(pattern, Path(module.__file__))
    assert used
    assert {n for n in used if not module.COUNTERS.declares(n)} == set()


def test_counters_dict_refuses_undeclared_names_when_strict() -> None:
    names = CounterNames(initial=("a",), later=frozenset({"b"}), families=(r"f_[a-z]+",))
    c = Counters(names, strict=True)
    c["a"] += 2
    c["b"] += 1
    c["f_x"] += 1
    c["f_y"] = c.get("f_y", 0) + 3
    assert c == {"a": 2, "b": 1, "f_x": 1, "f_y": 3}
    with pytest.raises(UndeclaredCounterError):
        c["zzz"] += 1
    with pytest.raises(UndeclaredCounterError):
        c["zzz"] = 1
    lax = Counters(names, strict=False)
    lax["zzz"] = 1  # set as before
    with pytest.raises(KeyError):
        lax["yyy"] += 1  # as a plain dict of fixed names did


def test_counters_pickle_as_a_plain_dict() -> None:
    c = Counters(worker.COUNTERS, strict=True)
    c["saved_blocks"] += 3
    back = pickle.loads(pickle.dumps(c))
    assert type(back) is dict and back["saved_blocks"] == 3


def test_render_prometheus_names_counters_and_histograms() -> None:
    s = StoreStats(strict=True)
    s.add("hits", 3)
    s.observe("get", 0.002)
    text = s.render_prometheus()
    assert "mooncake_vllm_store_hits_total 3" in text
    assert 'mooncake_vllm_store_latency_seconds_bucket{op="get",le="0.0025"} 1' in text
    assert 'mooncake_vllm_store_latency_seconds_count{op="get"} 1' in text
