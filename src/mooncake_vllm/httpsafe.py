"""Safe serving for mooncake-vllm's aiohttp servers (the XpYd proxy, the metadata server).

* :func:`redact` / :func:`describe_exc`: error text without secrets. Bearer and
  Basic credentials, ``Authorization``/``X-API-Key``/``token``/``password``
  values, ``user:password@`` in URLs and any secret value the caller names are
  replaced by ``***``; exceptions are described by ``str`` (never ``repr``, whose
  aiohttp form carries the request headers).
* :func:`loads_json`: ``json.loads`` that answers a too-deeply nested document
  with :class:`JsonBodyError` (a 400 with a reason), never a ``RecursionError``.
* :class:`ConnectionGuard`: per-connection limits aiohttp lacks: a request head
  must arrive within ``header_timeout`` seconds, an idle keep-alive connection
  is closed after ``idle_timeout``, and at most ``max_connections`` are open
  (below the process's descriptor limit). At the cap the oldest idle
  connection makes room; when none is idle a new one gets 503 and is closed.
* :func:`read_body`: the request body within ``body_timeout`` seconds and
  ``limit`` bytes: 408/413 with a message naming the limit and how to raise it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import resource
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web

from mooncake_vllm.errors import JsonBodyError

__all__ = [
    "MAX_JSON_DEPTH",
    "ConnectionGuard",
    "GuardedTCPSite",
    "describe_exc",
    "descriptor_limit",
    "loads_json",
    "read_answer",
    "read_body",
    "redact",
]

log = logging.getLogger(__name__)

#: deepest JSON nesting a body may have (OpenAI requests and Mooncake metadata need far less)
MAX_JSON_DEPTH = 128
#: descriptors kept free for everything else a server process holds (logs, backends, pipes)
FD_RESERVE = 32

_SECRET_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # "Bearer abc", "Basic abc=" (any case), also inside repr()s of header dicts
    (re.compile(r"(?i)\b(bearer|basic)(\s+)[^\s'\",;)>\]}]+"), r"\1\2***"),
    # Authorization: x / "x-api-key": "x" / token=x / password=x / api_key: x
    (re.compile(r"(?i)\b((?:proxy-)?authorization|x-api-key|api[-_]?key|[a-z_]*token|passw(?:or)?d|secret)"
                r"(['\"]?\s*[:=]\s*['\"]?)(?!\*\*\*)[^\s'\",;&)>\]}]+"), r"\1\2***"),
    # scheme://user:password@host
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@'\"]*@"), r"\1***@"),
)


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` with credentials replaced by ``***`` (see the module docstring)."""
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    for pattern, repl in _SECRET_PATTERNS:
        text = pattern.sub(repl, text)
    return text


def describe_exc(exc: BaseException, secrets: Iterable[str | None] = (), limit: int = 300) -> str:
    """``"TypeName: message"`` of ``exc``, redacted and at most ``limit`` characters.

    Uses ``str(exc)``, not ``repr``: an aiohttp error's repr holds its
    ``RequestInfo``, i.e. every header sent (``Authorization`` included).
    """
    text = str(exc).strip()
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    text = redact(text, secrets)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def loads_json(raw: bytes | str, *, max_depth: int = MAX_JSON_DEPTH, what: str = "body") -> Any:
    """Parse ``raw``; :class:`JsonBodyError` with the reason if it is not JSON or nests deeper than ``max_depth``."""
    too_deep = JsonBodyError(f"{what} nests JSON arrays/objects deeper than {max_depth} levels; "
                             f"flatten it (no OpenAI request or Mooncake metadata entry needs that many)")
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise JsonBodyError(f"{what} is not valid JSON ({exc})") from None
    openers = raw.count(b"[") + raw.count(b"{") if isinstance(raw, bytes) else raw.count("[") + raw.count("{")
    if openers > max_depth:  # cannot be deeper otherwise: skip the walk for ordinary bodies
        stack: list[tuple[Any, int]] = [(doc, 1)]
        while stack:
            node, depth = stack.pop()
            if depth > max_depth:
                raise too_deep
            for child in (node.values() if isinstance(node, dict) else node):
                if type(child) in (dict, list):
                    stack.append((child, depth + 1))
    return doc


