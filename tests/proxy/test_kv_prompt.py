"""kv_aware's own tokenizer (proxy/kv_prompt.py, ``--tokenizer``): completion prompts are
tokenized in the proxy, no instance's ``/tokenize`` is asked, and the route is the same.
Real proxy, stub upstreams, vLLM's KV-event structs over a real ZMQ socket."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mooncake_vllm.errors import ConfigError
from mooncake_vllm.proxy.kv_prompt import LocalTokenizer
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


def test_the_local_tokenizer_encodes_through_the_backend_keeping_the_gil(tmp_path: Path) -> None:
    """Hugging Face's call goes through ``encode_batch``, which releases the GIL: winning it back
    from the proxy's other threads cost 15-19 ms per request in issue 29's bench (~1.4 ms of work)."""
    local = LocalTokenizer(str(_stub_tokenizer(tmp_path / "tok")))
    real = local._tok.backend_tokenizer

    class NoBatch:
        def __getattr__(self, name: str) -> Any:
            if name == "encode_batch":
                raise AssertionError("encode_batch releases the GIL")
            return getattr(real, name)

    local._tok._tokenizer = NoBatch()
    assert local.encode(DOC + " question") == StubUpstream.tokenize(DOC + " question")
    real.enable_truncation(2)  # a backend that truncates: Hugging Face's call, which turns it off
    local._tok._tokenizer = real
    assert local.encode(DOC + " question") == StubUpstream.tokenize(DOC + " question")


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
                assert _metric(text, "mooncake_proxy_kv_aware_tokenizations_reused_total") == 2  # the same prompt
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
