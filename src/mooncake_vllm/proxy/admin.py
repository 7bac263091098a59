"""Admin API (``/instances/add``, ``/instances/remove``, ``/status``) and health checks.

The admin key is compared in constant time and never logged. Without
``ADMIN_API_KEY`` the mutating endpoints answer 403 and say why.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import posixpath
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from mooncake_vllm.errors import ConfigError, JsonBodyError, UnsupportedVersionError
from mooncake_vllm.httpsafe import describe_exc, loads_json, read_body
from mooncake_vllm.proxy import flows, kv_policy
from mooncake_vllm.proxy.instances import KINDS, Endpoint, Instance, InstancePool, parse_endpoint

__all__ = ["AdminConfig", "ProxyState", "check_all", "check_instance", "health_loop", "install", "model_matches"]

log = logging.getLogger(__name__)

#: largest admin request body and health-probe answer read
ADMIN_BODY_LIMIT = 64 << 10
PROBE_ANSWER_LIMIT = 1 << 20


class AdminConfig(Protocol):
    """The proxy settings the admin API and the health checks read (``ProxyConfig`` has them)."""

    model: str
    flow: str
    scheduling: str
    admin_api_key: str | None
    health_interval: float
    health_timeout: float
    health_failures: int
    body_timeout: float
    drain_timeout: float


class ProxyState(Protocol):
    """What of a proxy the admin API and the health checks use (``ProxyServer`` passes itself)."""

    session: aiohttp.ClientSession | None
    pool: InstancePool
    p2p_mode: str | None  #: set here from an instance's ``/version`` when the config names none
    pending_adds: set[tuple[str, str]]  #: (kind, key) of instances being validated by ``/instances/add``
    kv: Any  #: the ``kv_aware`` router (``kv_policy.KvRouter``), None for other policies

    @property
    def config(self) -> AdminConfig: ...

    def secrets(self) -> tuple[str | None, ...]:
        """Every secret an error text could echo."""
        ...


def model_matches(expected: str, payload: Any) -> tuple[bool, list[str]]:
    """Whether a ``/v1/models`` answer serves ``expected`` (by basename, as the seed proxy did)."""
    want = posixpath.basename(expected.rstrip("/"))
    served: list[str] = []
    for entry in (payload or {}).get("data", []) if isinstance(payload, dict) else []:
        for name in (entry.get("id"), entry.get("root")):
            if isinstance(name, str):
                served.append(name)
    return any(posixpath.basename(s.rstrip("/")) == want for s in served), served


def _err(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "admin_error", "code": status}}, status=status)


async def _get_json(server: ProxyState, url: str) -> Any:
    assert server.session is not None
    timeout = aiohttp.ClientTimeout(total=server.config.health_timeout)
    async with server.session.get(url, timeout=timeout) as resp:
        if resp.status != 200:
            raise ConnectionError(f"GET {url} answered HTTP {resp.status}")
        raw = b""
        async for chunk in resp.content.iter_any():
            raw += chunk
            if len(raw) > PROBE_ANSWER_LIMIT:
                raise ConnectionError(f"GET {url} answered more than {PROBE_ANSWER_LIMIT} bytes")
        return loads_json(raw, what=f"GET {url} answer") if raw.strip() else None  # /health: 200, no body


async def check_instance(server: ProxyState, inst: Instance) -> str | None:
    """Probe one instance; None if healthy, else the reason.

    The first successful probe checks the served model (``/v1/models``), later
    ones use ``/health``. In the P2P bootstrap flow a prefill also needs its
    engine ids from the bootstrap server.
    """
    try:
        if not inst.validated:
            ok, served = model_matches(server.config.model, await _get_json(server, inst.url + "/v1/models"))
            if not ok:
                return f"serves {served or 'no model'}, not {server.config.model!r}"
            inst.validated = True
        else:
            await _get_json(server, inst.url + "/health")
        if server.config.flow == "p2p" and server.p2p_mode is None:
            await _detect_version(server, inst)
        if server.p2p_mode == "bootstrap" and inst.kind == "prefill":
            ids = flows.parse_engine_ids(await _get_json(server, inst.endpoint.bootstrap_url + "/query"))
            if not ids:
                return f"bootstrap server {inst.endpoint.bootstrap_url} has no engine registered yet"
            inst.engine_ids = ids
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError, UnsupportedVersionError) as exc:
        return describe_exc(exc, server.secrets())
    return None


async def _detect_version(server: ProxyState, inst: Instance) -> None:
    payload = await _get_json(server, inst.url + "/version")
    version = payload.get("version") if isinstance(payload, dict) else None
    if version:
        server.p2p_mode = flows.p2p_mode(flows.release_triple(version, field_name=f"{inst.key} /version"))
        log.info("upstream vLLM %s: P2P kv_transfer_params mode %r", version, server.p2p_mode)


async def check_all(server: ProxyState) -> None:
    """Probe every instance once, concurrently, and update the rotation."""
    insts = list(server.pool)
    results = await asyncio.gather(*(check_instance(server, i) for i in insts), return_exceptions=True)
    for inst, res in zip(insts, results):
        if isinstance(res, BaseException):
            res = describe_exc(res, server.secrets())
        if res is None:
            inst.probe_failures = 0
            if not inst.healthy:
                log.info("%s instance %s is healthy and in rotation", inst.kind, inst.key)
                inst.healthy, inst.last_error = True, ""
            continue
        inst.probe_failures += 1
        inst.last_error = res
        if inst.healthy and inst.probe_failures >= server.config.health_failures:
            log.warning("%s instance %s leaves rotation after %d failed health checks: %s",
                        inst.kind, inst.key, inst.probe_failures, res)
            inst.healthy = False
    server.pool.refresh()


async def health_loop(server: ProxyState) -> None:
    """Run ``check_all`` every ``health_interval`` seconds until cancelled."""
    while True:
        await asyncio.sleep(server.config.health_interval)
        try:
            await check_all(server)
        except Exception:  # Defensive: a probe bug must not stop the loop
            log.exception("health check round failed")


def _denied(server: ProxyState, request: web.Request) -> web.Response | None:
    key = server.config.admin_api_key
    if not key:
        return _err(403, "the admin API is disabled: ADMIN_API_KEY is not set for the proxy; "
                         "set it in the proxy's environment and restart to enable /instances/*")
    given = request.headers.get("X-API-Key")
    if given is None:
        return _err(401, "missing X-API-Key header")
    if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode("utf-8", "surrogateescape")):
        log.warning("rejected admin request from %s: invalid X-API-Key", request.remote)
        return _err(403, "invalid X-API-Key")
    return None


async def _admin_request(server: ProxyState,
                         request: web.Request) -> tuple[str, Endpoint, dict[str, Any]] | web.Response:
    """Key check, then the body's type, parsed instance address and the body; an error response otherwise."""
    if (denied := _denied(server, request)) is not None:
        return denied
    try:
        raw = await read_body(request, limit=ADMIN_BODY_LIMIT, timeout=server.config.body_timeout,
                              limit_hint='send only {"type": ..., "instance": ...}')
    except web.HTTPException as exc:
        return _err(exc.status, (exc.text or exc.reason).strip())
    try:
        body = loads_json(raw, what="admin request body")
    except JsonBodyError as exc:
        return _err(400, f'{exc}; send {{"type": "prefill"|"decode", "instance": "host:port"}}')
    if not isinstance(body, dict):
        return _err(400, 'body must be a JSON object: {"type": "prefill"|"decode", "instance": "host:port"}')
    kind, addr = body.get("type"), body.get("instance")
    if kind not in KINDS:
        return _err(400, f"type: got {kind!r}, expected 'prefill' or 'decode'")
    if not isinstance(addr, str):
        return _err(400, f"instance: got {addr!r}, expected 'host:port' (e.g. 127.0.0.1:8100 or [::1]:8100)")
    try:
        return kind, parse_endpoint(addr, field_name="instance"), body
    except ConfigError as exc:
        return _err(400, str(exc.problems[0]))


