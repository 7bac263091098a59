"""Connector stats: the per-step deltas, their aggregation, and the Prometheus series.

Pure logic with vLLM's own base classes and a private Prometheus registry; the
counters in a real server's /metrics are tested in ``test_telemetry.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mooncake_vllm.stats import StoreStats
from mooncake_vllm.v1.connector import MooncakeStoreConnector
from mooncake_vllm.v1.metrics import COUNTERS, OPS, Meter, PoolPromMetrics, PoolStats, pool_up


def _stats(counters: dict[str, int], latency: dict[str, list[float]] | None = None,
           up: dict[str, int] | None = None) -> PoolStats:
    return PoolStats(data={"counters": counters, "latency": latency or {}, "pool_up": up or {}})


def test_aggregate_adds_counters_appends_samples_and_takes_pool_state() -> None:
    a = _stats({"loaded_blocks": 2, "lookups": 1}, {"load": [0.1]}, {"tp0-pp0": 1})
    b = _stats({"loaded_blocks": 3}, {"load": [0.3], "save": [0.2]}, {"tp1-pp0": 0})
    assert a.aggregate(b) is a
    assert a.data == {"counters": {"loaded_blocks": 5, "lookups": 1},
                      "latency": {"load": [0.1, 0.3], "save": [0.2]},
                      "pool_up": {"tp0-pp0": 1, "tp1-pp0": 0}}
    assert a.reduce() == {"loaded_blocks": 5, "lookups": 1, "load_count": 2, "load_avg_ms": 200.0,
                          "save_count": 1, "save_avg_ms": 200.0, "pool_up": 0}
    assert not a.is_empty() and PoolStats().is_empty()
    assert a.aggregate(PoolStats()).data["counters"]["loaded_blocks"] == 5


def test_stats_survive_vllms_serialisation_and_the_class_hook() -> None:
    a = _stats({"saved_blocks": 4}, {"save": [0.01]}, {"scheduler": 1})
    data = msgspec.msgpack.decode(msgspec.msgpack.encode(a.data))
    again = MooncakeStoreConnector.build_kv_connector_stats(data)
    assert isinstance(again, PoolStats) and again.data == a.data
    assert MooncakeStoreConnector.build_kv_connector_stats().is_empty()


def test_meter_reports_only_what_changed_since_the_last_step() -> None:
    meter = Meter("scheduler")
    first = meter.take({"lookups": 2, "hit_tokens": 0}, up=1)
    assert first is not None and first.data == {"counters": {"lookups": 2}, "latency": {},
                                                "pool_up": {"scheduler": 1}}
    assert meter.take({"lookups": 2, "hit_tokens": 0}, up=1) is None  # nothing new
    timed = meter.timed("lookup", lambda keys: [True] * len(keys))
    assert timed(["a", "b"]) == [True, True]
    later = meter.take({"lookups": 3, "hit_tokens": 64}, up=0)
    assert later is not None
    assert later.data["counters"] == {"lookups": 1, "hit_tokens": 64}
    assert len(later.data["latency"]["lookup"]) == 1 and later.data["pool_up"] == {"scheduler": 0}


class _Breaker:
    def __init__(self, is_open: bool) -> None:
        self.is_open = is_open


class _Client:
    def __init__(self, is_open: bool) -> None:
        self.health = type("H", (), {"breaker": _Breaker(is_open)})()


class _Source:
    def __init__(self, client: Any) -> None:
        self.client = client

    def get(self) -> Any:
        return self.client


def test_pool_up_is_connected_and_breaker_closed() -> None:
    assert pool_up(_Source(None)) == 0
    assert pool_up(_Source(_Client(is_open=True))) == 0
    assert pool_up(_Source(_Client(is_open=False))) == 1


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})


@pytest.fixture
def prom() -> tuple[PoolPromMetrics, CollectorRegistry]:
    registry = CollectorRegistry()

    def bind(cls: type) -> Any:
        return lambda **kw: cls(registry=registry, **kw)

    types = {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)}
    config = type("Cfg", (), {"kv_transfer_config": None})()
    return PoolPromMetrics(config, types, ["model_name", "engine"], {0: ["m", "0"]}), registry


def test_prometheus_series_exist_from_the_start_and_add_up(prom: Any) -> None:
    metrics, registry = prom
    for name in COUNTERS:
        assert _value(registry, f"vllm:mooncake_vllm_{name}_total") == 0.0
    for op in OPS:
        assert _value(registry, f"vllm:mooncake_vllm_{op}_seconds_count") == 0.0
    stats = _stats({"saved_blocks": 8, "saved_bytes": 8 * 32768, "dropped_blocks": 0},
                   {"save": [0.004, 0.2]}, {"tp0-pp0": 1})
    metrics.observe(stats.data, 0)
    metrics.observe(_stats({"saved_blocks": 1}, up={"tp0-pp0": 0}).data, 0)
    metrics.observe({}, 0)
    assert _value(registry, "vllm:mooncake_vllm_saved_blocks_total") == 9
    assert _value(registry, "vllm:mooncake_vllm_saved_bytes_total") == 8 * 32768
    assert _value(registry, "vllm:mooncake_vllm_save_seconds_count") == 2
    assert _value(registry, "vllm:mooncake_vllm_save_seconds_bucket", le="0.005") == 1
    assert _value(registry, "vllm:mooncake_vllm_save_seconds_sum") == pytest.approx(0.204)
    assert _value(registry, "vllm:mooncake_vllm_pool_up", side="tp0-pp0") == 0


def test_misses_caused_by_an_error_are_one_labelled_series(prom: Any) -> None:
    """vllm:mooncake_vllm_miss_causes_total{cause}: every cause present at 0, deltas add."""
    from mooncake_vllm.store.misses import MISS_CAUSES

    metrics, registry = prom
    for cause in MISS_CAUSES:
        assert _value(registry, "vllm:mooncake_vllm_miss_causes_total", cause=cause) == 0.0
    metrics.observe(_stats({"miss_causes:load_timeout": 16, "miss_causes:pool_away": 3}).data, 0)
    metrics.observe(_stats({"miss_causes:load_timeout": 4}).data, 0)
    assert _value(registry, "vllm:mooncake_vllm_miss_causes_total", cause="load_timeout") == 20
    assert _value(registry, "vllm:mooncake_vllm_miss_causes_total", cause="pool_away") == 3


def test_each_side_exports_only_its_own_miss_causes() -> None:
    """Scheduler and worker may share one client in one process: lookups' causes go out with
    the scheduler, loads' with the worker, so nothing is counted twice."""
    from mooncake_vllm.stats import Counters
    from mooncake_vllm.v1.metrics import scheduler_counters, worker_counters
    from mooncake_vllm.v1.scheduler import COUNTERS

    stats = StoreStats(strict=True)
    stats.add("miss_pool_away", 2)
    stats.add("miss_load_timeout", 5)
    client = SimpleNamespace(stats=stats)
    sched = SimpleNamespace(counters=Counters(COUNTERS))  # later names read 0 until counted
    worker = SimpleNamespace(counters={"loaded_blocks": 0, "failed_blocks": 5, "saved_blocks": 0},
                             layout=None)
    s = {k: v for k, v in scheduler_counters(sched, client).items() if k.startswith("miss")}
    w = {k: v for k, v in worker_counters(worker, client).items() if k.startswith("miss")}
    assert s == {"miss_causes:pool_away": 2}
    assert w == {"miss_causes:load_timeout": 5}
