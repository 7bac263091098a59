"""Instance load and cache counters from the instances' own /metrics (stub upstreams, the real proxy)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from mooncake_vllm.httpsafe import read_answer
from mooncake_vllm.proxy.engine_load import EngineLoad, parse, scrape
from mooncake_vllm.proxy.instances import Instance, parse_endpoint

from ._helpers import proxy, run, stubs, wait_for

VLLM_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 300.0
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="m"} 400.0
vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="m"} 2.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 0.5
"""


def test_parse_sums_label_sets_and_ignores_the_rest() -> None:
    assert parse(VLLM_TEXT) == {"running": 3.0, "waiting": 4.0, "kv_usage": 0.25, "prompt_tokens": 1000.0,
                                "hbm_hit_tokens": 600.0, "pool_hit_tokens": 300.0,
                                "prefill_tokens": 400.0, "prefill_seconds": 0.5, "prefill_requests": 2.0}
    assert parse("# nothing\nother_metric 1\n") == {}


def test_instance_load_is_ours_now_plus_the_engines_others_while_fresh() -> None:
    inst = Instance("decode", parse_endpoint("127.0.0.1:1"))
    inst.in_flight = 2
    assert inst.load == 2
    inst.engine = EngineLoad.from_metrics(parse(VLLM_TEXT), max_age=3.0, ours=2)  # 7 running or waiting
    assert inst.load == 7  # other clients' requests count too
    inst.in_flight = 1  # one of ours ended since that answer: it no longer counts
    assert inst.load == 6
    inst.engine = EngineLoad.from_metrics({"running": 3}, max_age=3.0, ours=3)
    assert inst.load == 1  # all the engine had were ours
    inst.engine = EngineLoad.from_metrics(parse(VLLM_TEXT), max_age=3.0, at=time.monotonic() - 10)
    assert inst.load == 1  # stale: only what the proxy knows


def test_proxy_metrics_repeat_each_instances_counters() -> None:
    async def go() -> None:
        async with stubs(2) as ups, proxy([], ups, flow="kv_both", engine_metrics_interval=0.1) as (
                server, base, client):
            ups[1].waiting, ups[1].hit_tokens = 5, 32
            async with client.post(base + "/v1/completions", json={"prompt": "a b c", "max_tokens": 1}) as r:
                assert r.status == 200
            await wait_for(lambda: all(i.engine is not None and i.engine.waiting == u.waiting
                                       for i, u in zip(server.pool.of_kind("decode"), ups)))
            assert server.pool.of_kind("decode")[1].load == 5
            async with client.get(base + "/metrics") as r:
                text = await r.text()
            inst = ups[1].address
            assert (f'mooncake_proxy_instance_engine_requests{{kind="decode",instance="{inst}",state="waiting"}} 5'
                    in text)
            assert f'mooncake_proxy_instance_cached_tokens_total{{kind="decode",instance="{inst}",source="hbm"}} 32' \
                in text
            assert "mooncake_proxy_instance_prompt_tokens_total" in text

    run(go)


def test_a_metrics_answer_that_arrives_in_two_parts_is_read_whole() -> None:
    """vLLM's /metrics (~100 KB, the prefill histograms in its last 15 %) may come in more than one
    read; the scrape parsed the first part alone, and an engine whose prefill counters read 0 was
    taken for a restarted one (issue 29: the next whole answer then brought its whole history as
    one poll's prefill). An answer over the limit is a failed read, not a parsed part."""
    body = VLLM_TEXT.encode()
    cut = body.index(b"vllm:request_prefill_kv_computed_tokens_sum")

    async def metrics(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_length = len(body)
        await resp.prepare(request)
        await resp.write(body[:cut])
        await asyncio.sleep(0.3)
        await resp.write(body[cut:])
        await resp.write_eof()
        return resp

    async def go() -> None:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        inst = Instance("decode", parse_endpoint(f"127.0.0.1:{port}"))
        try:
            async with aiohttp.ClientSession() as session:
                assert await scrape(session, inst, timeout=5.0, max_age=3.0)
                assert inst.engine is not None
                got = inst.engine.prefill_tokens, inst.engine.prefill_seconds, inst.engine.prefill_requests
                assert got == (400.0, 0.5, 2.0)
                async with session.get(f"{inst.url}/metrics") as up:
                    with pytest.raises(ValueError, match="over 100 bytes"):
                        await read_answer(up, 100)
        finally:
            await runner.cleanup()

    run(go)
