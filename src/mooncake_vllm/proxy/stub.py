"""A tiny OpenAI-compatible upstream for the proxy's tests and benchmark (not a vLLM).

It serves ``/v1/models``, ``/health``, ``/version``, ``/metrics`` (vLLM's load and
prefix-cache counters: its own requests running, ``waiting``, ``hit_tokens``), ``/tokenize`` (one token per
whitespace-separated word, :meth:`StubUpstream.tokenize`), the two completion routes
(JSON or SSE, ``tokens`` chunks ``delay`` seconds apart) and a P2P bootstrap
``/query``, on a real loopback socket, and can be told to fail: answer 500, or
cut the connection after ``die_after`` stream chunks.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

__all__ = ["StubUpstream"]


@dataclass
class StubUpstream:
    """One fake instance; mutate the attributes to change its behaviour live."""

    model: str = "tiny-llama"
    version: str = "0.32.0"
    tokens: int = 8
    delay: float = 0.0
    fail_status: int | None = None  # answer completions with this status
    unhealthy: bool = False  # /health answers 503
    die_after: int | None = None  # cut the stream after this many chunks
    drop_requests: bool = False  # close the connection unanswered (a killed instance's keep-alive)
    engine_id: str | None = "engine-0"  # None: the bootstrap /query has no engine yet
    kv_params_out: dict[str, Any] | None = None  # returned in a non-stream answer
    host: str = "127.0.0.1"
    port: int = 0
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[Any] = field(default_factory=list)
    active: int = 0
    waiting: int = 0  # reported in /metrics as vllm:num_requests_waiting (other clients' requests)
    hit_tokens: int = 0  # reported as vllm:prefix_cache_hits_total
    _runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/query", self._query)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        return app

    async def start(self) -> int:
        """Listen on ``host:port`` (0 = a free port, remembered for restarts)."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _models(self, _r: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model",
                                                               "root": self.model}]})

    async def _health(self, _r: web.Request) -> web.Response:
        return web.Response(status=503 if self.unhealthy else 200)

    async def _version(self, _r: web.Request) -> web.Response:
        return web.json_response({"version": self.version})

    @staticmethod
    def tokenize(text: str) -> list[int]:
        """The stub's tokenizer: one id per whitespace-separated word."""
        return [zlib.crc32(w.encode()) % 50000 for w in text.split()]

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = body.get("prompt") or json.dumps(body.get("messages"))
        tokens = self.tokenize(text)
        return web.json_response({"count": len(tokens), "max_model_len": 2048, "tokens": tokens})

    async def _metrics(self, _r: web.Request) -> web.Response:
        prompt = sum(len(self.tokenize(str(b.get("prompt") or ""))) for b in self.received)
        return web.Response(text=(f'vllm:num_requests_running{{engine="0"}} {self.active}\n'
                                  f'vllm:num_requests_waiting{{engine="0"}} {self.waiting}\n'
                                  f'vllm:prompt_tokens_total{{engine="0"}} {prompt}.0\n'
                                  f'vllm:prefix_cache_hits_total{{engine="0"}} {self.hit_tokens}.0\n'))

    async def _query(self, _r: web.Request) -> web.Response:
        if self.engine_id is None:
            return web.json_response({})
        return web.json_response({"0": {"engine_id": self.engine_id, "worker_addr": {"0": {"0": "x:1"}}}})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.headers.append(request.headers.copy())  # case-insensitive
        if self.drop_requests and request.transport is not None:
            request.transport.abort()
            return web.Response()  # never sent: the connection is gone
        if self.fail_status is not None:
            return web.json_response({"error": {"message": "stub failure", "code": self.fail_status}},
                                     status=self.fail_status)
        chat = request.path.endswith("/chat/completions")
        n = min(int(body.get("max_tokens") or self.tokens), self.tokens)
        self.active += 1
        try:
            if not body.get("stream"):
                if self.delay:
                    await asyncio.sleep(self.delay * n)
                text = "".join(f" t{i}" for i in range(n))
                choice = {"index": 0, "finish_reason": "length"}
                choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
                out: dict[str, Any] = {"id": "cmpl-stub", "object": "completion", "model": self.model,
                                       "choices": [choice]}
                if self.kv_params_out is not None:
                    out["kv_transfer_params"] = self.kv_params_out
                return web.json_response(out)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(n):
                if self.die_after is not None and i >= self.die_after:
                    assert request.transport is not None
                    request.transport.abort()  # no terminating chunk: the client sees a broken stream
                    return resp
                if self.delay:
                    await asyncio.sleep(self.delay)
                delta = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
                chunk = {"id": "cmpl-stub", "choices": [{"index": 0, **delta}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.active -= 1