async def handle_add(server: ProxyState, request: web.Request) -> web.Response:
    """Validate the instance (it answers ``/v1/models`` with our model), then add it. With
    ``kv_aware``, ``"kv_replay": "tcp://HOST:PORT"`` names its replay socket (as ``--kv-replay``)."""
    parsed = await _admin_request(server, request)
    if isinstance(parsed, web.Response):
        return parsed
    kind, ep, body = parsed
    replay = body.get("kv_replay")
    if replay is not None:
        if server.kv is None:
            return _err(400, f"kv_replay: the proxy runs --scheduling {server.config.scheduling}; only kv_aware "
                             "reads KV events (leave kv_replay out)")
        try:
            replay = kv_policy.parse_replay([f"{ep.key}={replay}"])[ep.key]
        except ConfigError as exc:
            return _err(400, "kv_replay: " + exc.problems[0].problem.split(": ", 1)[-1])
    existing = server.pool.get(kind, ep.key)
    if existing is not None or (kind, ep.key) in server.pending_adds:
        state = "being removed" if existing is not None and existing.draining else "already in the pool"
        return _err(409, f"{kind} instance {ep.key} is {state}")
    server.pending_adds.add((kind, ep.key))
    try:
        inst = Instance(kind, ep, healthy=False)
        problem = await check_instance(server, inst)
        if problem is not None:
            return _err(400, f"{kind} instance {ep.key} was not added: {problem}")
        inst.healthy = True
        server.pool.add(inst)
        if replay:
            server.kv.set_replay(ep.key, replay)
    finally:
        server.pending_adds.discard((kind, ep.key))
    log.info("admin: added %s instance %s%s", kind, ep.key, f" (KV replay {replay})" if replay else "")
    return web.json_response({"status": "added", "type": kind, "instance": ep.key,
                              **({"kv_replay": replay} if replay else {}), **_counts(server)})


