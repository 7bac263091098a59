"""Proxy metrics in the Prometheus text exposition format (no client library).

Updates are plain dict/int operations on the event loop: cheap on the request path.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable

from mooncake_vllm.proxy.instances import Instance

__all__ = ["BUCKETS", "ProxyMetrics"]

#: latency histogram upper bounds, seconds
BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items()) + "}"


class _Histogram:
    __slots__ = ("counts", "sum", "count")

    def __init__(self) -> None:
        self.counts = [0] * len(BUCKETS)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(BUCKETS, value)
        if i < len(BUCKETS):
            self.counts[i] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str, route: str) -> Iterable[str]:
        cum = 0
        for bound, n in zip(BUCKETS, self.counts):
            cum += n
            yield f'{name}_bucket{{route="{route}",le="{bound}"}} {cum}'
        yield f'{name}_bucket{{route="{route}",le="+Inf"}} {self.count}'
        yield f'{name}_sum{{route="{route}"}} {self.sum:.6f}'
        yield f'{name}_count{{route="{route}"}} {self.count}'


class ProxyMetrics:
    """Counters and histograms of one proxy process."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = defaultdict(int)  # (route, status)
        self.errors: dict[tuple[str, str], int] = defaultdict(int)  # (kind, reason)
        self.latency: dict[str, _Histogram] = defaultdict(_Histogram)  # route -> full duration
        self.ttfb: dict[str, _Histogram] = defaultdict(_Histogram)  # route -> first byte

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.requests[(route, status)] += 1
        self.latency[route].observe(seconds)

    def observe_ttfb(self, route: str, seconds: float) -> None:
        self.ttfb[route].observe(seconds)

    def error(self, kind: str, reason: str) -> None:
        self.errors[(kind, reason)] += 1

    def render(self, instances: Iterable[Instance]) -> str:
        """The whole exposition, ending with a newline."""
        out = [
            "# HELP mooncake_proxy_requests_total Client requests by route and HTTP status.",
            "# TYPE mooncake_proxy_requests_total counter",
        ]
        out += [f"mooncake_proxy_requests_total{_labels(route=r, status=str(s))} {n}"
                for (r, s), n in sorted(self.requests.items())]
        out += [
            "# HELP mooncake_proxy_errors_total Upstream and proxy errors by instance kind and reason.",
            "# TYPE mooncake_proxy_errors_total counter",
        ]
        out += [f"mooncake_proxy_errors_total{_labels(kind=k, reason=r)} {n}"
                for (k, r), n in sorted(self.errors.items())]
        for name, hists, help_text in (
            ("mooncake_proxy_request_duration_seconds", self.latency, "Client request duration, to the last byte."),
            ("mooncake_proxy_time_to_first_byte_seconds", self.ttfb, "Time to the first response byte."),
        ):
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
            for route, hist in sorted(hists.items()):
                out.extend(hist.render(name, _esc(route)))
        insts = list(instances)
        for metric, attr, mtype, help_text in (
            ("mooncake_proxy_instance_in_flight", "in_flight", "gauge", "Requests in flight per instance."),
            ("mooncake_proxy_instance_healthy", "healthy", "gauge", "1 if the instance passes health checks."),
            ("mooncake_proxy_instance_draining", "draining", "gauge", "1 while the instance is being removed."),
            ("mooncake_proxy_instance_requests_total", "requests", "counter", "Requests sent per instance."),
            ("mooncake_proxy_instance_errors_total", "errors", "counter", "Failures seen per instance."),
        ):
            out += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {mtype}"]
            out += [f"{metric}{_labels(kind=i.kind, instance=i.key)} {int(getattr(i, attr))}" for i in insts]
        return "\n".join(out) + "\n"
