"""The XpYd proxy: an OpenAI-compatible aiohttp front over prefill and decode pools.

Per request: pick a decode-capable pool first (503 with a reason if none is
healthy), run the prefill step (``max_tokens=1``, see ``flows``), then relay the
decode answer byte for byte. Upstream failures become proper HTTP errors:
4xx pass through, 5xx and connection failures are 502 before the first byte (a
connection refused, or closed before any of the answer came, is first tried once on
another instance), and a stream that breaks after its first byte ends with an SSE
error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web

from mooncake_vllm.errors import ConfigError, ConfigProblem, JsonBodyError, ProxyError
from mooncake_vllm.httpsafe import (
    ConnectionGuard,
    GuardedTCPSite,
    describe_exc,
    loads_json,
    read_body,
    redact,
)
from mooncake_vllm.proxy import admin, engine_load, flows, kv_fallback, kv_policy, kv_prompt
from mooncake_vllm.proxy.config import ProxyConfig, config_from_env
from mooncake_vllm.proxy.instances import Instance, InstancePool, parse_endpoint
from mooncake_vllm.proxy.metrics import ProxyMetrics
from mooncake_vllm.proxy.scheduling import make_policy

__all__ = ["ProxyConfig", "ProxyServer", "config_from_env"]

log = logging.getLogger(__name__)

#: bytes of the prompt's beginning the prefix-aware policy hashes
PREFIX_CHARS = 256
_SSE = "text/event-stream"


def _answer(err: ProxyError) -> web.Response:
    """The client's error answer for ``err``."""
    return web.json_response(err.body(), status=err.status, headers=err.headers())


def _prefix_of(body: dict[str, Any]) -> bytes:
    """The first bytes of the prompt (completions) or first messages (chat)."""
    prompt = body.get("prompt")
    if prompt is None:
        msgs = body.get("messages")
        prompt = json.dumps(msgs[:2], sort_keys=True) if isinstance(msgs, list) else ""
    elif not isinstance(prompt, str):
        prompt = json.dumps(prompt[:PREFIX_CHARS] if isinstance(prompt, list) else prompt)
    return prompt[:PREFIX_CHARS].encode("utf-8", "surrogatepass")


