"""Embedded HTTP metadata server speaking Mooncake's HTTP metadata protocol.

``python -m mooncake_vllm.metadata.server [--host 127.0.0.1] [--port 8080]
[--path /metadata] [--backend memory|redis://h:p|etcd://h:p]`` (also
``mooncake-vllm metadata serve``). Prints one line
``mooncake-vllm metadata server ready at http://HOST:PORT/metadata (backend ...)``
and stops cleanly on SIGTERM/SIGINT.

Protocol on ``<path>`` (``/metadata`` by default), as the Transfer Engine's HTTP
plugin uses it (mooncake-store-api.md §7):

* ``GET ?key=K``: 200 + the stored bytes (``application/json``), 404 on a miss.
* ``PUT ?key=K``: stores the body verbatim, 200. The body must be JSON (the
  client rejects non-JSON on read anyway). For ``rpc_meta`` keys a PUT equal to
  the stored value (as JSON) answers 200 "metadata unchanged"; a different one
  answers 400 (an address is already registered for that segment).
* ``DELETE ?key=K``: 200, also when the key is missing.
* A key that is empty, not under ``mooncake/``, longer than 1024 characters or
  has control characters gets 400 with the reason; nothing is stored.
* ``GET /health``: 200 ``{"status": "ok", "backend": ..., "pid": ...}`` (no token needed).
* Limits (environment of the server; the same names as Mooncake's own server where
  it has them): ``MC_METADATA_HTTP_TOKEN`` set → ``<path>`` needs
  ``Authorization: Bearer <token>`` (401 otherwise; Mooncake's newer HTTP plugin
  and our :class:`~mooncake_vllm.metadata.backends.HttpBackend` send it from the
  same variable); ``MC_METADATA_MAX_TOTAL_BYTES`` (1 GiB) / ``MC_METADATA_MAX_KEYS``
  (65536) cap the memory backend (507 when full); one body is at most
  ``MC_METADATA_MAX_BODY_BYTES`` (16 MiB, 413 above); a request head must arrive
  within ``MC_METADATA_HEADER_TIMEOUT`` s (10) and its body within
  ``MC_METADATA_BODY_TIMEOUT`` s (10), idle keep-alive connections close after
  60 s, and at most ``MC_METADATA_MAX_CONNECTIONS`` (4096, and always below the
  descriptor limit) are open: the oldest idle one makes room for a new one.
  JSON bodies nested deeper than 128 levels get 400.
* Extension (not in Mooncake's protocol, never sent by Mooncake):
  ``GET <path>?prefix=P`` → 200 ``{"keys": [...]}``; used by
  ``mooncake-vllm metadata list|gc`` via :class:`~mooncake_vllm.metadata.backends.HttpBackend`.

Why aiohttp: it is already a dependency of mooncake-vllm and of the Mooncake
wheel, and one asyncio loop serves thousands of concurrent keep-alive
connections on 2 cores, where the stdlib's thread-per-connection
``ThreadingHTTPServer`` would spawn a thread per curl handle. Blocking backends
(redis, etcd) run in a small thread pool; the memory backend runs inline.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from mooncake_vllm.errors import (
    ConfigError,
    ConfigProblem,
    JsonBodyError,
    MetadataFullError,
    StoreError,
    StoreUnavailableError,
)
from mooncake_vllm.httpsafe import ConnectionGuard, GuardedTCPSite, loads_json, read_body, redact
from mooncake_vllm.metadata.backends import MemoryBackend, MetadataBackend, backend_for
from mooncake_vllm.metadata.entries import KIND_RPC_META, parse_key, validate_key
from mooncake_vllm.store.bridge import BACKEND_ENV, READY_PREFIX

__all__ = ["BACKEND_ENV", "READY_PREFIX", "TOKEN_ENV", "MetadataServer", "ServerLimits", "add_arguments", "main",
           "serve"]

log = logging.getLogger(__name__)

MAX_BODY = 16 << 20
#: the shared bearer token (Mooncake's name for it); unset = no token needed
TOKEN_ENV = "MC_METADATA_HTTP_TOKEN"


def _text(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=message + "\n", headers=headers)


@dataclass
class ServerLimits:
    """What one metadata server accepts; :meth:`from_env` reads the ``MC_METADATA_*`` variables."""

    token: str | None = field(default=None, repr=False)
    max_total_bytes: int = 1 << 30
    max_keys: int = 65536
    max_body_bytes: int = MAX_BODY
    max_connections: int = 4096
    header_timeout: float = 10.0
    body_timeout: float = 10.0
    idle_timeout: float = 60.0

    _ENV = {
        "max_total_bytes": "MC_METADATA_MAX_TOTAL_BYTES",
        "max_keys": "MC_METADATA_MAX_KEYS",
        "max_body_bytes": "MC_METADATA_MAX_BODY_BYTES",
        "max_connections": "MC_METADATA_MAX_CONNECTIONS",
        "header_timeout": "MC_METADATA_HEADER_TIMEOUT",
        "body_timeout": "MC_METADATA_BODY_TIMEOUT",
    }

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> ServerLimits:
        """The limits from the environment; ``ConfigError`` naming each bad variable and its fix."""
        out = cls(token=env.get(TOKEN_ENV) or None)
        problems = []
        for name, var in cls._ENV.items():
            raw = env.get(var, "").strip()
            if not raw:
                continue
            kind = float if "timeout" in name else int
            try:
                value = kind(raw)
                if value <= 0:
                    raise ValueError
            except ValueError:
                what = "number of seconds" if kind is float else "integer"
                problems.append(ConfigProblem(var, f"{raw!r} is not a positive {what}",
                                              f"set {var} to a positive {what} or unset it for the default"))
                continue
            setattr(out, name, value)
        if problems:
            raise ConfigError("metadata server environment", problems)
        return out


class MetadataServer:
    """The aiohttp application around one :class:`MetadataBackend`."""

    def __init__(self, backend: MetadataBackend, *, host: str = "127.0.0.1", port: int = 0,
                 path: str = "/metadata", limits: ServerLimits | None = None) -> None:
        self.backend = backend
        self.host, self.port = host, port
        self.path = "/" + path.strip("/")
        self.limits = limits or ServerLimits()
        self.guard = ConnectionGuard(
            max_connections=self.limits.max_connections, header_timeout=self.limits.header_timeout,
            idle_timeout=self.limits.idle_timeout, name="metadata server",
            header_timeout_hint="MC_METADATA_HEADER_TIMEOUT of the metadata server",
            max_connections_hint="raise MC_METADATA_MAX_CONNECTIONS and the descriptor limit (ulimit -n)")
        self._inline = isinstance(backend, MemoryBackend)
        self._pool = None if self._inline else ThreadPoolExecutor(max_workers=16, thread_name_prefix="mcv-meta")
        self._rpc_meta_lock = asyncio.Lock()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{self.path}"

    async def _backend(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_bytes + 1,
                              middlewares=[self.guard.middleware, self._errors, self._auth])
        app.router.add_get(self.path, self._get)
        app.router.add_put(self.path, self._put)
        app.router.add_delete(self.path, self._delete)
        app.router.add_get("/health", self._health)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except MetadataFullError as exc:
            return _text(507, str(exc))
        except StoreUnavailableError as exc:
            return _text(503, f"metadata backend unavailable: {redact(str(exc))}")
        except StoreError as exc:
            return _text(502, f"metadata backend error: {redact(str(exc))}")
        except Exception as exc:  # a backend library's own error: no traceback text to the client
            frames = "".join(traceback.format_tb(exc.__traceback__))
            log.error("%s %s failed: %s\n%s", request.method, request.path, redact(f"{type(exc).__name__}: {exc}"),
                      frames)
            return _text(500, f"internal error ({type(exc).__name__}); see the metadata server's log")

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        token = self.limits.token
        if token and request.path == self.path:
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    given.strip().encode("utf-8", "surrogateescape"), token.encode("utf-8", "surrogateescape")):
                what = "wrong bearer token" if scheme.lower() == "bearer" and given else "no bearer token"
                return _text(401, f"unauthorized: {what}; this server needs Authorization: Bearer <token>: set "
                                  f"{TOKEN_ENV} to the server's token in the client's environment",
                             headers={"WWW-Authenticate": 'Bearer realm="mooncake-metadata"'})
        return await handler(request)

    async def _get(self, request: web.Request) -> web.Response:
        if "key" not in request.query and "prefix" in request.query:
            keys = await self._backend(self.backend.list, request.query["prefix"])
            return web.json_response({"keys": keys})
        key = request.query.get("key")
        reason = validate_key(key)
        if reason:
            return _text(400, f"bad key: {reason}")
        value = await self._backend(self.backend.get, key)
        if value is None:
            return _text(404, f"metadata not found: {key}")
        return web.Response(body=value, content_type="application/json")

    async def _put(self, request: web.Request) -> web.Response:
        key = request.query.get("key")
        reason = validate_key(key)
        if reason:
            return _text(400, f"bad key: {reason}")
        body = await read_body(request, limit=self.limits.max_body_bytes, timeout=self.limits.body_timeout,
                               limit_hint="raise MC_METADATA_MAX_BODY_BYTES for the metadata server",
                               timeout_hint="raise MC_METADATA_BODY_TIMEOUT for the metadata server")
        if not body:
            return _text(400, f"bad body for {key}: empty (expected a JSON document)")
        try:
            doc = loads_json(body, what="the body")
        except JsonBodyError as exc:
            reason = str(exc)
            return _text(400, f"bad body for {key}: " + ("not JSON" + reason.split("not valid JSON", 1)[1]
                                                         if "not valid JSON" in reason else reason))
        parsed = parse_key(key)
        if parsed is None or parsed.kind != KIND_RPC_META:
            await self._backend(self.backend.put, key, body)
            return _text(200, "metadata updated")
        async with self._rpc_meta_lock:  # compare-and-set for this server's clients
            old = await self._backend(self.backend.get, key)
            if old is not None:
                try:
                    same = json.loads(old) == doc
                except ValueError:
                    same = False
                if same:
                    return _text(200, "metadata unchanged")
                return _text(
                    400,
                    f"conflicting rpc_meta for segment {parsed.segment}: registered "
                    f"{old[:200].decode('utf-8', 'replace')}, got {body[:200].decode('utf-8', 'replace')}; "
                    "if the old owner is gone, remove it with `mooncake-vllm metadata gc --apply`",
                )
            await self._backend(self.backend.put, key, body)
        return _text(200, "metadata updated")

    async def _delete(self, request: web.Request) -> web.Response:
        key = request.query.get("key")
        reason = validate_key(key)
        if reason:
            return _text(400, f"bad key: {reason}")
        await self._backend(self.backend.delete, key)
        return _text(200, "metadata deleted")

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "backend": self.backend.url, "pid": os.getpid()})

    async def start(self) -> str:
        """Bind and start serving; returns the metadata URL (with the real port)."""
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False,
                                     keepalive_timeout=self.limits.idle_timeout,
                                     lingering_time=2.0)  # unread rest of a refused body: 2 s, then close
        await self._runner.setup()
        site = GuardedTCPSite(self._runner, self.host, self.port, guard=self.guard, backlog=1024, reuse_address=True)
        await site.start()
        self.port = site.port
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.backend.close()


async def _serve_async(server: MetadataServer, *, exit_with_parent: bool, ready: Callable[[str], None]) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = os.getppid()
    url = await server.start()
    ready(url)
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                if exit_with_parent and os.getppid() != parent:
                    log.warning("parent process %d is gone; metadata server stops", parent)
                    break
    finally:
        await server.stop()


def serve(backend: str | MetadataBackend = "memory", *, host: str = "127.0.0.1", port: int = 8080,
          path: str = "/metadata", exit_with_parent: bool = False, limits: ServerLimits | None = None) -> int:
    """Run the server in the foreground until SIGTERM/SIGINT; prints the ready line.

    ``limits`` default to :meth:`ServerLimits.from_env` (the ``MC_METADATA_*`` variables)."""
    try:
        limits = limits or ServerLimits.from_env()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        store = backend if isinstance(backend, MetadataBackend) else backend_for(backend)
    except ConfigError as exc:
        print(f"error: --backend: {exc}", file=sys.stderr)
        return 2
    if isinstance(store, MemoryBackend):
        store.max_total_bytes, store.max_keys = limits.max_total_bytes, limits.max_keys
    try:
        store.get("mooncake/")  # reach redis/etcd now, not at the first client request
    except (StoreUnavailableError, StoreError) as exc:
        print(f"error: metadata backend {store.url} not usable: {exc}", file=sys.stderr)
        return 1
    server = MetadataServer(store, host=host, port=port, path=path, limits=limits)
    if limits.token is None and host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("metadata server on %s has no token: anyone who can reach the port can read and rewrite "
                    "cluster metadata; set %s here and on every client", host, TOKEN_ENV)

    def ready(url: str) -> None:
        print(f"{READY_PREFIX}{url} (backend {store.url})", flush=True)

    try:
        asyncio.run(_serve_async(server, exit_with_parent=exit_with_parent, ready=ready))
    except OSError as exc:
        print(f"error: cannot listen on {host}:{port}: {exc}; pick a free port with --port", file=sys.stderr)
        return 1
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's options (shared with ``mooncake-vllm metadata serve``)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port to bind; 0 = any free port (default 8080)")
    parser.add_argument("--path", default="/metadata", help="URL path of the metadata endpoint (default /metadata)")
    parser.add_argument("--backend", default=None,
                        help=f"memory (default), redis://host:port[/db] or etcd://host:port; also ${BACKEND_ENV}")
    parser.add_argument("--exit-with-parent", action="store_true", help="stop when the parent process exits")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mooncake_vllm.metadata.server", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    backend = args.backend or os.environ.get(BACKEND_ENV) or "memory"
    return serve(backend, host=args.host, port=args.port, path=args.path, exit_with_parent=args.exit_with_parent)


if __name__ == "__main__":
    sys.exit(main())