async def handle_remove(server: ProxyState, request: web.Request) -> web.Response:
    """Take the instance out of rotation, wait for its requests to finish, drop it."""
    parsed = await _admin_request(server, request)
    if isinstance(parsed, web.Response):
        return parsed
    kind, key = parsed[0], parsed[1].key
    inst = server.pool.get(kind, key)
    if inst is None:
        known = ", ".join(i.key for i in server.pool.of_kind(kind)) or "none"
        return _err(404, f"no {kind} instance {key} in the pool (known: {known})")
    if inst.draining:
        return _err(409, f"{kind} instance {key} is already being removed")
    inst.draining = True
    server.pool.refresh()
    waiting = inst.in_flight
    drained = await inst.drain(server.config.drain_timeout)
    server.pool.remove(kind, key)
    if server.kv is not None and not any(i.key == key for i in server.pool):
        server.kv.set_replay(key, None)
    log.info("admin: removed %s instance %s (drained=%s)", kind, key, drained)
    return web.json_response({"status": "removed", "type": kind, "instance": key, "drained": drained,
                              "waited_for": waiting, "in_flight": inst.in_flight, **_counts(server)})


def _counts(server: ProxyState) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in KINDS:
        insts = server.pool.of_kind(kind)
        out[f"{kind}_node_count"] = len(insts)
        out[f"{kind}_nodes"] = [i.key for i in insts]
    return out


async def handle_status(server: ProxyState, _request: web.Request) -> web.Response:
    """Read-only view (no key needed, as in the seed): counts, nodes, per-instance state."""
    body = {
        "model": server.config.model,
        "flow": server.config.flow,
        "p2p_mode": server.p2p_mode,
        "scheduling": server.config.scheduling,
        "admin_api": "enabled" if server.config.admin_api_key else "disabled (ADMIN_API_KEY not set)",
        **({"kv_events": server.kv.subscriber.bound_endpoint} if server.kv is not None else {}),
        **_counts(server),
        "instances": {k: [i.status() for i in server.pool.of_kind(k)] for k in KINDS},
    }
    return web.Response(text=json.dumps(body, indent=2), content_type="application/json")


def install(server: ProxyState, app: web.Application) -> None:
    """Add the admin routes to ``app``."""

    def bind(fn):  # noqa: ANN001, ANN202 - handler adapter
        async def handler(request: web.Request) -> web.Response:
            return await fn(server, request)

        return handler

    app.router.add_post("/instances/add", bind(handle_add))
    app.router.add_post("/instances/remove", bind(handle_remove))
    app.router.add_get("/status", bind(handle_status))
