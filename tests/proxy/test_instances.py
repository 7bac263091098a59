"""Address parsing and the instance pool (pure logic)."""

from __future__ import annotations

import asyncio

import pytest

from mooncake_vllm.errors import ConfigError
from mooncake_vllm.proxy.instances import Instance, InstancePool, parse_endpoint


@pytest.mark.parametrize(
    ("text", "key", "url"),
    [
        ("127.0.0.1:8100", "127.0.0.1:8100", "http://127.0.0.1:8100"),
        ("[::1]:8100", "[::1]:8100", "http://[::1]:8100"),
        ("[2001:db8::7]:80", "[2001:db8::7]:80", "http://[2001:db8::7]:80"),
        ("localhost:8200", "localhost:8200", "http://localhost:8200"),
        ("Prefill-0.svc.cluster.local:8000", "prefill-0.svc.cluster.local:8000",
         "http://prefill-0.svc.cluster.local:8000"),
        ("http://10.0.0.2:8100/", "10.0.0.2:8100", "http://10.0.0.2:8100"),
        ("https://gw.example:443", "gw.example:443", "https://gw.example:443"),
    ],
)
def test_parse_endpoint_accepts_ipv4_ipv6_and_dns(text: str, key: str, url: str) -> None:
    ep = parse_endpoint(text)
    assert (ep.key, ep.url, ep.bootstrap_port) == (key, url, None)


def test_bootstrap_port_suffix() -> None:
    ep = parse_endpoint("[::1]:8100@50052")
    assert ep.key == "[::1]:8100" and ep.bootstrap_url == "http://[::1]:50052"
    assert parse_endpoint("h:1").bootstrap_url == "http://h:8998"  # vLLM's default


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "empty address"),
        ("127.0.0.1", "no port"),
        ("::1:8100", "must be written in brackets"),
        ("[::1]8100", "needs ']:port'"),
        ("[zz::1]:80", "not an IPv6 address"),
        ("host:0", "not a number in 1..65535"),
        ("host:http", "not a number in 1..65535"),
        ("-bad-.example:80", "neither an IP address nor a DNS name"),
        ("ftp://h:21", "scheme 'ftp'"),
        ("h:80@x", "port 'x'"),
    ],
)
def test_parse_endpoint_errors_name_field_value_and_fix(text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_endpoint(text, field_name="--decode")
    msg = str(info.value)
    assert needle in msg and "--decode" in msg and "fix: use host:port" in msg


def test_pool_rotation_follows_health_and_draining() -> None:
    pool = InstancePool()
    a, b = (Instance("decode", parse_endpoint(f"h:{p}")) for p in (1, 2))
    pool.add(a)
    pool.add(b)
    assert pool.available("decode") == [a, b] and pool.available("prefill") == []
    a.mark_failed("boom")
    b.draining = True
    pool.refresh()
    assert pool.available("decode") == []
    reason = pool.unavailable_reason("decode")
    assert "h:1 unhealthy (boom)" in reason and "h:2 draining" in reason
    assert "no prefill instance is configured" in pool.unavailable_reason("prefill")
    assert pool.remove("decode", "h:2") is b and pool.remove("decode", "h:2") is None
    with pytest.raises(ConfigError, match="'both' is not an instance type"):
        pool.get("both", "h:1")


def test_drain_waits_for_in_flight_requests() -> None:
    async def go() -> tuple[bool, bool]:
        inst = Instance("decode", parse_endpoint("h:1"))
        inst.acquire()
        timed_out = await inst.drain(0.05)
        asyncio.get_running_loop().call_later(0.05, inst.release)
        return timed_out, await inst.drain(2.0)

    assert asyncio.run(go()) == (False, True)
