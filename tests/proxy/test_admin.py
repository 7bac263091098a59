"""Admin API and status against a real proxy and real stub upstreams."""

from __future__ import annotations

import asyncio
import logging

import pytest

from ._helpers import ADMIN_KEY, MODEL, proxy, run, sse_events, stubs, wait_for

KEY = {"X-API-Key": ADMIN_KEY}


def test_admin_disabled_without_admin_api_key() -> None:
    async def go() -> None:
        async with stubs(1) as ps, stubs(2) as (d1, d2), proxy(ps, [d1]) as (s, url, c):
            for path in ("/instances/add", "/instances/remove"):
                body = {"type": "decode", "instance": d2.address}
                async with c.post(url + path, json=body, headers=KEY) as r:
                    assert r.status == 403
                    assert "ADMIN_API_KEY is not set" in (await r.json())["error"]["message"]
            assert [i.key for i in s.pool.of_kind("decode")] == [d1.address]

    run(go)


def test_missing_and_wrong_key_are_rejected_and_the_key_is_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def go() -> None:
        async with stubs(1) as ps, stubs(2) as (d1, d2), proxy(ps, [d1], admin_api_key=ADMIN_KEY) as (s, url, c):
            body = {"type": "decode", "instance": d2.address}
            async with c.post(url + "/instances/add", json=body) as r:
                assert r.status == 401 and "missing X-API-Key" in await r.text()
            async with c.post(url + "/instances/add", json=body, headers={"X-API-Key": "guess-123"}) as r:
                assert r.status == 403 and "invalid X-API-Key" in await r.text()
            async with c.post(url + "/instances/add", json=body, headers={"X-API-Key": ADMIN_KEY + "x"}) as r:
                assert r.status == 403
            assert len(s.pool.of_kind("decode")) == 1

    run(go)
    assert "rejected admin request" in caplog.text
    assert "guess-123" not in caplog.text and ADMIN_KEY not in caplog.text


def test_add_validates_then_serves_and_rejects_duplicates() -> None:
    async def go() -> None:
        async with stubs(1) as ps, stubs(2) as (d1, d2), stubs(1, model="other/model") as (wrong,), \
                proxy(ps, [d1], admin_api_key=ADMIN_KEY) as (s, url, c):
            async with c.post(url + "/instances/add", json={"type": "decode", "instance": d2.address},
                              headers=KEY) as r:
                assert r.status == 200
                out = await r.json()
            assert out["decode_node_count"] == 2 and out["decode_nodes"] == [d1.address, d2.address]
            for _ in range(4):
                await (await c.post(url + "/v1/completions", json={"prompt": "x"})).read()
            assert len(d1.received) == len(d2.received) == 2
            async with c.post(url + "/instances/add", json={"type": "decode", "instance": d2.address},
                              headers=KEY) as r:
                assert r.status == 409 and "already in the pool" in await r.text()
            async with c.post(url + "/instances/add", json={"type": "prefill", "instance": wrong.address},
                              headers=KEY) as r:
                assert r.status == 400 and "serves ['other/model', 'other/model'], not" in await r.text()
            dead = f"127.0.0.1:{d2.port}"
            await d2.stop()
            async with c.post(url + "/instances/add", json={"type": "prefill", "instance": dead},
                              headers=KEY) as r:
                assert r.status == 400 and "was not added" in await r.text()
            assert len(s.pool.of_kind("prefill")) == 1

    run(go)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"type": "both", "instance": "127.0.0.1:1"}, "type: got 'both'"),
        ({"type": "decode"}, "instance: got None"),
        ({"type": "decode", "instance": "::1:8100"}, "must be written in brackets"),
        ({"type": "decode", "instance": "127.0.0.1"}, "no port"),
        ({"type": "decode", "instance": "bad host:80"}, "neither an IP address nor a DNS name"),
        (["decode"], "JSON object"),
    ],
)
def test_add_rejects_bad_bodies_naming_the_field(body: object, needle: str) -> None:
    async def go() -> None:
        async with stubs(1) as ps, stubs(1) as ds, proxy(ps, ds, admin_api_key=ADMIN_KEY) as (_s, url, c):
            async with c.post(url + "/instances/add", json=body, headers=KEY) as r:
                assert r.status == 400
                assert needle in (await r.json())["error"]["message"]

    run(go)


