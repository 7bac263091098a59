"""The connector's counters in vLLM's own ``/metrics`` (the connector-stats hooks).

Wraps the mechanism instead of living in it (as LMCache does): a :class:`Meter`
per connector side times the pool calls through :class:`MeteredSource` /
:func:`Meter.timed`, and turns the counters the scheduler, the worker and the
store client already keep into per-step deltas. vLLM carries those deltas from
the workers (``get_kv_connector_stats``) and the scheduler to its front end as
:class:`PoolStats` (``build_kv_connector_stats``), where :class:`PoolPromMetrics`
(``build_prom_metrics``) adds them to Prometheus counters, latency histograms
and a pool-up gauge named ``vllm:mooncake_vllm_*``. Counters of several workers
(TP/PP ranks) add up: a TP=2 instance counts each block once per rank.

Releases without these hooks never call them (fact ``connector_metrics``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

from mooncake_vllm.stats import LATENCY_BUCKETS
from mooncake_vllm.store.misses import LOOKUP_CAUSES, MISS_CAUSES, miss_counts

if TYPE_CHECKING:
    from mooncake_vllm.v1.client import ClientSource

try:  # vLLM >= 0.11.0 (fact connector_metrics)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats as _StatsBase
except ImportError:  # pragma: no cover - older releases never ask for stats
    @dataclass
    class _StatsBase:  # type: ignore[no-redef]
        data: dict[str, Any] = field(default_factory=dict)

try:  # vLLM >= 0.11.1
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics as _PromBase,
    )
except ImportError:  # pragma: no cover
    _PromBase = None

__all__ = ["COUNTERS", "MAX_EVENT_RECORDS", "METRIC_PREFIX", "MISS_SERIES", "OPS", "Meter", "MeteredSource",
           "PoolPromMetrics", "PoolStats", "build_prom_metrics", "own_stats", "pool_up"]

#: Every exported metric is named ``vllm:mooncake_vllm_<name>``.
METRIC_PREFIX = "vllm:mooncake_vllm_"
#: counter name -> help text (Prometheus appends ``_total``)
COUNTERS: Mapping[str, str] = {
    "lookups": "Pool lookups (one batched existence query per request prefix asked about).",
    "hit_tokens": "Prompt tokens the pool supplied instead of prefill.",
    "loaded_blocks": "KV blocks loaded from the pool and verified.",
    "loaded_bytes": "KV bytes loaded from the pool (block payloads).",
    "failed_blocks": "Planned block loads that failed (missing, corrupt, late or pool away); "
                     "vLLM recomputed them.",
    "saved_blocks": "KV blocks newly stored in the pool.",
    "saved_bytes": "KV bytes newly stored in the pool (block payloads).",
    "dropped_blocks": "KV blocks planned for saving that never reached the pool (queue full, "
                      "preempted, no staging slot, timed out or pool away).",
    "declined_tokens": "Pool-hit prompt tokens not claimed: load_policy auto predicted their load "
                       "slower than recomputing them (or load_policy never).",
    "claims_declined_slow_pool": "Lookups whose hit was not claimed: the pool measured slower "
                                 "than recompute (load_policy auto).",
    "claims_declined_never": "Lookups whose hit was not claimed: load_policy never.",
    "claims_declined_reach_probe": "Lookups whose hit was not claimed because the prompt reached "
                                   "further than any prefill measured and its load did not beat "
                                   "a floor of its recompute: vLLM recomputed it once, to measure "
                                   "that far (load_policy auto).",
    "claims_declined_measure_probe": "Lookups whose hit was not claimed so that vLLM recomputed it "
                                     "and the claim policy measured a prefill: the loads were "
                                     "measured, the prefills not (every prompt was a hit: at most "
                                     "one per explore_every; or another load was in flight, behind "
                                     "which a blind claim would queue) (load_policy auto).",
    "lookups_skipped_slow_pool": "Pool lookups vLLM's thread did not make: even a hit of every "
                                 "wanted token would load slower than recomputing it (load_policy "
                                 "auto); a long span is asked off vLLM's thread instead, and its "
                                 "saves skip what the pool holds.",
    "claim_probes": "Partial claims made while declining, to measure the pool again.",
    "pool_probes": "Background probes (throw-away loads, no request's blocks) the workers were "
                   "asked for while declining, to measure the pool again (CUDA KV).",
    "waits_for_shared_load": "Requests deferred while another request's load brought their "
                             "blocks (one load per block).",
    "pool_refill_chunks": "Chunks vLLM served from its own prefix cache that the pool had lost "
                          "(a master restart, a holder's segment dropped): saved again.",
    "pool_refill_hbm_chunks": "Chunks of vLLM's prefix cache saved again once the pool was back "
                              "after an outage (a restarted master comes back empty) or had lost "
                              "blocks while it stayed up, without waiting for a request to touch "
                              "them.",
    "pool_vanished_chunks": "Chunks a lookup found in the pool that a later lookup (within 120 s) "
                            "missed: lost with a holder's segment, or evicted.",
    "pool_loss_refills": "Sweeps of vLLM's prefix cache started because the pool lost blocks "
                         "while it stayed up (a lookup missed chunks it had found, or a worker "
                         "found a stalled holder's blocks dropped by the master); at most one "
                         "per 30 s.",
    "pool_loss_refill_chunks": "Chunks of vLLM's prefix cache those sweeps saved again.",
    "admission_first_seen_chunks": "Chunks not stored at their first sighting (save_admission "
                                   "repeat): their marks were put instead, nothing captured.",
    "admission_late_chunks": "Chunks save_admission repeat did not save: their request ended "
                             "before the pool answered whether they were seen before.",
    "admission_unanswered_chunks": "Chunks save_admission repeat did not save: the pool gave no "
                                   "answer whether they were seen before (away, or timed out).",
    "presence_present_chunks": "Chunks of spans not looked up (every hit declined) that the "
                               "pool held, so were not saved again (asked off vLLM's thread).",
    "presence_late_chunks": "Chunks of spans not looked up that were not saved: their request "
                            "ended before the pool answered whether it held them.",
    "presence_unanswered_chunks": "Chunks of spans not looked up that were saved without "
                                  "knowing whether the pool held them: it gave no answer (away, "
                                  "or timed out).",
    "pool_segments_dropped": "Times a worker found a stalled pool holder's blocks no longer listed "
                             "by the master (it stalled past the master's --client_ttl, which "
                             "dropped its segment).",
}
#: the labelled counter of misses caused by an error (``{cause}``: store/misses.MISS_CAUSES);
#: in the per-step deltas each cause is the counter ``miss_causes:<cause>``
MISS_SERIES = "miss_causes"
#: timed operation -> help text of its latency histogram
OPS: Mapping[str, str] = {
    "lookup": "Seconds per pool lookup (scheduler side).",
    "load": "Seconds per batched block load from the pool (worker side).",
    "save": "Seconds per batched block save into the pool (worker side).",
}
_MAX_SAMPLES = 1024  # per operation and report: a stalled front end never grows us unbounded
#: pool KV-event records one PoolStats carries at most (the newest kept, the rest counted in
#: ``events_dropped``): they ride every step's stats to the scheduler side and on to the front end
MAX_EVENT_RECORDS = 4096
#: store-client counters (``StoreStats``) that are dropped saves
_STORE_DROPS = ("saves_skipped", "saves_dropped_no_slot", "saves_abandoned")


@dataclass
class PoolStats(_StatsBase):
    """One interval's deltas: ``{"counters": {...}, "latency": {op: [s]}, "pool_up": {who: 0|1}}``,
    and for our scheduler side ``"perf"`` (the claim policy's timings) and ``"events"`` (the
    workers' pool KV-event records ``[side, kind, digest]``: vLLM's ``MultiConnector`` forwards
    no worker events, every connector's stats).

    Plain dicts, lists and numbers only: vLLM sends it between processes.
    """

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, Any] = {"counters": {}, "latency": {}, "pool_up": {}}

    def is_empty(self) -> bool:
        return not any(self.data.get(part) for part in ("counters", "latency", "pool_up", "perf",
                                                         "events"))

    def add_events(self, records: Any, dropped: int = 0) -> None:
        """Append pool KV-event records, keeping the newest :data:`MAX_EVENT_RECORDS`."""
        mine = self.data.setdefault("events", [])
        mine.extend([list(r) for r in records])
        over = len(mine) - MAX_EVENT_RECORDS
        if over > 0:
            del mine[:over]
        if over > 0 or dropped:
            self.data["events_dropped"] = self.data.get("events_dropped", 0) + max(over, 0) + dropped

    def aggregate(self, other: Any) -> PoolStats:
        """Add ``other``'s counters, append its samples, take its pool-up values."""
        data = getattr(other, "data", None)
        if not isinstance(other, PoolStats) or not data:
            return self
        mine = self.data
        counters = mine.setdefault("counters", {})
        for name, value in data.get("counters", {}).items():
            counters[name] = counters.get(name, 0) + value
        latency = mine.setdefault("latency", {})
        for op, samples in data.get("latency", {}).items():
            latency.setdefault(op, []).extend(samples)
        mine.setdefault("pool_up", {}).update(data.get("pool_up", {}))
        for kind, samples in data.get("perf", {}).items():  # the claim policy's timings
            mine.setdefault("perf", {}).setdefault(kind, []).extend(samples)
        if data.get("events") or data.get("events_dropped"):
            self.add_events(data.get("events", ()), int(data.get("events_dropped", 0)))
        return self

    def reduce(self) -> dict[str, int | float]:
        """Totals, mean latency per operation and the lowest pool-up value (vLLM's log line)."""
        out: dict[str, int | float] = dict(sorted(self.data.get("counters", {}).items()))
        for op, samples in sorted(self.data.get("latency", {}).items()):
            if samples:
                out[f"{op}_count"] = len(samples)
                out[f"{op}_avg_ms"] = round(1e3 * sum(samples) / len(samples), 3)
        ups = self.data.get("pool_up", {})
        if ups:
            out["pool_up"] = min(ups.values())
        return out


def own_stats(stats: Any) -> dict[str, Any]:
    """Our :class:`PoolStats` data in what vLLM hands ``update_connector_output``: ours, or our
    entry of ``MultiConnector``'s per-class stats (``{}`` when there is none)."""
    data = getattr(stats, "data", None)
    if not isinstance(data, dict):
        return {}
    if isinstance(stats, PoolStats):
        return data
    for entry in data.values():  # MultiKVConnectorStats: class name -> that child's stats
        if isinstance(entry, PoolStats):
            return entry.data
    return {}


def pool_up(source: ClientSource) -> int:
    """1 while the source's client is connected and its breaker closed, else 0 (never blocks)."""
    client = source.get()
    if client is None:
        return 0
    health = getattr(client, "health", None)
    return 0 if health is not None and health.breaker.is_open else 1


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


class Meter:
    """Latency samples and counter deltas of one connector side, taken once per step."""

    def __init__(self, who: str) -> None:
        self.who = who  #: "scheduler" or "tp<r>-pp<r>"
        self._lock = threading.Lock()
        self._samples: dict[str, list[float]] = {}
        self._seen: dict[str, int] = {}
        self._up_sent: int | None = None

    def observe(self, op: str, seconds: float) -> None:
        with self._lock:
            samples = self._samples.setdefault(op, [])
            if len(samples) < _MAX_SAMPLES:
                samples.append(seconds)

    def timed(self, op: str, fn: _Fn) -> _Fn:
        """``fn`` with each call's duration recorded under ``op``."""

        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.observe(op, time.perf_counter() - start)

        return cast(_Fn, call)

    def take(self, counters: Mapping[str, int], up: int | None = None) -> PoolStats | None:
        """What changed since the last call (``None`` when nothing did)."""
        with self._lock:
            deltas = {k: v - self._seen.get(k, 0) for k, v in counters.items()
                      if v != self._seen.get(k, 0)}
            self._seen.update(counters)
            samples, self._samples = {k: v for k, v in self._samples.items() if v}, {}
            ups: dict[str, int] = {}
            if up is not None and up != self._up_sent:
                ups[self.who] = self._up_sent = up
        if not (deltas or samples or ups):
            return None
        return PoolStats(data={"counters": deltas, "latency": samples, "pool_up": ups})


#: scheduler-side counters exported under their own names
_SCHEDULER_EXPORTS = ("lookups", "hit_tokens", "declined_tokens", "claims_declined_slow_pool",
                      "claims_declined_never", "claims_declined_reach_probe",
                      "claims_declined_measure_probe", "lookups_skipped_slow_pool",
                      "claim_probes", "pool_probes", "waits_for_shared_load", "pool_refill_chunks",
                      "pool_refill_hbm_chunks", "pool_vanished_chunks", "pool_loss_refills",
                      "pool_loss_refill_chunks", "admission_first_seen_chunks",
                      "admission_late_chunks", "admission_unanswered_chunks",
                      "presence_present_chunks", "presence_late_chunks",
                      "presence_unanswered_chunks")


def scheduler_counters(scheduler: Any, client: Any = None) -> dict[str, int]:
    """The scheduler side's cumulative counters, by exported name (``client``: its store
    client, whose lookup misses caused by an error are exported by cause)."""
    out = {name: scheduler.counters[name] for name in _SCHEDULER_EXPORTS}
    if client is not None:
        out.update(_miss_causes(client, lookups=True))
    return out


def _miss_causes(client: Any, *, lookups: bool) -> dict[str, int]:
    """``miss_causes:<cause>`` of one side: lookups (scheduler) or loads (worker); the two
    sides may share one client in one process, so each exports only its own causes."""
    return {f"{MISS_SERIES}:{cause}": n for cause, n in miss_counts(client.stats.snapshot()).items()
            if (cause in LOOKUP_CAUSES) == lookups}


def worker_counters(worker: Any, client: Any) -> dict[str, int]:
    """The worker side's cumulative counters, by exported name (``client`` may be None)."""
    c = worker.counters
    nbytes = worker.layout.block_nbytes if worker.layout is not None else 0
    dropped = c.get("dropped_blocks", 0)
    if client is not None:  # the store client's own drops (only the worker saves)
        store = client.stats.snapshot()
        dropped += sum(store.get(name, 0) for name in _STORE_DROPS)
    out = {"loaded_blocks": c["loaded_blocks"], "loaded_bytes": c["loaded_blocks"] * nbytes,
           "failed_blocks": c["failed_blocks"], "saved_blocks": c["saved_blocks"],
           "saved_bytes": c["saved_blocks"] * nbytes, "dropped_blocks": dropped}
    if client is not None:
        out["pool_segments_dropped"] = store.get("holders_dropped", 0)
        out.update(_miss_causes(client, lookups=False))
    return out


class _MeteredClient:
    """A store client whose loads and saves are timed (and reported to ``events``)."""

    def __init__(self, client: Any, meter: Meter, events: Any) -> None:
        self._client = client
        self._meter = meter
        self._events = events

    def get_blocks(self, keys: Any, layout: Any, block_ids: Any, **kwargs: Any) -> list[bool]:
        start = time.perf_counter()
        try:
            ok = self._client.get_blocks(keys, layout, block_ids, **kwargs)
        finally:
            self._meter.observe("load", time.perf_counter() - start)
        if self._events is not None and not all(ok):
            self._events.load_failed(self._client, keys, ok)
        return ok

    def commit_save(self, ticket: Any) -> int:
        start = time.perf_counter()
        try:
            stored = self._client.commit_save(ticket)
        finally:
            if ticket.keys:
                self._meter.observe("save", time.perf_counter() - start)
        if self._events is not None and ticket.keys:
            self._events.saved(self._client, ticket.keys)
        return stored

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class MeteredSource:
    """Wraps the worker's client source: every client it hands out is metered
    (a :class:`~mooncake_vllm.v1.client.ClientSource` itself)."""

    def __init__(self, source: ClientSource, meter: Meter, events: Any = None) -> None:
        self._source = source
        self._meter = meter
        self._events = events

    def get(self) -> Any:
        client = self._source.get()
        return None if client is None else _MeteredClient(client, self._meter, self._events)

    def raw(self) -> Any:
        """The unwrapped client (or None)."""
        return self._source.get()

    def on_connect(self, callback: Callable[[Any], object]) -> None:
        self._source.on_connect(callback)


class PoolPromMetrics(_PromBase or object):  # type: ignore[misc]
    """Prometheus series of the pool: counters, latency histograms, pool-up gauge."""

    def __init__(self, vllm_config: Any, metric_types: Mapping[type, type], labelnames: list[str],
                 per_engine_labelvalues: Mapping[int, list[object]]) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._values = {idx: list(values) for idx, values in per_engine_labelvalues.items()}
        names = list(labelnames)
        self._counters = {
            name: metric_types[Counter](name=f"{METRIC_PREFIX}{name}", documentation=doc,
                                        labelnames=names)
            for name, doc in COUNTERS.items()}
        self._latency = {
            op: metric_types[Histogram](name=f"{METRIC_PREFIX}{op}_seconds", documentation=doc,
                                        labelnames=names, buckets=list(LATENCY_BUCKETS))
            for op, doc in OPS.items()}
        self._misses = metric_types[Counter](
            name=f"{METRIC_PREFIX}{MISS_SERIES}", labelnames=[*names, "cause"],
            documentation="Pool misses (blocks) caused by an error, by cause (pool_away, "
                          "lookup_failed, breaker_open, load_timeout, load_rejected, load_error, "
                          "lost_segment, corrupt, no_slot); the log names each cause's fix.")
        self._up = metric_types[Gauge](
            name=f"{METRIC_PREFIX}pool_up", labelnames=[*names, "side"],
            documentation="1 while this side's Mooncake pool client is connected and its "
                          "circuit breaker closed, else 0 (vLLM recomputes).")
        for values in self._values.values():  # every series present (at 0) from the start
            for metric in (*self._counters.values(), *self._latency.values()):
                metric.labels(*values)
            for cause in MISS_CAUSES:
                self._misses.labels(*values, cause)

    def observe(self, transfer_stats_data: Mapping[str, Any], engine_idx: int = 0) -> None:
        values = self._values.get(engine_idx)
        if values is None or not transfer_stats_data:
            return
        for name, amount in transfer_stats_data.get("counters", {}).items():
            if name in self._counters and amount > 0:
                self._counters[name].labels(*values).inc(amount)
            elif name.startswith(MISS_SERIES + ":") and amount > 0:
                self._misses.labels(*values, name.split(":", 1)[1]).inc(amount)
        for op, samples in transfer_stats_data.get("latency", {}).items():
            if op in self._latency:
                child = self._latency[op].labels(*values)
                for seconds in samples:
                    child.observe(seconds)
        for side, up in transfer_stats_data.get("pool_up", {}).items():
            self._up.labels(*values, side).set(up)


def build_prom_metrics(vllm_config: Any, metric_types: Mapping[type, type], labelnames: list[str],
                       per_engine_labelvalues: Mapping[int, list[object]]) -> Any:
    """vLLM's ``build_prom_metrics`` hook; None where the release has no Prometheus base class."""
    if _PromBase is None:  # pragma: no cover - never called there
        return None
    return PoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
