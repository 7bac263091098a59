"""Wires :mod:`.metrics` and :mod:`.events` onto one connector side.

The connector's vLLM hooks (``get_kv_connector_stats``, ``update_connector_output``,
``take_events``) delegate here; the workers' pool KV-event records ride the stats (vLLM's
``MultiConnector`` forwards no worker events, every child's stats); this is the only
place that knows which side carries what. Built before its side's logic: the
connector hands :class:`~mooncake_vllm.v1.scheduler.SchedulerLogic` the timed
lookup (:meth:`Telemetry.timed_lookup`) and
:class:`~mooncake_vllm.v1.worker.WorkerLogic` the metered client source
(:attr:`Telemetry.source`), then ``attach_scheduler`` / ``attach_worker`` name the
logic it reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from mooncake_vllm.keys import KeyNamespace
from mooncake_vllm.v1.events import PoolKVEvents, SchedulerEvents, WorkerEvents, kv_events_wanted
from mooncake_vllm.v1.metrics import (
    Meter,
    MeteredSource,
    PoolStats,
    own_stats,
    pool_up,
    scheduler_counters,
    worker_counters,
)

if TYPE_CHECKING:
    from mooncake_vllm.v1.client import ClientSource
    from mooncake_vllm.v1.scheduler import SchedulerLogic
    from mooncake_vllm.v1.worker import WorkerLogic

__all__ = ["Telemetry"]

_Query = TypeVar("_Query", bound=Callable[..., Any])

log = logging.getLogger(__name__)


class Telemetry:
    """Stats and KV events of one connector side: the scheduler's, or (``worker``: its
    rank's namespace) a worker's."""

    def __init__(self, shared: ClientSource, vllm_config: Any, *,
                 worker: KeyNamespace | None = None) -> None:
        self.shared = shared
        self.scheduler: SchedulerLogic | None = None
        self.worker: WorkerLogic | None = None
        self.scheduler_events: SchedulerEvents | None = None
        self.worker_events: WorkerEvents | None = None
        self._events = kv_events_wanted(vllm_config)
        self.meter = Meter("scheduler" if worker is None else
                           f"tp{worker.tp_rank}-pp{worker.pp_rank}")
        #: the worker's client source: every client it hands out is metered
        self.source: MeteredSource | None = None
        if worker is not None:
            if self._events:
                self.worker_events = WorkerEvents(self.meter.who)
            self.source = MeteredSource(shared, self.meter, self.worker_events)

    def timed_lookup(self, lookup: _Query) -> _Query:
        """A lookup callable of the scheduler's (or its audits'), each call's duration recorded."""
        return self.meter.timed("lookup", lookup)

    def attach_scheduler(self, scheduler: SchedulerLogic, kv_cache_config: Any = None) -> None:
        """The scheduler side's logic (built with :meth:`timed_lookup`)."""
        self.scheduler = scheduler
        if self._events:
            self.scheduler_events = _scheduler_events(scheduler, kv_cache_config)

    def attach_worker(self, worker: WorkerLogic) -> None:
        """The worker side's logic (built with :attr:`source`)."""
        self.worker = worker

    # ------------------------------------------------------------------ stats
    def take_stats(self) -> PoolStats | None:
        """This side's changes since the last call (vLLM asks once per step)."""
        if self.scheduler is not None:
            return self.meter.take(scheduler_counters(self.scheduler, self.shared.get()),
                                   pool_up(self.shared))
        assert self.source is not None and self.worker is not None  # the worker side
        client = self.source.raw()
        stats = self.meter.take(worker_counters(self.worker, client), pool_up(self.shared))
        perf = self.worker.timer.take()
        if perf is not None:  # for the scheduler's claim policy, not for the metrics
            stats = stats or PoolStats()
            stats.data["perf"] = perf
        events = self.worker_events.take() if self.worker_events is not None else None
        if events is not None:  # for the scheduler's KV events, not for the metrics
            stats = stats or PoolStats()
            stats.add_events(events.get_all_events())
        return stats

    # ------------------------------------------------------------------ events
    def planned(self, meta: Any) -> None:
        """Scheduler side, after each step's metadata: name the chunks it moves."""
        if self.scheduler_events is not None:
            assert self.scheduler is not None  # scheduler_events come with attach_scheduler
            self.scheduler_events.planned(meta, self.scheduler.requests)

    def received(self, connector_output: Any) -> None:
        """Scheduler side, each step: the workers' timings and pool records (from our stats,
        alone or inside a ``MultiConnector``'s) and which transfers ended."""
        own = own_stats(getattr(connector_output, "kv_connector_stats", None))
        if self.scheduler is not None:
            perf = own.get("perf")
            if perf:
                self.scheduler.observe_perf(perf)
            received = set(getattr(connector_output, "finished_recving", None) or ())
            over = received | set(getattr(connector_output, "finished_sending", None) or ())
            if over:
                self.scheduler.loads_over(over, received)
            self.scheduler.workers_up.update(own.get("pool_up") or {})  # sent when it changes
            self.scheduler.refills.losses.workers_report(own.get("counters") or {})
        records = own.pop("events", None)  # consumed here: the front end does not need them
        dropped = own.pop("events_dropped", 0)
        if self.scheduler_events is not None:
            if dropped:
                self.scheduler_events.counters["dropped_records"] += int(dropped)
            if records:
                self.scheduler_events.received(PoolKVEvents([tuple(r) for r in records]))

    def take_events(self) -> list[Any]:
        return self.scheduler_events.take_events() if self.scheduler_events is not None else []


def _scheduler_events(scheduler: Any, kv_cache_config: Any) -> SchedulerEvents | None:
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None)
    if hash_block_size not in (None, scheduler.block_size):
        log.warning("mooncake-vllm: no KV events for the pool: vLLM hashes blocks of %s tokens, "
                    "the pool stores blocks of %s", hash_block_size, scheduler.block_size)
        return None
    return SchedulerEvents(scheduler.block_size, len(scheduler.namespaces.namespaces))