class ProxyServer:
    """One proxy: the instance pool, policies, metrics, the shared client session."""

    def __init__(self, config: ProxyConfig) -> None:
        # kv_aware without its packages routes round robin (warned once, counted)
        config, self.fallback = kv_fallback.check(config)
        self.config = config
        self.pool = InstancePool()
        self.metrics = ProxyMetrics()
        self.policies = {k: make_policy(config.scheduling) for k in ("prefill", "decode")}
        self._use_prefix = config.scheduling in ("prefix", "kv_aware")
        if config.kv_replay:
            self.config = config = replace(config, kv_replay=kv_policy.parse_replay(config.kv_replay))
        self.kv = kv_policy.attach(self)
        if not config.unavailable_wait >= 0:
            raise ConfigError("--unavailable-wait", [ConfigProblem(
                "--unavailable-wait", f"must be 0 or more seconds, found {config.unavailable_wait!r}",
                "give the seconds a request may wait for an instance (0: answer 503 at once)")])
        self.tokenizer: kv_prompt.LocalTokenizer | None = None
        if config.tokenizer:
            if self.kv is None:
                raise ConfigError("--tokenizer", [ConfigProblem(
                    "--tokenizer", f"only --scheduling kv_aware uses it (this proxy: {config.scheduling})",
                    "add --scheduling kv_aware, or leave --tokenizer out")])
            self.tokenizer = kv_prompt.LocalTokenizer(config.tokenizer)
        if config.flow not in flows.FLOWS:
            raise ConfigError("--flow", [ConfigProblem("--flow", f"{config.flow!r} is not a flow",
                                                       f"use one of {', '.join(flows.FLOWS)}")])
        self.p2p_mode: str | None = None
        if config.flow == "p2p" and config.target_vllm:
            self.p2p_mode = flows.p2p_mode(flows.release_triple(config.target_vllm))
        for kind, addrs in (("prefill", config.prefill), ("decode", config.decode)):
            for addr in addrs:
                ep = parse_endpoint(addr, field_name=f"--{kind}")
                self.pool.add(Instance(kind, ep, healthy=False, last_error="not checked yet"))
        self.session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._load_task: asyncio.Task[None] | None = None
        self.pending_adds: set[tuple[str, str]] = set()
        self.guard = ConnectionGuard(
            max_connections=config.max_connections, header_timeout=config.header_timeout,
            idle_timeout=config.idle_timeout, name="proxy",
            header_timeout_hint="the proxy's header_timeout", max_connections_hint=(
                "raise the proxy's max_connections and its descriptor limit (ulimit -n)"))
        self.app = self._build_app()

    # ---- lifecycle -------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes + 1, middlewares=[self.guard.middleware])
        app.router.add_post("/v1/completions", self._route("/v1/completions"))
        app.router.add_post("/v1/chat/completions", self._route("/v1/chat/completions"))
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/health", self.handle_health)
        admin.install(self, app)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=30, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout, sock_connect=self.config.connect_timeout)
        # bodies are relayed as they come: ask upstreams for identity encoding, never decode
        # no cookie jar: the proxy is stateless towards upstreams (and it is cheaper per request)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                             skip_auto_headers=("Accept-Encoding",),
                                             cookie_jar=aiohttp.DummyCookieJar())
        await admin.check_all(self)  # the first round before serving: no 503 at start-up
        self._health_task = asyncio.create_task(admin.health_loop(self))
        if self.config.engine_metrics_interval > 0:
            self._load_task = asyncio.create_task(engine_load.poll_loop(self))
        if self.kv is not None:
            await kv_policy.start(self)
            await kv_prompt.resolve_version(self, self.kv)  # says at start if hashes are unpredictable

    async def _on_cleanup(self, _app: web.Application) -> None:
        if self.kv is not None:
            self.kv.stop()
        for task in (self._health_task, self._load_task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        if self.session is not None:
            await self.session.close()

    async def start(self) -> int:
        """Serve on ``config.host:config.port`` (0 = a free port); returns the port."""
        # on stop: listening ends at once, handlers in flight get up to drain_timeout to finish
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=self.config.drain_timeout,
                                     keepalive_timeout=self.config.idle_timeout, lingering_time=2.0)
        await self._runner.setup()
        site = GuardedTCPSite(self._runner, self.config.host, self.config.port, guard=self.guard, backlog=1024)
        await site.start()
        self.config.port = site.port
        return self.config.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- helpers ---------------------------------------------------------------

    async def pick_waiting(self, kind: str, prefix: bytes) -> Instance:
        """:meth:`pick`, after waiting up to ``unavailable_wait`` s for an instance of ``kind``
        to come back into rotation: on a busy host a live instance's health check can be late
        twice in a row (the soak's 1P1D decode: three requests answered 503 in 9 minutes)."""
        deadline = time.monotonic() + self.config.unavailable_wait
        while not self.pool.available(kind) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return self.pick(kind, prefix)

    def pick(self, kind: str, prefix: bytes) -> Instance:
        """An available instance of ``kind``; ProxyError 503 with the reason if none."""
        candidates = self.pool.available(kind)
        if not candidates:
            raise ProxyError(503, self.pool.unavailable_reason(kind), "service_unavailable", reason=f"no_{kind}")
        if self.fallback is not None:
            self.fallback.picks += 1
        return self.policies[kind].select(candidates, prefix)

    def _headers(self, request: web.Request, request_id: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        auth = request.headers.get("Authorization")
        if auth:
            headers["Authorization"] = auth
        elif self.config.upstream_api_key:
            headers["Authorization"] = f"Bearer {self.config.upstream_api_key}"
        return headers

    def secrets(self, request: web.Request | None = None) -> tuple[str | None, ...]:
        """Every secret an error text could echo: our keys and the client's own credentials."""
        out: list[str | None] = [self.config.upstream_api_key, self.config.admin_api_key]
        if request is not None:
            for name in ("Authorization", "X-API-Key"):
                value = request.headers.get(name)
                if value:
                    out += [value, value.partition(" ")[2].strip()]
        return tuple(out)

    def _fail(self, inst: Instance, reason: str, detail: str) -> None:
        """Count an upstream failure; connection-level ones take the instance out of rotation.
        ``detail`` goes to the log and ``GET /status``: it must already be free of secrets."""
        self.metrics.error(inst.kind, reason)
        if reason in ("connect", "disconnect", "timeout"):
            if inst.healthy:
                log.warning("%s instance %s leaves rotation: %s", inst.kind, inst.key, detail)
            inst.mark_failed(detail)
            self.pool.refresh()
        else:
            inst.errors += 1
            inst.last_error = detail

    def _upstream_failure(self, inst: Instance, exc: BaseException, *, last: bool,
                          secrets: tuple[str | None, ...] = ()) -> ProxyError | None:
        """The client's error for a failed upstream call, or None to retry elsewhere: a refused
        connection (the request never reached the instance) or one that closed before any of
        the answer came (a killed instance's kept-alive connection: nothing reached the client,
        and a completion has no effect to repeat). Error texts are ``describe_exc``: never
        ``repr``, whose aiohttp form holds the request headers."""
        if isinstance(exc, ProxyError):
            return exc
        secrets = (*secrets, *self.secrets())
        if isinstance(exc, aiohttp.ClientConnectorError):
            self._fail(inst, "connect", "connect failed: " + describe_exc(exc.os_error or exc, secrets))
            if last or not self.pool.available(inst.kind):
                return ProxyError(502, f"{inst.kind} instance {inst.key} is unreachable: {describe_exc(exc, secrets)}",
                                  reason="connect")
            return None
        if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):
            detail = describe_exc(exc, secrets)
            self._fail(inst, "disconnect", f"{inst.kind} disconnect before answering: {detail}")
            if last or not self.pool.available(inst.kind):
                return ProxyError(502, f"{inst.kind} instance {inst.key} failed before answering: {detail}",
                                  reason="disconnect")
            return None
        if isinstance(exc, asyncio.TimeoutError):
            self._fail(inst, "timeout", f"{inst.kind} timed out")
            return ProxyError(504, f"{inst.kind} instance {inst.key} timed out", "timeout", reason="timeout")
        detail = describe_exc(exc, secrets)
        self._fail(inst, "disconnect", f"{inst.kind} failed: {detail}")
        return ProxyError(502, f"{inst.kind} instance {inst.key} failed before answering: {detail}",
                          reason="disconnect")

    async def _read_upstream(self, inst: Instance, up: aiohttp.ClientResponse, limit: int) -> bytes:
        """At most ``limit`` bytes of an upstream answer; ProxyError 502 when it is longer."""
        buf = bytearray()
        async for chunk in up.content.iter_any():
            buf += chunk
            if len(buf) > limit:
                self._fail(inst, "too_large", f"{inst.kind} answer over {limit} bytes")
                raise ProxyError(502, f"{inst.kind} instance {inst.key} answered more than {limit} bytes (the "
                                 "proxy's max_upstream_bytes); raise it if such answers are expected",
                                 reason="too_large")
        return bytes(buf)

    async def _error_from(self, inst: Instance, up: aiohttp.ClientResponse,
                          secrets: tuple[str | None, ...] = ()) -> ProxyError:
        """A ProxyError for an upstream answer >= 400: 4xx as is, 5xx as 502. The upstream's
        text is cut to 2000 bytes (never read further) and redacted: an upstream that echoes
        the request would otherwise hand the client our upstream key."""
        raw = b""
        try:
            while len(raw) < 2000 and (chunk := await up.content.read(2000 - len(raw))):
                raw += chunk
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass  # what came is enough to explain the error
        text = redact(raw.decode("utf-8", "replace"), (*secrets, *self.secrets()))
        if up.status < 500:
            self.metrics.error(inst.kind, f"http_{up.status}")
            try:
                err = json.loads(text)
                msg = err.get("error", err).get("message") if isinstance(err, dict) else None
            except (ValueError, AttributeError):
                msg = None
            return ProxyError(up.status, redact(str(msg or text), (*secrets, *self.secrets())),
                              "invalid_request_error", reason=f"http_{up.status}")
        self._fail(inst, f"http_{up.status}", f"HTTP {up.status}")
        return ProxyError(502, f"{inst.kind} instance {inst.key} answered HTTP {up.status}: {text}",
                          reason=f"http_{up.status}")

    async def _post_prefill(self, route: str, body: dict[str, Any], headers: dict[str, str],
                            prefix: bytes, transfer_id: str,
                            secrets: tuple[str | None, ...] = ()) -> tuple[Instance, dict[str, Any] | None, int | None]:
        """Run the prefill step (one retry on another instance if a connection fails)."""
        mode = self.p2p_mode or ""
        data = json.dumps(flows.prefill_body(body, self.config.flow, mode, transfer_id)).encode()
        assert self.session is not None
        for attempt in (0, 1):
            inst = await self.pick_waiting("prefill", prefix)
            dp_rank = inst.next_dp_rank() if mode == "bootstrap" else None
            hdrs = headers if dp_rank is None else {**headers, "X-data-parallel-rank": str(dp_rank)}
            inst.acquire()
            try:
                async with self.session.post(inst.url + route, data=data, headers=hdrs) as up:
                    if up.status >= 400:
                        raise await self._error_from(inst, up, secrets)
                    raw = await self._read_upstream(inst, up, self.config.max_upstream_bytes)
                return inst, flows.parse_prefill_answer(self.config.flow, mode, raw), dp_rank
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                if (err := self._upstream_failure(inst, exc, last=attempt == 1, secrets=secrets)) is not None:
                    raise err from None
            finally:
                inst.release()
                if self.kv is not None:
                    self.kv.settle("prefill", prefix)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _prefill_step(self, request: web.Request, route: str, raw: bytes, body: dict[str, Any],
                            headers: dict[str, str], prefix: Any) -> bytes:
        """Run the prefill and build the decode request's body from its answer."""
        transfer_id = flows.new_transfer_id()
        prefill, pre_json, dp_rank = await self._post_prefill(route, body, headers, prefix, transfer_id,
                                                              self.secrets(request))
        if self.kv is not None:
            self.kv.observe("prefill", prefix, pre_json)
        try:
            plan = flows.plan_decode(self.config.flow, self.p2p_mode or "", prefill, transfer_id,
                                     pre_json, dp_rank)
        except ValueError as exc:
            self.metrics.error("prefill", "bad_params")
            raise ProxyError(502, str(exc), reason="bad_params") from None
        return raw if plan.decode_params is None else json.dumps(
            {**body, "kv_transfer_params": plan.decode_params}).encode()

    async def _relay_decode(self, request: web.Request, route: str, data: bytes, headers: dict[str, str],
                            prefix: bytes, stream: bool, t0: float) -> tuple[web.StreamResponse, int]:
        """Send the decode request and relay its answer (streamed or whole); also the status to record."""
        assert self.session is not None
        secrets = self.secrets(request)
        for attempt in (0, 1):
            inst = await self.pick_waiting("decode", prefix)
            inst.acquire()
            try:
                async with self.session.post(inst.url + route, data=data, headers=headers) as up:
                    if up.status >= 400:
                        raise await self._error_from(inst, up, secrets)
                    if not stream:
                        raw = await self._read_upstream(inst, up, self.config.max_upstream_bytes)
                        self.metrics.observe_ttfb(route, time.perf_counter() - t0)
                        if self.kv is not None:
                            self.kv.observe("decode", prefix, flows.parse_prefill_answer("store", "", raw))
                        return web.Response(body=raw, status=up.status, content_type=up.content_type or None), up.status
                    return await self._stream(request, inst, up, route, t0, prefix)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                if (err := self._upstream_failure(inst, exc, last=attempt == 1, secrets=secrets)) is not None:
                    raise err from None
            finally:
                inst.release()
                if self.kv is not None:
                    self.kv.settle("decode", prefix)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _stream(self, request: web.Request, inst: Instance, up: aiohttp.ClientResponse,
                      route: str, t0: float, prefix: Any = b"") -> tuple[web.StreamResponse, int]:
        """Relay an upstream stream; a break after the first byte ends with an SSE error event.
        Returns the response and the status to record (502 broken, 499 client gone). The first
        byte ends the request's prefill (``kv_aware`` stops counting it as queued work)."""
        ctype = up.headers.get("Content-Type", _SSE)
        resp = web.StreamResponse(status=up.status, headers={"Content-Type": ctype, "Cache-Control": "no-cache"})
        first = True
        try:
            async for chunk in up.content.iter_any():
                if first:
                    await resp.prepare(request)
                    self.metrics.observe_ttfb(route, time.perf_counter() - t0)
                    first = False
                    if self.kv is not None:
                        self.kv.settle("decode", prefix)
                await resp.write(chunk)
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                asyncio.TimeoutError) as exc:
            reason = "timeout" if isinstance(exc, asyncio.TimeoutError) else "disconnect"
            detail = describe_exc(exc, self.secrets(request))
            self._fail(inst, reason, f"stream broke: {detail}")
            err = ProxyError(502, f"decode instance {inst.key} broke the stream: {detail}", reason=reason)
            if first:  # nothing sent yet: a plain HTTP error
                raise err from None
            await resp.write(b"data: " + json.dumps(err.body()).encode() + b"\n\n")
            resp.force_close()
            await resp.write_eof()
            return resp, 502
        except ConnectionResetError:  # the client went away: drop the upstream request too
            up.close()
            return resp, 499
        if first:
            await resp.prepare(request)
        await resp.write_eof()
        return resp, up.status

    # ---- handlers --------------------------------------------------------------

    def _route(self, route: str):  # noqa: ANN202 - returns an aiohttp handler
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self.handle_completion(request, route)

        return handler

    async def handle_completion(self, request: web.Request, route: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        status = 500
        try:
            if request.content_type != "application/json":
                raise ProxyError(415, f"Content-Type must be application/json, got {request.content_type!r}",
                                 "invalid_request_error", reason="bad_request")
            try:
                raw = await read_body(request, limit=self.config.max_body_bytes, timeout=self.config.body_timeout,
                                      limit_hint="raise the proxy's --max-body-mb",
                                      timeout_hint="raise the proxy's body_timeout")
            except web.HTTPException as exc:  # 413/408: recorded and answered as what they are
                raise ProxyError(exc.status, (exc.text or exc.reason).strip(), "invalid_request_error",
                                 reason="too_large" if exc.status == 413 else "body_timeout") from None
            try:
                body = loads_json(raw, what="request body")
            except JsonBodyError as exc:
                raise ProxyError(400, str(exc), "invalid_request_error", reason="bad_request") from None
            if not isinstance(body, dict):
                raise ProxyError(400, "request body must be a JSON object", "invalid_request_error",
                                 reason="bad_request")
            if not self.pool.available("decode"):
                await self.pick_waiting("decode", b"")  # or the 503 with its reason
            if self.config.flow == "p2p" and self.p2p_mode is None:
                raise ProxyError(503, "the upstream vLLM version is not known yet (no instance answered "
                                 "GET /version); pass --target-vllm X.Y.Z or wait for an instance",
                                 "service_unavailable", reason="version_unknown")
            prefix = _prefix_of(body) if self._use_prefix else b""
            if self.kv is not None:
                prefix = await kv_prompt.prompt_key(self, body, route, prefix)
            request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
            headers = self._headers(request, request_id)
            data = raw if self.config.flow == "kv_both" else await self._prefill_step(
                request, route, raw, body, headers, prefix)
            resp, status = await self._relay_decode(request, route, data, headers, prefix,
                                                    bool(body.get("stream")), t0)
            return resp
        except ProxyError as exc:
            status = exc.status
            if exc.status >= 500:
                self.metrics.error("proxy", exc.reason)
            return _answer(exc)
        finally:
            self.metrics.observe(route, status, time.perf_counter() - t0)

    async def handle_models(self, request: web.Request) -> web.Response:
        """``GET /v1/models`` from a healthy decode (else prefill) instance."""
        assert self.session is not None
        kind = "decode" if self.pool.available("decode") else "prefill"
        try:
            inst = self.pick(kind, b"")
            async with self.session.get(inst.url + "/v1/models", headers=self._headers(request, "models")) as up:
                if up.status >= 400:
                    raise await self._error_from(inst, up, self.secrets(request))
                raw = await self._read_upstream(inst, up, 16 << 20)
                return web.Response(body=raw, status=up.status, content_type="application/json")
        except ProxyError as exc:
            return _answer(exc)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            detail = describe_exc(exc, self.secrets(request))
            return _answer(ProxyError(502, f"{kind} instance failed to list models: {detail}"))

    async def handle_metrics(self, _request: web.Request) -> web.Response:
        text = (self.metrics.render(self.pool) + engine_load.render(self.pool)
                + (self.kv.render() if self.kv is not None else "")
                + (self.fallback.render() if self.fallback is not None else ""))
        return web.Response(text=text, content_type="text/plain",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def handle_health(self, _request: web.Request) -> web.Response:
        kinds = ("decode",) if self.config.flow == "kv_both" else ("prefill", "decode")
        problems = [self.pool.unavailable_reason(k) for k in kinds if not self.pool.available(k)]
        if problems:
            return web.json_response({"status": "unhealthy", "reasons": problems}, status=503)
        return web.json_response({"status": "ok"})