def test_add_ipv6_and_dns_instances() -> None:
    async def go() -> None:
        async with stubs(1) as ps, stubs(1) as ds, stubs(1, host="::1") as (v6,), stubs(1) as (named,), \
                proxy(ps, ds, admin_api_key=ADMIN_KEY) as (s, url, c):
            for inst in (v6.address, f"localhost:{named.port}"):
                async with c.post(url + "/instances/add", json={"type": "prefill", "instance": inst},
                                  headers=KEY) as r:
                    assert r.status == 200, await r.text()
            assert [i.key for i in s.pool.of_kind("prefill")][1:] == [f"[::1]:{v6.port}", f"localhost:{named.port}"]
            for _ in range(3):
                await (await c.post(url + "/v1/completions", json={"prompt": "x"})).read()
            assert len(v6.received) == 1 and len(named.received) == 1

    run(go)


def test_remove_unknown_is_404_and_names_the_known_ones() -> None:
    async def go() -> None:
        async with stubs(1) as ps, stubs(1) as (d,), proxy(ps, [d], admin_api_key=ADMIN_KEY) as (_s, url, c):
            async with c.post(url + "/instances/remove", json={"type": "decode", "instance": "127.0.0.1:1"},
                              headers=KEY) as r:
                assert r.status == 404
                assert f"known: {d.address}" in (await r.json())["error"]["message"]
            async with c.post(url + "/instances/remove", json={"type": "prefill", "instance": d.address},
                              headers=KEY) as r:
                assert r.status == 404  # right address, wrong kind

    run(go)


def test_remove_drains_a_stream_in_flight_first() -> None:
    async def go() -> None:
        async with stubs(1) as ps, stubs(2, tokens=10, delay=0.05) as ds, \
                proxy(ps, ds, admin_api_key=ADMIN_KEY) as (s, url, c):
            stream = asyncio.create_task(c.post(url + "/v1/completions", json={"prompt": "x", "stream": True}))
            await wait_for(lambda: any(d.active for d in ds))
            busy, other = ds if ds[0].active else ds[::-1]
            remove = asyncio.create_task(c.post(url + "/instances/remove", headers=KEY,
                                                json={"type": "decode", "instance": busy.address}))
            await wait_for(lambda: s.pool.get("decode", busy.address).draining)
            # while draining: new requests go to the other instance only, and the stream keeps flowing
            for _ in range(2):
                await (await c.post(url + "/v1/completions", json={"prompt": "y", "max_tokens": 1})).read()
            assert len(other.received) == 2 and len(busy.received) == 1 and not remove.done()
            events = sse_events(await (await stream).read())
            assert events[-1] == "[DONE]" and len(events) == 11  # complete, no error
            r = await remove
            out = await r.json()
            assert r.status == 200 and out["drained"] is True and out["waited_for"] == 1
            assert out["decode_nodes"] == [other.address]

    run(go)


def test_status_lists_instances_and_their_state() -> None:
    async def go() -> None:
        async with stubs(1) as (p,), stubs(2) as (d1, d2), proxy([p], [d1, d2]) as (s, url, c):
            d2.unhealthy = True
            await wait_for(lambda: len(s.pool.available("decode")) == 1)
            out = await (await c.get(url + "/status")).json()
            assert out["model"] == MODEL and out["admin_api"].startswith("disabled")
            assert out["prefill_node_count"] == 1 and out["decode_nodes"] == [d1.address, d2.address]
            states = {i["instance"]: i["healthy"] for i in out["instances"]["decode"]}
            assert states == {d1.address: True, d2.address: False}

    run(go)
