"""Counters: their declared names, strict checking, and the store's counters
(hits, misses, bytes, latencies) with their Prometheus rendering.

Every counter name is declared once (:class:`CounterNames`, next to the counters
it belongs to: :data:`STORE_COUNTERS` here, the V1 scheduler's and worker's in
their modules). Counting an undeclared name raises
:class:`~mooncake_vllm.errors.UndeclaredCounterError` when counters are strict —
``$MOONCAKE_VLLM_STRICT_COUNTERS`` set (not ``0``), which ``tests/conftest.py``
does for the whole suite and the engines it starts; otherwise it is counted as before.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from mooncake_vllm.errors import UndeclaredCounterError

__all__ = ["LATENCY_BUCKETS", "STORE_COUNTERS", "STRICT_ENV", "CounterNames", "Counters",
           "StoreStats", "strict_counters"]

#: Upper bounds (seconds) of the latency histogram buckets.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: set (not ``0``): counting an undeclared counter name raises
STRICT_ENV = "MOONCAKE_VLLM_STRICT_COUNTERS"


def strict_counters() -> bool:
    """Whether undeclared counter names raise (``$MOONCAKE_VLLM_STRICT_COUNTERS``)."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


@dataclass(frozen=True)
class CounterNames:
    """The names one set of counters may count: ``initial`` ones (there from the start,
    at 0), ``later`` ones (there once counted) and ``families`` (whole-name regular
    expressions, there once counted)."""

    initial: tuple[str, ...]
    later: frozenset[str] = frozenset()
    families: tuple[str, ...] = ()

    def declares(self, name: str) -> bool:
        return (name in self.initial or name in self.later
                or any(re.fullmatch(f, name) for f in self.families))

    def check(self, name: str) -> None:
        """Raise :class:`UndeclaredCounterError` for a name these counters never declared."""
        if not self.declares(name):
            raise UndeclaredCounterError(
                f"counter {name!r} is not declared; add it to its CounterNames "
                f"(names {sorted({*self.initial, *self.later})}, families {list(self.families)})")


class Counters(dict):  # dict[str, int]; ``counters[n] += 1`` works
    """A plain ``dict`` of counters that refuses undeclared names when strict.

    Starts with ``names.initial`` at 0; a ``later`` or family name starts at 0 on
    first use; an undeclared one is a ``KeyError`` there. Pickles and copies as a plain
    ``dict``.
    """

    def __init__(self, names: CounterNames, *, strict: bool | None = None) -> None:
        super().__init__(dict.fromkeys(names.initial, 0))
        self.names = names
        self.strict = strict_counters() if strict is None else strict

    def __missing__(self, name: str) -> int:
        if self.strict:
            self.names.check(name)
        if self.names.declares(name):
            return 0
        raise KeyError(name)

    def __setitem__(self, name: str, value: int) -> None:
        if self.strict:
            self.names.check(name)
        super().__setitem__(name, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (dict(self),)


#: every counter :class:`StoreStats` counts (store/: client, transport, fetch, direct,
#: puts, health); ``<op>_failed_<code>``: a batch ``op`` failed with Mooncake's
#: ``store.codes.Code`` of that name (lower case), ``<op>_failed_other``: an unknown code
STORE_COUNTERS = CounterNames(
    initial=("lookups", "hits", "misses", "corrupt", "errors", "blocks_put", "blocks_got",
             "bytes_put", "bytes_got", "skipped_existing", "circuit_open"),
    later=frozenset({
        "lookup_errors", "load_failed", "load_no_slot", "lost_segment_reads",
        "unverifiable_on_gpu", "timeouts", "rejected", "saves_skipped", "saves_abandoned",
        "saves_dropped_no_slot", "save_raced", "put_retries_full", "holders_suspended", "holders_dropped",
        "saves_held_back", "puts_slow", "saves_first_seen", "seen_marks_put", "seen_marks_failed"}),
    families=(r"(put|get)_failed_[a-z_]+", r"miss_[a-z_]+"))  # miss_<cause>: store/misses.py


@dataclass
class StoreStats:
    """Thread-safe counters of one :class:`~mooncake_vllm.store.StoreClient`."""

    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STORE_COUNTERS.initial, 0))
    latency: dict[str, list[int]] = field(default_factory=dict)
    latency_sum: dict[str, float] = field(default_factory=dict)
    #: undeclared names (not in :data:`STORE_COUNTERS`) raise
    strict: bool = field(default_factory=strict_counters, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, amount: int = 1) -> None:
        if self.strict:
            STORE_COUNTERS.check(name)
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + amount

    def observe(self, op: str, seconds: float) -> None:
        """Record one ``op`` (``put``, ``get``, ``exists``) latency."""
        with self._lock:
            buckets = self.latency.setdefault(op, [0] * (len(LATENCY_BUCKETS) + 1))
            for i, bound in enumerate(LATENCY_BUCKETS):
                if seconds <= bound:
                    buckets[i] += 1
                    break
            else:
                buckets[-1] += 1
            self.latency_sum[op] = self.latency_sum.get(op, 0.0) + seconds

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)

    def render_prometheus(self, prefix: str = "mooncake_vllm_store") -> str:
        """The counters and latency histograms in Prometheus text format."""
        with self._lock:
            lines: list[str] = []
            for name, value in sorted(self.counters.items()):
                lines += [f"# TYPE {prefix}_{name}_total counter", f"{prefix}_{name}_total {value}"]
            if self.latency:
                lines.append(f"# TYPE {prefix}_latency_seconds histogram")
            for op, buckets in sorted(self.latency.items()):
                running = 0
                for bound, count in zip((*LATENCY_BUCKETS, float("inf")), buckets):
                    running += count
                    le = "+Inf" if bound == float("inf") else repr(bound)
                    lines.append(f'{prefix}_latency_seconds_bucket{{op="{op}",le="{le}"}} {running}')
                lines.append(f'{prefix}_latency_seconds_sum{{op="{op}"}} {self.latency_sum[op]}')
                lines.append(f'{prefix}_latency_seconds_count{{op="{op}"}} {running}')
        return "\n".join(lines) + "\n"