def descriptor_limit() -> int:
    """The process's soft RLIMIT_NOFILE (raised to the hard limit where allowed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 16
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, 1 << 20), hard))
            soft = min(want, 1 << 20)
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def _plain(status: int, reason: str, message: str) -> bytes:
    body = (message + "\n").encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n"
            + ("Retry-After: 1\r\n" if status == 503 else "") + "\r\n").encode() + body


class _Guarded(asyncio.Protocol):
    """One connection: forwards to aiohttp's protocol and enforces the guard's timeouts."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard, self.inner = guard, inner
        self.transport: asyncio.Transport | None = None
        self.busy = 0  # requests of this connection inside a handler
        self.pending = False  # bytes of a request arrived since it went idle
        self.timer: asyncio.TimerHandle | None = None
        self.refused = False

    # ---- asyncio.Protocol ---------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if not self.guard._admit(self):  # noqa: SLF001 - the guard's own helper
            self.refused = True
            transport.write(_plain(503, "Service Unavailable", self.guard.full_message()))  # type: ignore[attr-defined]
            transport.close()
            return
        self.inner.connection_made(transport)
        self._arm(self.guard.header_timeout)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if not self.pending:
            self.pending = True
            if not self.busy:  # the first byte of a request head: it must complete in header_timeout
                self._arm(self.guard.header_timeout)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self.refused else self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self.guard._conns.pop(self, None)  # noqa: SLF001
        self.guard._by_transport.pop(self.transport, None)  # noqa: SLF001
        if not self.refused:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if not self.refused:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if not self.refused:
            self.inner.resume_writing()

    # ---- request bracketing (from the middleware) ------------------------------------
    def enter(self) -> None:
        self.busy += 1
        self.pending = False
        self._cancel()

    def leave(self) -> None:
        self.busy -= 1
        if self.busy == 0 and self in self.guard._conns:  # noqa: SLF001 - not closed meanwhile
            self.guard._conns.pop(self, None)  # noqa: SLF001 - most recently used last
            self.guard._conns[self] = None  # noqa: SLF001
            self._arm(self.guard.header_timeout if self.pending else self.guard.idle_timeout)

    @property
    def idle(self) -> bool:
        return not self.busy and not self.pending

    # ---- timers ------------------------------------------------------------------
    def _arm(self, seconds: float) -> None:
        self._cancel()
        if seconds and seconds > 0:
            self.timer = asyncio.get_running_loop().call_later(seconds, self._expired)

    def _cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expired(self) -> None:
        self.timer = None
        t = self.transport
        if self.busy or t is None or t.is_closing():
            return
        if t.get_write_buffer_size():  # still sending the last response: give it more time
            self._arm(self.guard.idle_timeout)
            return
        if self.pending:
            self.guard.timed_out += 1
            t.write(_plain(408, "Request Timeout", f"request head not received within {self.guard.header_timeout:g} s"
                           f"; send the whole request at once ({self.guard.header_timeout_hint})"))
        t.close()

    def evict(self) -> None:
        self.guard.evicted += 1
        if self.transport is not None:
            self.transport.close()


class ConnectionGuard:
    """Connection limits for one aiohttp server (see the module docstring).

    Use :meth:`wrap` as the protocol factory (done by :class:`GuardedTCPSite`)
    and add :attr:`middleware` to the application, first.
    """

    def __init__(self, *, max_connections: int | None = None, header_timeout: float = 10.0,
                 idle_timeout: float = 60.0, body_timeout: float = 60.0, name: str = "server",
                 header_timeout_hint: str = "", max_connections_hint: str = "") -> None:
        limit = descriptor_limit()
        cap = max(1, limit - FD_RESERVE)
        self.max_connections = min(max_connections, cap) if max_connections else min(4096, cap)
        self.header_timeout, self.idle_timeout, self.body_timeout = header_timeout, idle_timeout, body_timeout
        self.name = name
        self.header_timeout_hint = header_timeout_hint or "the server's header timeout"
        self.max_connections_hint = max_connections_hint or "raise the descriptor limit (ulimit -n)"
        self._conns: dict[_Guarded, None] = {}  # insertion order = least recently used first
        self._by_transport: dict[Any, _Guarded] = {}
        self.refused = self.evicted = self.timed_out = 0
        self._warned = False

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        def make() -> asyncio.Protocol:
            return _Guarded(self, factory())

        return make

    def full_message(self) -> str:
        return (f"{self.name}: too many connections ({self.max_connections} open, all busy); retry, or "
                f"{self.max_connections_hint}")

    def _admit(self, proto: _Guarded) -> bool:
        if len(self._conns) >= self.max_connections:
            victim = next((c for c in self._conns if c.idle), None)
            if victim is None:
                self.refused += 1
                if not self._warned:
                    self._warned = True
                    log.warning("%s", self.full_message())
                return False
            self._conns.pop(victim, None)
            victim.evict()
        self._conns[proto] = None
        self._by_transport[proto.transport] = proto
        return True

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        proto = self._by_transport.get(request.transport)
        if proto is None:
            return await handler(request)
        proto.enter()
        try:
            return await handler(request)
        finally:
            proto.leave()


