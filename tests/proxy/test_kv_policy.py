"""kv_aware over real sockets: stub upstreams, the real proxy, KV events encoded with vLLM's own
structs over a real ZMQ PUB socket to the proxy's SUB socket (the vLLM engine test is test_vllm_kv)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from mooncake_vllm.proxy.kv_hashes import PromptHasher
from mooncake_vllm.proxy.stub import StubUpstream
from mooncake_vllm.services import free_port

from ._helpers import ADMIN_KEY, proxy, run, stubs, wait_for

kv_events = pytest.importorskip("vllm.distributed.kv_events")
zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

BS = 4
DOC = " ".join(f"w{i}" for i in range(40))  # 10 full blocks of the stub's one-word tokens


class Publisher:
    """One instance's event stream: vLLM's KVEventBatch, msgpack, (topic, seq, payload)."""

    def __init__(self, endpoint: str, topic: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.connect(endpoint)
        self.topic, self.seq = topic.encode(), 0

    def send(self, *events: Any, seq: int | None = None) -> None:
        self.seq = self.seq if seq is None else seq
        batch = kv_events.KVEventBatch(ts=time.time(), events=list(events))
        self.sock.send_multipart((self.topic, self.seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)))
        self.seq += 1

    def close(self) -> None:
        self.sock.close(linger=0)


async def _publish_until_indexed(server: Any, pub: Publisher, blocks: int = 10) -> None:
    """Resend DOC until the proxy indexed it: its SUB socket drops what arrives before the PUB connected."""
    topic = pub.topic.decode()
    for _ in range(100):
        pub.send(_stored(DOC))
        if len(server.kv.indexes.get(topic, ())) >= blocks:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{topic}'s events were not indexed")


def _stored(text: str, medium: str = "GPU") -> Any:
    tokens = StubUpstream.tokenize(text)
    raw = PromptHasher("sha256", "vllm-none-hash").raw_hashes(tokens, BS)
    # what vLLM publishes by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): the low 64 bits as int
    hashes = [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in raw]
    return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens[: len(raw) * BS],
                                 block_size=BS, lora_id=None, medium=medium, lora_name=None)


async def _complete(client: Any, base: str, prompt: str) -> None:
    async with client.post(base + "/v1/completions", json={"model": "tiny-llama", "prompt": prompt,
                                                           "max_tokens": 2}) as r:
        assert r.status == 200, await r.text()


def _metric(text: str, needle: str) -> int:
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines() if line.startswith(needle))


def test_routes_to_the_holder_drops_on_gap_and_never_to_an_unhealthy_one() -> None:
    async def go() -> None:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        async with stubs(3) as ups, proxy([], ups, flow="kv_both", scheduling="kv_aware", kv_events=endpoint) as (
                server, base, client):
            pubs = [Publisher(endpoint, u.address) for u in ups]
            try:
                holder = ups[1]
                await _publish_until_indexed(server, pubs[1])
                await wait_for(lambda: server.kv.hasher is not None, timeout=15)  # a busy box: /version is slow
                assert server.kv.hasher is not None and server.kv.hasher.algorithm == "sha256"
                for _ in range(3):
                    await _complete(client, base, DOC + " question")
                assert [len(u.received) for u in ups] == [0, 3, 0]
                # a sequence gap drops the holder's index: routing falls back to cold/load
                pubs[1].send(seq=pubs[1].seq + 5)
                await wait_for(lambda: len(server.kv.indexes[holder.address]) == 0)
                # the pool (MOONCAKE) counts the same everywhere; a lone GPU copy on ups[2] wins
                pubs[2].send(_stored(DOC, "MOONCAKE"), _stored(DOC))
                await wait_for(lambda: len(server.kv.indexes.get(ups[2].address, ())) >= 10)
                await _complete(client, base, DOC)
                assert len(ups[2].received) == 1
                # unhealthy: never chosen, its index dropped; the pool copy elsewhere still counts
                ups[2].unhealthy = True
                await wait_for(lambda: ups[2].address not in [i.key for i in server.pool.available("decode")])
                await _complete(client, base, DOC)
                assert len(ups[2].received) == 1
                assert len(server.kv.indexes[ups[2].address]) == 0
                async with client.get(base + "/metrics") as r:
                    text = await r.text()
                assert _metric(text, 'mooncake_proxy_kv_aware_index_drops_total{reason="gap"}') == 1
                assert _metric(text, 'mooncake_proxy_kv_aware_index_drops_total{reason="left_rotation"}') == 1
                assert _metric(text, 'mooncake_proxy_kv_aware_decisions_total{kind="decode",outcome="local"}') == 4
                assert _metric(text, 'mooncake_proxy_kv_aware_predicted_local_tokens_total{kind="decode"}') == 160
                assert _metric(text, "mooncake_proxy_kv_aware_tokenizations_total") == 5
                assert _metric(text, "mooncake_proxy_kv_aware_tokenize_microseconds_total") > 0
            finally:
                for p in pubs:
                    p.close()

    run(go)


def test_unpredictable_hashes_fall_back_to_prefix_and_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)

    async def go() -> None:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        async with stubs(2, version="0.20.0") as ups, proxy([], ups, flow="kv_both", scheduling="kv_aware",
                                                            kv_events=endpoint) as (server, base, client):
            for _ in range(4):
                await _complete(client, base, DOC)
            assert "PYTHONHASHSEED" in server.kv.disabled
            assert sorted(len(u.received) for u in ups) == [0, 4]  # prefix-sticky
            async with client.get(base + "/metrics") as r:
                text = await r.text()
            assert _metric(text, 'mooncake_proxy_kv_aware_fallbacks_total{kind="decode",'
                                 'reason="unpredictable_hashes"}') == 4

    run(go)


def test_store_flow_picks_the_prefill_that_holds_the_prompt() -> None:
    async def go() -> None:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        async with stubs(2) as pre, stubs(1) as dec, proxy(pre, dec, scheduling="kv_aware", kv_events=endpoint) as (
                server, base, client):
            pub = Publisher(endpoint, pre[0].address)
            try:
                await _publish_until_indexed(server, pub)
                for _ in range(2):
                    await _complete(client, base, DOC)
                assert [len(p.received) for p in pre] == [2, 0] and len(dec[0].received) == 2
            finally:
                pub.close()

    run(go)


def test_batches_the_live_stream_lost_come_from_the_replay_socket() -> None:
    """vLLM's own publisher, started before the proxy: its first batch is lost on the live
    stream (no SUB yet, then the slow joiner) and comes through its replay socket instead."""
    async def go() -> None:
        endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        async with stubs(2) as ups:
            pub = kv_events.ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay, topic=ups[1].address)
            try:
                pub.publish(kv_events.KVEventBatch(ts=time.time(), events=[_stored(DOC)]))
                await asyncio.sleep(0.3)  # sent (and dropped: nobody subscribed) before the proxy starts
                async with proxy([], ups, flow="kv_both", scheduling="kv_aware", kv_events=endpoint,
                                 kv_replay=[f"{ups[1].address}={replay}"]) as (server, base, client):
                    await wait_for(lambda: len(server.kv.indexes.get(ups[1].address, ())) >= 10)
                    # live batches from here on continue the replayed sequence: no drop
                    pub.publish(kv_events.KVEventBatch(ts=time.time(), events=[_stored("x " + DOC)]))
                    await wait_for(lambda: server.kv.indexes[ups[1].address].last_seq == 1)
                    for _ in range(2):
                        await _complete(client, base, DOC + " question")
                    assert [len(u.received) for u in ups] == [0, 2]
                    async with client.get(base + "/metrics") as r:
                        text = await r.text()
                    assert _metric(text, 'mooncake_proxy_kv_aware_replays_total{outcome="ok"}') >= 1
                    assert _metric(text, "mooncake_proxy_kv_aware_index_drops_total") == 0
            finally:
                pub.shutdown()

    run(go)


def test_an_instance_added_through_the_admin_api_gets_its_replay_socket() -> None:
    """Its live stream goes nowhere (an endpoint nobody binds): only its replay socket, named in
    ``/instances/add``, can fill its index; removing it stops the replay."""
    async def go() -> None:
        endpoint, nowhere = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        replay = f"tcp://127.0.0.1:{free_port()}"
        async with stubs(2) as ups, proxy([], ups[:1], flow="kv_both", scheduling="kv_aware", kv_events=endpoint,
                                          admin_api_key=ADMIN_KEY) as (server, base, client):
            pub = kv_events.ZmqEventPublisher(0, endpoint=nowhere, replay_endpoint=replay, topic=ups[1].address)
            try:
                pub.publish(kv_events.KVEventBatch(ts=time.time(), events=[_stored(DOC)]))
                for bad, needle in (("127.0.0.1:1", "not tcp://HOST:PORT"),):
                    async with client.post(base + "/instances/add", headers={"X-API-Key": ADMIN_KEY},
                                           json={"type": "decode", "instance": ups[1].address, "kv_replay": bad}) as r:
                        assert r.status == 400 and needle in await r.text()
                async with client.post(base + "/instances/add", headers={"X-API-Key": ADMIN_KEY},
                                       json={"type": "decode", "instance": ups[1].address, "kv_replay": replay}) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["kv_replay"] == replay
                await wait_for(lambda: len(server.kv.indexes.get(ups[1].address, ())) >= 10)
                for _ in range(2):
                    await _complete(client, base, DOC + " question")
                assert [len(u.received) for u in ups] == [0, 2]
                async with client.post(base + "/instances/remove", headers={"X-API-Key": ADMIN_KEY},
                                       json={"type": "decode", "instance": ups[1].address}) as r:
                    assert r.status == 200, await r.text()
                assert ups[1].address not in server.kv.replay
            finally:
                pub.shutdown()

    run(go)


def test_kv_replay_in_an_add_needs_kv_aware() -> None:
    async def go() -> None:
        async with stubs(2) as ups, proxy([], ups[:1], flow="kv_both", admin_api_key=ADMIN_KEY) as (_s, base, client):
            async with client.post(base + "/instances/add", headers={"X-API-Key": ADMIN_KEY},
                                   json={"type": "decode", "instance": ups[1].address,
                                         "kv_replay": "tcp://127.0.0.1:5600"}) as r:
                assert r.status == 400 and "only kv_aware" in await r.text()

    run(go)


def test_auto_events_endpoints_let_two_proxies_share_a_host() -> None:
    async def go() -> None:
        async with stubs(1) as ups, \
                proxy([], ups, flow="kv_both", scheduling="kv_aware", kv_events="auto") as (s1, base1, client), \
                proxy([], ups, flow="kv_both", scheduling="kv_aware", kv_events="auto") as (s2, _base2, _c2):
            eps = [s.kv.subscriber.bound_endpoint for s in (s1, s2)]
            assert all(e and e.startswith("tcp://127.0.0.1:") for e in eps) and eps[0] != eps[1]
            async with client.get(base1 + "/status") as r:
                assert (await r.json())["kv_events"] == eps[0]
            pub = Publisher(str(eps[0]), ups[0].address)
            try:
                await _publish_until_indexed(s1, pub)
                assert len(s1.kv.indexes[ups[0].address]) >= 10 and not s2.kv.indexes
            finally:
                pub.close()

    run(go)


def test_kv_replay_items_are_checked() -> None:
    from mooncake_vllm.errors import ConfigError
    from mooncake_vllm.proxy.kv_policy import parse_replay

    assert parse_replay(["localhost:8100=tcp://127.0.0.1:5600"]) == {"localhost:8100": "tcp://127.0.0.1:5600"}
    with pytest.raises(ConfigError, match="--kv-replay.*127.0.0.1:8100=: the endpoint"):
        parse_replay(["127.0.0.1:8100"])
