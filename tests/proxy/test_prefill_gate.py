"""The proxy's prefill gate: one streamed prefill at a time per instance, bounded waits."""

from __future__ import annotations

import asyncio

import pytest

from mooncake_vllm.proxy.prefill_gate import PrefillGate

from ._helpers import MODEL, proxy, run, stubs


def test_second_request_waits_for_the_first_token_ahead_then_goes() -> None:
    async def scenario() -> None:
        gate = PrefillGate(5.0)
        first = await gate.enter("a")
        other = await gate.enter("b")  # another instance: not held
        waiting = asyncio.ensure_future(gate.enter("a"))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        first.release()
        first.release()  # idempotent: the stream's first byte, then the request's end
        second = await asyncio.wait_for(waiting, 1.0)
        second.release()
        other.release()
        assert gate.counts == {"free": 2, "waited": 1}
        assert 0.04 < gate.waited_s < 1.0
        assert "mooncake_proxy_prefill_gate_total{outcome=\"waited\"} 1" in gate.render()

    run(scenario)


def test_a_wait_past_the_bound_goes_holding_nothing() -> None:
    async def scenario() -> None:
        gate = PrefillGate(0.05)
        first = await gate.enter("a")
        late = await gate.enter("a")
        assert gate.counts["timed_out"] == 1
        late.release()  # holds nothing: must not free the first's place
        waiting = asyncio.ensure_future(gate.enter("a"))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        first.release()
        (await waiting).release()

    run(scenario)


def test_a_cancelled_waiter_leaves_the_gate_usable() -> None:
    async def scenario() -> None:
        gate = PrefillGate(5.0)
        first = await gate.enter("a")
        waiting = asyncio.ensure_future(gate.enter("a"))
        await asyncio.sleep(0.01)
        waiting.cancel()
        first.release()
        (await asyncio.wait_for(gate.enter("a"), 1.0)).release()

    run(scenario)


def test_bound_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PrefillGate(0.0)


def test_the_proxy_sends_a_streamed_request_after_the_first_token_ahead_on_its_instance() -> None:
    async def go() -> None:
        async with stubs(1, tokens=3, delay=0.3) as (d,), \
                proxy([], [d], flow="kv_both", prefill_gate=5.0) as (s, url, c):
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}

            async def one() -> bytes:
                async with c.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    return await r.read()

            first = asyncio.ensure_future(one())
            await asyncio.sleep(0.1)
            second = asyncio.ensure_future(one())
            await asyncio.sleep(0.1)
            assert len(d.received) == 1  # held in the proxy: the first has no token yet
            await asyncio.gather(first, second)
            assert len(d.received) == 2
            assert s.gate is not None and s.gate.counts == {"free": 1, "waited": 1}
            async with c.post(url + "/v1/completions", json={**body, "stream": False}) as r:
                assert r.status == 200  # a whole answer is not gated
            assert sum(s.gate.counts.values()) == 2
            async with c.get(url + "/metrics") as r:
                assert 'mooncake_proxy_prefill_gate_total{outcome="waited"} 1' in await r.text()

    run(go)
