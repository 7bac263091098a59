"""The proxy's request path against real stub upstreams on loopback sockets."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest

from mooncake_vllm.errors import ConfigError, UnsupportedVersionError
from mooncake_vllm.proxy.server import ProxyConfig, ProxyServer

from ._helpers import MODEL, proxy, run, sse_events, stubs, wait_for


def test_store_flow_non_streaming_prefills_one_token_then_decodes_original() -> None:
    async def go() -> None:
        async with stubs(1) as (p,), stubs(1) as (d,), proxy([p], [d]) as (_s, url, c):
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 5, "stream_options": {"x": 1}}
            async with c.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
                out = await r.json()
            assert out["choices"][0]["text"] == " t0 t1 t2 t3 t4"
            assert p.received[0]["max_tokens"] == 1 and p.received[0]["stream"] is False
            assert "stream_options" not in p.received[0]
            # the prefill is asked for a hand-off; it offers none (V0, another connector) ...
            assert p.received[0]["kv_transfer_params"] == {"mooncake_vllm_handoff": {"v": 1, "ask": True}}
            assert d.received == [body]  # ... so the decode gets the client's request unchanged
            assert p.headers[0]["X-Request-Id"] == d.headers[0]["X-Request-Id"]

    run(go)


def test_store_flow_hands_the_prefills_offer_to_the_decode_streamed_or_not() -> None:
    offer = {"v": 1, "id": "cd" * 16, "ns": ["mcv/0123456789abcdef"], "chunks": 2, "state": "saving"}

    async def go() -> None:
        async with stubs(1) as (p,), stubs(1) as (d,), proxy([p], [d]) as (_s, url, c):
            p.kv_params_out = {"mooncake_vllm_handoff": offer, "do_remote_prefill": False}
            for stream in (False, True):
                body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": stream}
                async with c.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
                assert d.received[-1] == {**body, "kv_transfer_params": {"mooncake_vllm_handoff": offer}}

    run(go)


def test_streaming_chat_is_relayed_to_the_end() -> None:
    async def go() -> None:
        async with stubs(1) as (p,), stubs(1, tokens=6) as (d,), proxy([p], [d]) as (_s, url, c):
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                    "max_completion_tokens": 6, "max_tokens": 6}
            async with c.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                events = sse_events(await r.read())
            assert events[-1] == "[DONE]"
            text = "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1])
            assert text == " t0 t1 t2 t3 t4 t5"
            assert p.received[0]["max_completion_tokens"] == 1

    run(go)


def test_models_are_served_from_a_healthy_instance() -> None:
    async def go() -> None:
        async with stubs(1) as ps, stubs(1) as ds, proxy(ps, ds) as (_s, url, c):
            async with c.get(url + "/v1/models") as r:
                assert r.status == 200
                assert (await r.json())["data"][0]["id"] == MODEL

    run(go)


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_upstream_500_becomes_502_naming_the_instance(side: str) -> None:
    async def go() -> None:
        async with stubs(1) as (p,), stubs(1) as (d,), proxy([p], [d]) as (s, url, c):
            bad = p if side == "prefill" else d
            bad.fail_status = 500
            async with c.post(url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
                assert r.status == 502
                err = (await r.json())["error"]
            assert f"{side} instance {bad.address} answered HTTP 500" in err["message"]
            assert "stub failure" in err["message"]
            if side == "prefill":
                assert d.received == []  # no decode after a failed prefill
            metrics = await (await c.get(url + "/metrics")).text()
            assert f'mooncake_proxy_errors_total{{kind="{side}",reason="http_500"}} 1' in metrics

    run(go)


def test_upstream_4xx_passes_through() -> None:
    async def go() -> None:
        async with stubs(1) as ps, stubs(1, fail_status=400) as ds, proxy(ps, ds) as (s, url, c):
            async with c.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 400
                assert (await r.json())["error"]["message"] == "stub failure"
            assert s.pool.available("decode")  # a client error does not evict the instance

    run(go)


def test_upstream_dying_mid_stream_ends_with_an_sse_error_event() -> None:
    async def go() -> None:
        async with stubs(1) as ps, stubs(1, tokens=8, die_after=3) as (d,), proxy(ps, [d]) as (s, url, c):
            async with c.post(url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
                assert r.status == 200
                events = sse_events(await r.read())
            assert len(events) == 4 and "[DONE]" not in events
            err = json.loads(events[-1])["error"]
            assert err["code"] == 502 and "broke the stream" in err["message"]
            metrics = await (await c.get(url + "/metrics")).text()
            assert 'mooncake_proxy_requests_total{route="/v1/completions",status="502"} 1' in metrics

    run(go)


def test_no_healthy_decode_gives_503_with_reason() -> None:
    async def go() -> None:
        async with stubs(1) as ps, stubs(1) as (d,), proxy(ps, [d], unavailable_wait=0.3) as (s, url, c):
            d.unhealthy = True
            await wait_for(lambda: not s.pool.available("decode"))
            async with c.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "1"
                msg = (await r.json())["error"]["message"]
            assert msg.startswith("no healthy decode instance") and d.address in msg
            assert ps[0].received == []  # nothing was prefilled for nothing
            async with c.get(url + "/health") as r:
                assert r.status == 503

    run(go)


def test_a_request_waits_for_an_instance_back_in_rotation() -> None:
    """A live instance whose health checks were late leaves rotation for a moment: a request
    arriving then waits for it (up to ``unavailable_wait``) instead of getting a 503."""
    async def go() -> None:
        async with stubs(1) as ps, stubs(1) as (d,), proxy(ps, [d], unavailable_wait=20.0) as (s, url, c):
            d.unhealthy = True
            await wait_for(lambda: not s.pool.available("decode"))

            async def heal() -> None:
                await asyncio.sleep(0.5)
                d.unhealthy = False

            task = asyncio.create_task(heal())
            async with c.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 200, await r.text()
            await task
            assert len(d.received) == 1
        with pytest.raises(ConfigError, match="--unavailable-wait"):
            ProxyServer(ProxyConfig(model=MODEL, unavailable_wait=-1.0))

    run(go)


def test_health_check_removes_and_restores_an_instance() -> None:
    async def go() -> None:
        async with stubs(1) as ps, stubs(2) as (d1, d2), proxy(ps, [d1, d2]) as (s, url, c):
            await d2.stop()  # really gone: connection refused
            await wait_for(lambda: [i.key for i in s.pool.available("decode")] == [d1.address])
            for _ in range(4):
                async with c.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                    assert r.status == 200
            assert len(d1.received) == 4
            await d2.start()  # same port
            await wait_for(lambda: len(s.pool.available("decode")) == 2)
            for _ in range(4):
                async with c.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                    assert r.status == 200
            assert len(d2.received) == 2  # round robin again

    run(go)


def test_connection_refused_retries_on_another_instance() -> None:
    async def go() -> None:
        async with stubs(1) as ps, stubs(2) as (d1, d2), proxy(ps, [d1, d2], health_interval=60) as (s, url, c):
            await d1.stop()
            for _ in range(2):
                async with c.post(url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
                    assert r.status == 200 and sse_events(await r.read())[-1] == "[DONE]"
            assert len(d2.received) == 2
            assert [i.key for i in s.pool.available("decode")] == [d2.address]
            assert "connect failed" in s.pool.get("decode", d1.address).last_error

    run(go)


@pytest.mark.parametrize("stream", [False, True])
def test_a_connection_dropped_before_any_answer_retries_on_another_instance(stream: bool) -> None:
    """An instance killed while the proxy sends on a kept-alive connection: the request dies
    before any answer (soak run I: one 502 sent 0.12 s after v1's SIGKILL, before the health
    check saw it down). Nothing reached the client yet, so it goes to another instance."""
    async def go() -> None:
        async with stubs(2) as (d1, d2), proxy([], [d1, d2], flow="kv_both", health_interval=60) as (s, url, c):
            d1.drop_requests = True
            for _ in range(2):
                async with c.post(url + "/v1/completions", json={"prompt": "x", "stream": stream}) as r:
                    assert r.status == 200, await r.text()
                    if stream:
                        assert sse_events(await r.read())[-1] == "[DONE]"
            assert len(d1.received) == 1 and len(d2.received) == 2
            assert [i.key for i in s.pool.available("decode")] == [d2.address]
            assert "disconnect" in s.pool.get("decode", d1.address).last_error

    run(go)


def test_ipv6_literal_and_dns_name_upstreams() -> None:
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.fail("this test needs an IPv6 loopback (::1)")

    async def go() -> None:
        async with stubs(1, host="::1") as (p,), stubs(1) as (d,):
            dns = f"localhost:{d.port}"
            async with proxy([p.address], [dns]) as (s, url, c):
                assert p.address.startswith("[::1]:")
                async with c.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                    assert r.status == 200
                assert len(p.received) == 1 and len(d.received) == 1
                assert s.pool.get("decode", dns) is not None

    run(go)


def test_bad_requests_get_clear_errors() -> None:
    async def go() -> None:
        async with stubs(1) as ps, stubs(1) as ds, proxy(ps, ds) as (_s, url, c):
            async with c.post(url + "/v1/completions", data="x", headers={"Content-Type": "text/plain"}) as r:
                assert r.status == 415
            async with c.post(url + "/v1/completions", data="{nope",
                              headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
            async with c.post(url + "/v1/completions", json=[1]) as r:
                assert r.status == 400

    run(go)


def test_authorization_is_forwarded_or_taken_from_config() -> None:
    async def go() -> None:
        async with stubs(1) as (p,), stubs(1) as (d,), proxy([p], [d], upstream_api_key="k1") as (_s, url, c):
            await c.post(url + "/v1/completions", json={"prompt": "x"})
            await c.post(url + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer mine"})
            assert [h["Authorization"] for h in d.headers] == ["Bearer k1", "Bearer mine"]
            assert [h["Authorization"] for h in p.headers] == ["Bearer k1", "Bearer mine"]

    run(go)


def test_metrics_expose_requests_latency_and_instance_load() -> None:
    async def go() -> None:
        async with stubs(1) as ps, stubs(1, delay=0.05, tokens=4) as (d,), proxy(ps, [d]) as (s, url, c):
            task = asyncio.create_task(c.post(url + "/v1/completions", json={"prompt": "x", "stream": True}))
            await wait_for(lambda: d.active == 1)
            text = await (await c.get(url + "/metrics")).text()
            assert f'mooncake_proxy_instance_in_flight{{kind="decode",instance="{d.address}"}} 1' in text
            r = await task
            await r.read()
            text = await (await c.get(url + "/metrics")).text()
            assert 'mooncake_proxy_requests_total{route="/v1/completions",status="200"} 1' in text
            assert 'mooncake_proxy_request_duration_seconds_bucket{route="/v1/completions",le="0.1"} 0' in text
            assert 'mooncake_proxy_request_duration_seconds_count{route="/v1/completions"} 1' in text
            assert f'mooncake_proxy_instance_in_flight{{kind="decode",instance="{d.address}"}} 0' in text

    run(go)


def test_p2p_bootstrap_flow_sends_matching_transfer_params() -> None:
    async def go() -> None:
        async with stubs(1, engine_id="eng-P") as (p,), stubs(1) as (d,), \
                proxy([p.address + "@" + str(p.port)], [d], flow="p2p") as (s, url, c):
            assert s.p2p_mode == "bootstrap"  # detected from GET /version (0.32.0)
            async with c.post(url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
                assert r.status == 200
                await r.read()
            pre, dec = p.received[0]["kv_transfer_params"], d.received[0]["kv_transfer_params"]
            assert pre["do_remote_decode"] is True and pre["do_remote_prefill"] is False
            assert dec["transfer_id"] == pre["transfer_id"] and len(pre["transfer_id"]) == 32
            assert dec["do_remote_prefill"] is True and dec["remote_engine_id"] == "eng-P"
            assert dec["remote_bootstrap_addr"] == f"http://127.0.0.1:{p.port}"
            assert p.headers[0]["X-data-parallel-rank"] == "0"
            status = await (await c.get(url + "/status")).json()
            assert status["p2p_mode"] == "bootstrap"
            assert status["instances"]["prefill"][0]["engine_ids"] == {"0": "eng-P"}

    run(go)


def test_p2p_handoff_flow_forwards_the_prefill_params() -> None:
    async def go() -> None:
        out = {"do_remote_prefill": True, "do_remote_decode": False, "remote_host": "h", "remote_port": 7}
        async with stubs(1, version="0.15.1", kv_params_out=out) as (p,), stubs(1) as (d,), \
                proxy([p], [d], flow="p2p", target_vllm="0.14.0") as (s, url, c):
            async with c.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 200
            assert p.received[0]["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
            assert d.received[0]["kv_transfer_params"] == out
            p.kv_params_out = None  # a prefill without params: the decode cannot pull -> 502
            async with c.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 502
                assert "returned no kv_transfer_params" in (await r.json())["error"]["message"]

    run(go)


def test_p2p_needs_vllm_0_13() -> None:
    with pytest.raises(UnsupportedVersionError, match="vLLM >= 0.13.0"):
        ProxyServer(ProxyConfig(model=MODEL, flow="p2p", target_vllm="0.12.0"))


def test_unknown_flow_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--flow: 'pd' is not a flow"):
        ProxyServer(ProxyConfig(model=MODEL, flow="pd"))


def test_p2p_prefill_without_registered_engine_stays_out_of_rotation() -> None:
    async def go() -> None:
        async with stubs(1, engine_id=None) as (p,), stubs(1) as (d,), \
                proxy([f"{p.address}@{p.port}"], [d], flow="p2p", unavailable_wait=0.3) as (s, url, c):
            async with c.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 503
                assert "has no engine registered yet" in (await r.json())["error"]["message"]
            p.engine_id = "eng-late"
            await wait_for(lambda: bool(s.pool.available("prefill")))
            async with c.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 200
            assert d.received[-1]["kv_transfer_params"]["remote_engine_id"] == "eng-late"

    run(go)


def test_prefix_scheduling_keeps_a_prompt_prefix_on_one_instance() -> None:
    async def go() -> None:
        async with stubs(3) as ps, stubs(3) as ds, proxy(ps, ds, scheduling="prefix") as (_s, url, c):
            system = "You are a careful assistant. " * 12
            for k in range(6):
                msgs = [{"role": "system", "content": system}, {"role": "user", "content": "q"}]
                body = {"messages": msgs + [{"role": "user", "content": f"turn {k}"}] * k}
                async with c.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
            assert sorted(len(p.received) for p in ps) == [0, 0, 6]
            assert sorted(len(d.received) for d in ds) == [0, 0, 6]

    run(go)


def test_upstream_dying_before_the_first_byte_gives_502() -> None:
    async def go() -> None:
        async with stubs(1) as ps, stubs(1, die_after=0) as (d,), proxy(ps, [d]) as (s, url, c):
            async with c.post(url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
                assert r.status == 502 and r.content_type == "application/json"
                assert "broke the stream" in (await r.json())["error"]["message"]
            assert not s.pool.available("decode")  # a cut connection takes it out until a health check passes
            await wait_for(lambda: bool(s.pool.available("decode")))

    run(go)


def test_proxy_listens_on_ipv6() -> None:
    async def go() -> None:
        async with stubs(1) as ps, stubs(1) as ds:
            server = ProxyServer(ProxyConfig(model=MODEL, prefill=[ps[0].address], decode=[ds[0].address],
                                             host="::1", port=0))
            port = await server.start()
            try:
                async with aiohttp.ClientSession() as c:
                    async with c.post(f"http://[::1]:{port}/v1/completions", json={"prompt": "x"}) as r:
                        assert r.status == 200
            finally:
                await server.stop()

    run(go)
