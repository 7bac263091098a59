"""kv_aware's view of one request: its tokens, and the instances' release.

The tokens come from the instances' own ``POST /tokenize`` (their exact tokenizer and chat
template; a round trip that adds to every request's time to first token: 75-170 ms per
request on the 2-core dev box, issue 29's bench) or, for completion prompts, from the
model's tokenizer loaded by the proxy itself (``--tokenizer``: no round trip). A wrong
token only costs a worse route, never wrong KV: the instances key their blocks themselves.

The proxy's tokenizer encodes through its Rust backend's single ``encode``, which keeps the
GIL for its ~1.4 ms, on the event loop's thread: Hugging Face's ``tokenizer(text)`` goes through
``encode_batch``, which releases the GIL and must win it back from the proxy's other threads (the
KV event subscriber, the replay thread), up to a switch interval (5 ms) each time: 6.8 ms beside
one busy Python thread on the idle dev box, 15-19 ms per request in issue 29's bench (counted as
``tokenize_local_microseconds``), on a worker thread or not, added to every request's time to first token.
A prompt that extends a recent one (a conversation's next turn) has only its tail encoded (:mod:`.kv_tokens`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import aiohttp

from mooncake_vllm.errors import ConfigError, ConfigProblem
from mooncake_vllm.httpsafe import read_answer
from mooncake_vllm.proxy.kv_policy import KvRouter, PromptKey, ProxyServer
from mooncake_vllm.proxy.kv_tokens import Encoding, PrefixEncodings

__all__ = ["LocalTokenizer", "prompt_key", "resolve_version"]

log = logging.getLogger(__name__)

#: request fields that change vLLM's block hashes (extra keys) or the tokens in ways we do not predict
_UNPREDICTABLE = ("cache_salt", "multi_modal_data", "prompt_embeds", "mm_processor_kwargs")
_CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
                "tools", "add_special_tokens")


class LocalTokenizer:
    """The served model's Hugging Face tokenizer, loaded from a local directory (never the hub)."""

    def __init__(self, path: str) -> None:
        where = Path(path).expanduser()
        fix = ("give the directory of the served model (or of its tokenizer files), readable by the "
               "proxy, or leave --tokenizer out (kv_aware then asks an instance's /tokenize)")
        if not where.is_dir():
            raise ConfigError("--tokenizer", [ConfigProblem("--tokenizer", f"{path!r} is not a directory", fix)])
        try:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(str(where), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any loader failure is one clear start error
            raise ConfigError("--tokenizer", [ConfigProblem(
                "--tokenizer", f"{path!r}: no tokenizer loads from it ({type(exc).__name__}: {exc})",
                fix)]) from exc
        self.prefixes = PrefixEncodings(self._whole)  # a conversation's next turn: only its tail encoded

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """The prompt's tokens as vLLM's completion endpoint makes them: through the fast tokenizer's
        backend (one ``encode``, the GIL kept) unless it truncates or pads, which Hugging Face's call
        turns off per call."""
        if self._backend() is not None:
            return self.prefixes.encode(prompt, add_special_tokens)
        return list(self._tok(prompt, add_special_tokens=add_special_tokens)["input_ids"])

    def _backend(self) -> Any:
        backend = getattr(self._tok, "backend_tokenizer", None)
        return backend if backend is not None and backend.truncation is None and backend.padding is None else None

    def _whole(self, text: str, add_special_tokens: bool) -> Encoding:
        enc = self._backend().encode(text, add_special_tokens=add_special_tokens)
        return enc.ids, enc.offsets


async def prompt_key(server: ProxyServer, body: dict[str, Any], route: str, prefix: bytes) -> PromptKey:
    """The request's routing key: its tokens from the proxy's own tokenizer (``--tokenizer``,
    completions) or else from an instance's ``/tokenize`` (time-boxed)."""
    router: KvRouter | None = getattr(server, "kv", None)
    if router is not None and not router.hashers and not router.disabled:
        await resolve_version(server, router)
    if router is None or router.disabled or any(body.get(f) is not None for f in _UNPREDICTABLE):
        return PromptKey(prefix, None)
    if router.block_size() is None:  # no instance published a block yet: nothing to compare, no /tokenize
        return PromptKey(prefix, None)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return PromptKey(prefix, list(prompt))
    if route.endswith("/chat/completions") and isinstance(body.get("messages"), list):
        req = {"messages": body["messages"], **{f: body[f] for f in _CHAT_FIELDS if f in body}}
    elif isinstance(prompt, str):
        req = {"prompt": prompt, **({"add_special_tokens": body["add_special_tokens"]}
                                    if "add_special_tokens" in body else {})}
    else:
        return PromptKey(prefix, None)
    local = getattr(server, "tokenizer", None)
    if local is not None and "prompt" in req:
        t0 = time.perf_counter()
        reused = local.prefixes.reused
        tokens = local.encode(req["prompt"], req.get("add_special_tokens", True))  # keeps the GIL: no hop
        router.counters[("tokenizations_local",)] += 1
        router.counters[("tokenizations_reused",)] += local.prefixes.reused - reused
        # its wall time: what kv_aware adds to the request's time to first token
        router.counters[("tokenize_local_microseconds",)] += int((time.perf_counter() - t0) * 1e6)
        return PromptKey(prefix, tokens)
    insts = server.pool.available("decode") or server.pool.available("prefill")
    if not insts or server.session is None:
        return PromptKey(prefix, None)
    inst = min(insts, key=lambda i: (i.load, i.requests))  # its API server answers soonest
    timeout = aiohttp.ClientTimeout(total=server.config.kv_tokenize_timeout)
    t0 = time.perf_counter()
    try:
        async with server.session.post(inst.url + "/tokenize", data=json.dumps({"model": body.get("model"), **req}),
                                       headers={"Content-Type": "application/json"}, timeout=timeout) as up:
            if up.status != 200:
                raise ValueError(f"HTTP {up.status}")
            answer = json.loads(await read_answer(up, server.config.max_upstream_bytes))
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list):
            raise ValueError("no tokens in the answer")
        # what kv_aware adds to every request's time to first token
        router.counters[("tokenize_microseconds",)] += int((time.perf_counter() - t0) * 1e6)
        router.counters[("tokenizations",)] += 1
        return PromptKey(prefix, tokens)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        router.counters[("fallbacks", "tokenize", type(exc).__name__)] += 1
        router._log_once("tokenize", "kv_aware could not tokenize through %s (%s); such requests route like "
                         "prefix", inst.key, type(exc).__name__)
        return PromptKey(prefix, None)


async def resolve_version(server: ProxyServer, router: KvRouter) -> None:
    """The instances' vLLM release: ``--target-vllm`` or an instance's ``GET /version`` (time-boxed)."""
    version = server.config.target_vllm
    insts = server.pool.available("decode") or server.pool.available("prefill")
    if not version and insts and server.session is not None:
        try:
            timeout = aiohttp.ClientTimeout(total=server.config.kv_tokenize_timeout)
            async with server.session.get(insts[0].url + "/version", timeout=timeout) as up:
                doc = json.loads(await read_answer(up, 1 << 16)) if up.status == 200 else None
            version = doc.get("version") if isinstance(doc, dict) else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            version = None
    if version:
        router.configure(str(version))
        log.info("kv_aware: instances run vLLM %s; hashers %s%s", version,
                 [h.algorithm for h in router.hashers], f" ({router.disabled})" if router.disabled else "")