class GuardedTCPSite(web.TCPSite):
    """``web.TCPSite`` whose connections go through a :class:`ConnectionGuard`."""

    def __init__(self, runner: web.BaseRunner, host: str | None, port: int, *, guard: ConnectionGuard,
                 backlog: int = 128, reuse_address: bool | None = None) -> None:
        super().__init__(runner, host, port, backlog=backlog, reuse_address=reuse_address)
        self._guard_obj, self._gr = guard, runner
        self._g_host, self._g_port, self._g_backlog, self._g_reuse = host, port, backlog, reuse_address

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._gr.server
        assert server is not None
        loop = asyncio.get_running_loop()

        def factory() -> asyncio.Protocol:
            return server()

        # asyncio accepts up to ``backlog`` sockets per loop iteration before any of them reaches
        # the guard: a burst could exhaust the descriptors first. Accept a few at a time...
        batch = max(1, min(self._g_backlog, FD_RESERVE // 8))
        self._server = await loop.create_server(
            self._guard_obj.wrap(factory), self._g_host, self._g_port, backlog=batch,
            reuse_address=self._g_reuse)
        for tsock in self._server.sockets:  # ...but keep the kernel's queue of pending connections long
            dup = tsock.dup()
            try:
                dup.listen(self._g_backlog)
            finally:
                dup.close()

    @property
    def port(self) -> int:
        sockets = getattr(self._server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else int(self._g_port)


async def read_answer(up: Any, limit: int) -> bytes:
    """All of an upstream answer's body (an aiohttp ``ClientResponse``), at most ``limit``
    bytes (``ValueError`` beyond). ``up.content.read(n)`` alone returns what has arrived so
    far: vLLM 0.32's ``/metrics`` is ~100 KB with the prefill histograms in its last 15 %,
    and a cut answer read as an engine whose counters went back to 0 (issue 29)."""
    body = bytearray()
    while chunk := await up.content.read(limit + 1 - len(body)):
        body += chunk
        if len(body) > limit:
            raise ValueError(f"answer over {limit} bytes")
    return bytes(body)


async def read_body(request: web.Request, *, limit: int, timeout: float, limit_hint: str,
                    timeout_hint: str = "") -> bytes:
    """The whole body, or ``web.HTTPException`` 413 (over ``limit``) / 408 (slower than ``timeout``)."""
    size = request.content_length
    def too_big(size: object) -> str:
        return f"request body of {size} bytes is over the limit of {limit} bytes; send a smaller body or {limit_hint}"
    if size is not None and size > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size, text=too_big(size) + "\n")
    async def whole() -> bytes:
        if size is not None:
            return await request.read()  # Content-Length checked above
        buf = bytearray()
        async for chunk in request.content.iter_any():
            buf += chunk
            if len(buf) > limit:
                raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(buf),
                                                    text=too_big(f"more than {limit}") + "\n")
        return bytes(buf)

    try:
        return await asyncio.wait_for(whole(), timeout)
    except asyncio.TimeoutError:
        exc = web.HTTPRequestTimeout(
            text=f"request body not received within {timeout:g} s; send it at once"
                 + (f" or {timeout_hint}" if timeout_hint else "") + "\n")
        exc.force_close()  # the rest of the body may still come: the connection cannot be reused
        raise exc from None
    except web.HTTPRequestEntityTooLarge as exc:
        if exc.text and "over the limit" in exc.text:
            raise
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=limit + 1,
                                            text=too_big(f"more than {limit}") + "\n") from None
