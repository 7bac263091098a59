"""Prometheus rendering (pure logic)."""

from __future__ import annotations

from mooncake_vllm.proxy.instances import Instance, parse_endpoint
from mooncake_vllm.proxy.metrics import ProxyMetrics


def test_render_is_valid_prometheus_text() -> None:
    m = ProxyMetrics()
    m.observe("/v1/completions", 200, 0.003)
    m.observe("/v1/completions", 502, 0.2)
    m.error("decode", "http_500")
    inst = Instance("decode", parse_endpoint("[::1]:8200"))
    inst.acquire()
    text = m.render([inst])
    assert text.endswith("\n")
    lines = text.splitlines()
    assert 'mooncake_proxy_requests_total{route="/v1/completions",status="502"} 1' in lines
    assert 'mooncake_proxy_errors_total{kind="decode",reason="http_500"} 1' in lines
    assert 'mooncake_proxy_request_duration_seconds_bucket{route="/v1/completions",le="0.0025"} 0' in lines
    assert 'mooncake_proxy_request_duration_seconds_bucket{route="/v1/completions",le="0.005"} 1' in lines
    assert 'mooncake_proxy_request_duration_seconds_bucket{route="/v1/completions",le="+Inf"} 2' in lines
    assert 'mooncake_proxy_instance_in_flight{kind="decode",instance="[::1]:8200"} 1' in lines
    for line in lines:  # every sample line is "name{labels} number"
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])
    types = [ln.split()[2] for ln in lines if ln.startswith("# TYPE")]
    assert len(types) == len(set(types))
