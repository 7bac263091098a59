"""Make ``redis://`` metadata work with Mooncake builds that have no redis plugin.

Published Mooncake wheels are built without ``USE_REDIS``; given
``metadata_server = "redis://..."`` they ``LOG(FATAL)`` and the process dies
with exit code 134, which Python cannot catch (mooncake-store-api.md §7). The
store client therefore calls :func:`resolve_metadata_url` before ``setup``:
when the build lacks redis it starts mooncake-vllm's HTTP metadata server as a
child process with ``--backend redis://...`` on a free loopback port and hands
Mooncake that ``http://127.0.0.1:P/metadata`` URL instead. The entries land in
the same redis, under the same plain keys Mooncake's own redis plugin uses, so
bridged and native clients share one metadata store.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mooncake_vllm.addresses import MetadataURL, redact_url
from mooncake_vllm.errors import StoreUnavailableError

__all__ = [
    "ASSUME_REDIS_ENV",
    "bridge_redis_url",
    "mooncake_supports_redis",
    "release_bridge",
    "resolve_metadata_url",
]

log = logging.getLogger(__name__)

#: the line the embedded metadata server prints once it listens (``... at <url>``)
READY_PREFIX = "mooncake-vllm metadata server ready at "
#: where the embedded metadata server finds its backend URL (keeps redis passwords off argv)
BACKEND_ENV = "MOONCAKE_VLLM_METADATA_BACKEND"

#: set to 1 when your Mooncake was built from source with USE_REDIS=ON
ASSUME_REDIS_ENV = "MOONCAKE_VLLM_ASSUME_REDIS"
_TRUE = {"1", "true", "yes", "on"}


def mooncake_supports_redis(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the installed Mooncake can take ``redis://`` itself.

    No published wheel has the redis plugin (``USE_REDIS`` is off in every
    release build) and probing it would abort the process, so this is False
    unless ``MOONCAKE_VLLM_ASSUME_REDIS=1`` says a source build has it.
    """
    return env.get(ASSUME_REDIS_ENV, "").strip().lower() in _TRUE


@dataclass
class _Bridge:
    redis_url: str = field(repr=False)  # may hold a password
    proc: subprocess.Popen
    url: str = ""
    users: int = 0
    owner: int = field(default_factory=os.getpid)  # a forked child must not stop its parent's bridge
    output: collections.deque = field(default_factory=lambda: collections.deque(maxlen=20))
    ready: threading.Event = field(default_factory=threading.Event)


_bridges: dict[str, _Bridge] = {}
_warned: set[str] = set()
_lock = threading.Lock()


def _pump(bridge: _Bridge) -> None:
    """Read the child's output: the ready line gives the URL, the rest goes to the log."""
    assert bridge.proc.stdout is not None
    for raw in bridge.proc.stdout:
        line = raw.decode("utf-8", "replace").rstrip()
        if not bridge.ready.is_set() and line.startswith(READY_PREFIX):
            bridge.url = line[len(READY_PREFIX):].split(" ", 1)[0]
            bridge.ready.set()
            continue
        bridge.output.append(line)
        log.warning("redis metadata bridge: %s", line)
    bridge.ready.set()  # EOF: wake the starter, which sees no URL


def _start(redis_url: str, timeout: float) -> _Bridge:
    env = dict(os.environ)
    env[BACKEND_ENV] = redis_url  # not on the command line: it may hold a password
    # The bridge listens on loopback for this process's own Transfer Engine, whose HTTP
    # plugin (0.3.x wheels) sends no bearer token: enforcing one would fail its setup.
    env.pop("MC_METADATA_HTTP_TOKEN", None)
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mooncake_vllm.metadata.server", "--host", "127.0.0.1", "--port", "0",
         "--exit-with-parent"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
        start_new_session=True,  # a Ctrl-C aimed at the parent's group does not hit the bridge first
    )
    bridge = _Bridge(redis_url=redis_url, proc=proc)
    threading.Thread(target=_pump, args=(bridge,), name="mcv-redis-bridge", daemon=True).start()
    if not bridge.ready.wait(timeout) or not bridge.url:
        _stop(bridge)
        detail = " | ".join(bridge.output) or "no output"
        raise StoreUnavailableError(
            f"the HTTP bridge for metadata_server {_safe(redis_url)} did not come up within {timeout:.0f} s "
            f"(exit code {proc.poll()}): {detail}; check that redis runs at that address"
        )
    return bridge


def _stop(bridge: _Bridge) -> None:
    if bridge.owner != os.getpid():
        return
    if bridge.proc.poll() is None:
        bridge.proc.terminate()
        try:
            bridge.proc.wait(5)
        except subprocess.TimeoutExpired:
            bridge.proc.kill()
            bridge.proc.wait(5)


def _safe(url: str) -> str:
    return repr(redact_url(url))


def bridge_redis_url(url: str, *, timeout: float = 15.0) -> str:
    """Start (or reuse) the HTTP bridge for ``redis://...``; returns its ``http://.../metadata`` URL.

    Each call takes one reference; give it back with :func:`release_bridge`.
    The bridge also stops when this process exits.
    """
    with _lock:
        bridge = _bridges.get(url)
        if bridge is None or bridge.owner != os.getpid() or bridge.proc.poll() is not None:
            bridge = _start(url, timeout)
            _bridges[url] = bridge
        bridge.users += 1
        return bridge.url


def release_bridge(url: str) -> None:
    """Drop one reference to the bridge for ``url``; the last one stops it."""
    with _lock:
        bridge = _bridges.get(url)
        if bridge is None:
            return
        bridge.users -= 1
        if bridge.users <= 0:
            del _bridges[url]
            _stop(bridge)


@atexit.register
def _stop_all() -> None:
    with _lock:
        for bridge in _bridges.values():
            _stop(bridge)
        _bridges.clear()


def resolve_metadata_url(url: str, *, supports_redis: bool) -> tuple[str, Callable[[], None] | None]:
    """The ``metadata_server`` to hand Mooncake, and a cleanup callable (or None).

    Only ``redis://`` / ``rediss://`` on a build without redis is rewritten, to
    a bridge on loopback; that is logged once per URL as a WARNING.
    """
    if MetadataURL.parse(url).kind not in ("redis", "rediss") or supports_redis:
        return url, None
    http_url = bridge_redis_url(url.strip())
    with _lock:
        first = url not in _warned
        _warned.add(url)
    if first:
        log.warning(
            "metadata_server %s: this Mooncake build has no redis plugin (PyPI wheels never do; it would abort "
            "the process with exit code 134). Transfer Engine metadata now goes through mooncake-vllm's HTTP "
            "bridge %s, which stores it in that redis under Mooncake's own keys. Set %s=1 only if your Mooncake "
            "was built with USE_REDIS=ON.",
            _safe(url), http_url, ASSUME_REDIS_ENV,
        )
    done = threading.Event()

    def cleanup() -> None:
        if not done.is_set():
            done.set()
            release_bridge(url.strip())

    return http_url, cleanup
