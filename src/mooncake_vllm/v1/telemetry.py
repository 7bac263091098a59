"""Wires :mod:`.metrics` and :mod:`.events` onto one connector side.

The connector's vLLM hooks (``get_kv_connector_stats``, ``get_kv_connector_kv_cache_events``,
``update_connector_output``, ``take_events``) delegate here; this is the only
place that knows which side carries what.
"""

from __future__ import annotations

import logging
from typing import Any

from mooncake_vllm.v1.events import PoolKVEvents, SchedulerEvents, WorkerEvents, kv_events_wanted
from mooncake_vllm.v1.metrics import (
    Meter,
    MeteredSource,
    PoolStats,
    pool_up,
    scheduler_counters,
    worker_counters,
)

__all__ = ["Telemetry"]

log = logging.getLogger(__name__)


class Telemetry:
    """Stats and KV events of one connector (scheduler or worker side)."""

    def __init__(self, connector: Any, vllm_config: Any, kv_cache_config: Any = None) -> None:
        self.scheduler = connector.scheduler
        self.worker = connector.worker
        self.shared = connector.shared
        self.scheduler_events: SchedulerEvents | None = None
        self.worker_events: WorkerEvents | None = None
        events = kv_events_wanted(vllm_config)
        if self.scheduler is not None:
            self.meter = Meter("scheduler")
            self.scheduler.lookup = self.meter.timed("lookup", self.scheduler.lookup)
            if events:
                self.scheduler_events = _scheduler_events(self.scheduler, kv_cache_config)
        else:
            ns = self.worker.namespace
            self.meter = Meter(f"tp{ns.tp_rank}-pp{ns.pp_rank}")
            if events:
                self.worker_events = WorkerEvents(self.meter.who)
            self.source = MeteredSource(self.worker.source, self.meter, self.worker_events)
            self.worker.source = self.source

    # ------------------------------------------------------------------ stats
    def take_stats(self) -> PoolStats | None:
        """This side's changes since the last call (vLLM asks once per step)."""
        if self.scheduler is not None:
            return self.meter.take(scheduler_counters(self.scheduler), pool_up(self.shared))
        client = self.source.raw()
        stats = self.meter.take(worker_counters(self.worker, client), pool_up(self.shared))
        perf = self.worker.timer.take()
        if perf is not None:  # for the scheduler's claim policy, not for the metrics
            stats = stats or PoolStats()
            stats.data["perf"] = perf
        return stats

    # ------------------------------------------------------------------ events
    def take_worker_events(self) -> PoolKVEvents | None:
        return self.worker_events.take() if self.worker_events is not None else None

    def planned(self, meta: Any) -> None:
        """Scheduler side, after each step's metadata: name the chunks it moves."""
        if self.scheduler_events is not None:
            self.scheduler_events.planned(meta, self.scheduler.requests)

    def received(self, connector_output: Any) -> None:
        if self.scheduler is not None:
            stats = getattr(connector_output, "kv_connector_stats", None)
            perf = getattr(stats, "data", {}).get("perf") if stats is not None else None
            if perf:
                self.scheduler.observe_perf(perf)
            over = set(getattr(connector_output, "finished_recving", None) or ())
            over |= set(getattr(connector_output, "finished_sending", None) or ())
            if over:
                self.scheduler.loads_over(over)
        if self.scheduler_events is not None:
            self.scheduler_events.received(getattr(connector_output, "kv_cache_events", None))

    def take_events(self) -> list[Any]:
        return self.scheduler_events.take_events() if self.scheduler_events is not None else []


def _scheduler_events(scheduler: Any, kv_cache_config: Any) -> SchedulerEvents | None:
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None)
    if hash_block_size not in (None, scheduler.block_size):
        log.warning("mooncake-vllm: no KV events for the pool: vLLM hashes blocks of %s tokens, "
                    "the pool stores blocks of %s", hash_block_size, scheduler.block_size)
        return None
    return SchedulerEvents(scheduler.block_size, len(scheduler.namespaces.namespaces))
