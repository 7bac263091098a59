"""Store counters (hits, misses, bytes, latencies) and their Prometheus rendering."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["LATENCY_BUCKETS", "StoreStats"]

#: Upper bounds (seconds) of the latency histogram buckets.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_COUNTERS = ("lookups", "hits", "misses", "corrupt", "errors", "blocks_put", "blocks_got",
             "bytes_put", "bytes_got", "skipped_existing", "circuit_open")


@dataclass
class StoreStats:
    """Thread-safe counters of one :class:`~mooncake_vllm.store.StoreClient`."""

    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))
    latency: dict[str, list[int]] = field(default_factory=dict)
    latency_sum: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, amount: int = 1) -> None:
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
