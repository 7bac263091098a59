"""kv_aware's own tokenizer (proxy/kv_prompt.py, ``--tokenizer``): completion prompts are
tokenized in the proxy, no instance's ``/tokenize`` is asked, and the route is the same.
Real proxy, stub upstreams, vLLM's KV-event structs over a real ZMQ socket."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from mooncake_vllm.errors import ConfigError
from mooncake_vllm.proxy.kv_prompt import INLINE_CHARS, LocalTokenizer, encode
from mooncake_vllm.proxy.server import ProxyConfig, ProxyServer
from mooncake_vllm.proxy.stub import StubUpstream
from mooncake_vllm.services import free_port

from ._helpers import MODEL, proxy, run, stubs, wait_for
from .test_kv_policy import DOC, Publisher, _complete, _metric, _publish_until_indexed

pytest.importorskip("zmq")
pytest.importorskip("transformers")


def _stub_tokenizer(path: Path) -> Path:
    """A Hugging Face tokenizer that makes the stub's ids (one per word), saved like a model's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = DOC.split() + ["question"]
    vocab = {w: StubUpstream.tokenize(w)[0] for w in words} | {"<unk>": 50001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(path))
    return path


def test_a_prompt_up_to_the_inline_size_is_tokenized_without_a_thread_hop() -> None:
    """A worker thread's wake-up and GIL hand-offs cost 16-19 ms per request on the loaded bench box."""
    threads: list[int] = []

    class Recording:
        def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
            threads.append(threading.get_ident())
            return [len(prompt)]

    async def main() -> int:
        tok: LocalTokenizer = Recording()  # type: ignore[assignment]
        assert await encode(tok, "x" * INLINE_CHARS) == [INLINE_CHARS]
        assert await encode(tok, "x" * (INLINE_CHARS + 1), False) == [INLINE_CHARS + 1]
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert threads[0] == loop_thread and threads[1] != loop_thread


def test_the_local_tokenizer_makes_the_instances_tokens(tmp_path: Path) -> None:
    local = LocalTokenizer(str(_stub_tokenizer(tmp_path / "tok")))
    assert local.encode(DOC + " question") == StubUpstream.tokenize(DOC + " question")


def test_a_local_tokenizer_routes_without_asking_an_instance(tmp_path: Path) -> None:
    path = _stub_tokenizer(tmp_path / "tok")

    async def go() -> None:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        async with stubs(2) as ups, proxy([], ups, flow="kv_both", scheduling="kv_aware", kv_events=endpoint,
                                          tokenizer=str(path)) as (server, base, client):
            pub = Publisher(endpoint, ups[1].address)
            try:
                await _publish_until_indexed(server, pub)
                await wait_for(lambda: server.kv.hasher is not None, timeout=15)
                for _ in range(3):
                    await _complete(client, base, DOC + " question")
                assert [len(u.received) for u in ups] == [0, 3]
                async with client.get(base + "/metrics") as r:
                    text = await r.text()
                assert _metric(text, "mooncake_proxy_kv_aware_tokenizations_local_total") == 3
                assert _metric(text, "mooncake_proxy_kv_aware_tokenizations_total") == 0
                assert _metric(text, "mooncake_proxy_kv_aware_tokenize_local_microseconds_total") > 0
                assert _metric(text, 'mooncake_proxy_kv_aware_select_microseconds_total{kind="decode"}') > 0
            finally:
                pub.close()

    run(go)


def test_a_tokenizer_is_refused_where_nothing_would_use_it_or_nothing_loads(tmp_path: Path) -> None:
    path = _stub_tokenizer(tmp_path / "tok")
    with pytest.raises(ConfigError, match="--tokenizer.*kv_aware"):
        ProxyServer(ProxyConfig(model=MODEL, decode=["127.0.0.1:1"], flow="kv_both", tokenizer=str(path)))
    with pytest.raises(ConfigError, match="--tokenizer.*not a directory"):
        LocalTokenizer(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="--tokenizer.*no tokenizer loads"):
        LocalTokenizer(str(tmp_path / "empty"))
