"""Reaching the pool: preflight checks and a setup that fails fast.

A dead, wrong or hung master is a :class:`StoreUnavailableError` within the
timeout (the raw client retries for ~90 s or hangs); the error names what was
tried and the fix.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from mooncake_vllm.addresses import MetadataURL
from mooncake_vllm.config import StoreConfig
from mooncake_vllm.errors import StoreUnavailableError
from mooncake_vllm.placement import off_compute_cores
from mooncake_vllm.store.codes import call

__all__ = ["CLIENT_ENV_DEFAULTS", "OFFLOAD_ENV_DEFAULTS", "OpenedStore", "open_store", "pick_local_hostname",
           "tcp_reachable"]

log = logging.getLogger(__name__)

#: Environment the Mooncake C++ client reads; set only where the user has not.
CLIENT_ENV_DEFAULTS = {
    "MC_STORE_CLIENT_SETUP_RETRIES": "1",  # default 20 → ~90 s to fail on a wrong master
    "MC_RPC_TIMEOUT_MS": "2000",  # default 30000 → 30 s per RPC on a hung master
    "MC_LOG_LEVEL": "ERROR",
}
#: Environment of a process that offloads its pool memory to disk (a holder, or a client with a
#: segment and enable_ssd_offload); set only where the user has not. Mooncake's defaults: the
#: bucket backend, a 10 s offload heartbeat (DRAM full of values not yet on disk refuses puts
#: that long) and a 1.2 GB staging buffer per process.
OFFLOAD_ENV_DEFAULTS = {
    "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "file_per_key_storage_backend",  # one file per value
    "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": "1",
    "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": str(128 << 20),
}


def pick_local_hostname(master_host: str) -> str:
    """The local address that routes to the master (loopback for a local master)."""
    if master_host in ("127.0.0.1", "localhost", "::1", ""):
        return "127.0.0.1"
    try:  # a UDP "connect" sends nothing; it only asks the kernel for a route
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def tcp_reachable(host: str, port: int, timeout: float) -> str | None:
    """``None`` if something accepts TCP at host:port, else the reason."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except TimeoutError:
        return f"no answer within {timeout:.1f} s"
    except OSError as exc:
        return exc.strerror or str(exc)


def _metadata_endpoint(url: str) -> tuple[str, int] | None:
    """Where a TCP probe of the metadata server goes (``None``: nothing to probe)."""
    try:
        address = MetadataURL.parse(url).probe_address()
    except ValueError:
        return None
    return (address.host, address.port) if address is not None else None


def _resolve_metadata(config: StoreConfig) -> tuple[str, Callable[[], None] | None]:
    if config.metadata_scheme != "redis":
        return config.metadata_server, None
    from mooncake_vllm.store.bridge import mooncake_supports_redis, resolve_metadata_url

    return resolve_metadata_url(config.metadata_server, supports_redis=mooncake_supports_redis())


def _preflight(config: StoreConfig, metadata: str, timeout: float) -> None:
    host, port = config.master_host_port
    if not config.master_server_address.startswith("etcd://"):
        reason = tcp_reachable(host, port, min(timeout, 2.0))
        if reason:
            raise StoreUnavailableError(
                f"no Mooncake master at {config.master_server_address} ({reason}); "
                f"start one (`mooncake_master --rpc_port={port}` or `mooncake-vllm up`) "
                f"or fix master_server_address in {config.source}")
    endpoint = _metadata_endpoint(metadata)
    if endpoint:
        reason = tcp_reachable(*endpoint, min(timeout, 2.0))
        if reason:
            raise StoreUnavailableError(
                f"no metadata server at {metadata} ({reason}); start it or fix "
                f"metadata_server in {config.source}")


class OpenedStore(NamedTuple):
    """A set-up store, the cleanup to run at close, and the metadata URL it used."""

    store: Any
    cleanup: Callable[[], None] | None
    metadata: str


def open_store(config: StoreConfig, *, timeout: float,
               store_factory: Callable[[], Any] | None = None,
               metadata: str | None = None) -> OpenedStore:
    """A set-up ``MooncakeDistributedStore``, or :class:`StoreUnavailableError` in ``timeout``.

    ``metadata``: an already resolved metadata URL (another store client of this
    process bridged it), used as it is."""
    for name, value in CLIENT_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    cleanup = None
    if metadata is None:
        metadata, cleanup = _resolve_metadata(config)
    try:
        return OpenedStore(_setup(config, metadata, timeout, store_factory), cleanup, metadata)
    except BaseException:
        if cleanup is not None:
            cleanup()
        raise


def _setup(config: StoreConfig, metadata: str, timeout: float,
           store_factory: Callable[[], Any] | None) -> Any:
    host, _port = config.master_host_port
    hostname = config.local_hostname or pick_local_hostname(host)
    _preflight(config, metadata, timeout)
    if store_factory is None:
        from mooncake.store import MooncakeDistributedStore
        store_factory = MooncakeDistributedStore
    args = (hostname, metadata, config.global_segment_size, config.local_buffer_size,
            config.protocol, config.device_name, config.master_server_address)
    kwargs: dict[str, Any] = {}
    offload = config.ssd_offload and config.global_segment_size > 0
    if offload:
        # this process holds pool memory: it offloads that memory to its disk (Mooncake >= 0.3.11)
        kwargs = {"enable_ssd_offload": True, "ssd_offload_path": config.ssd_offload_path}
        for name, value in OFFLOAD_ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)
    made: list[Any] = []
    result: list[Any] = []

    def set_up() -> None:
        # Mooncake starts its threads in the constructor and in setup(), and they keep the
        # CPUs of the thread that called: off vLLM's compute cores first (a lane opened from
        # vLLM's thread put a client's TCP thread on them: the split run on the H100, 2026-12-06)
        off_compute_cores()
        store = call(store_factory)
        made.append(store)
        if isinstance(store, BaseException):
            return
        if offload and "enable_ssd_offload" not in (getattr(store.setup, "__doc__", None) or ""):
            made[0] = StoreUnavailableError(
                f"enable_ssd_offload in {config.source}: this Mooncake release's setup() has no disk tier; "
                f"install mooncake-transfer-engine >= 0.3.11, or remove enable_ssd_offload")
            return
        result.append(call(lambda: store.setup(*args, **kwargs)))

    worker = threading.Thread(target=set_up, name="mcv-setup", daemon=True)
    worker.start()
    worker.join(timeout)
    if made and isinstance(made[0], BaseException):
        raise made[0]
    if worker.is_alive():
        raise StoreUnavailableError(
            f"Mooncake setup against master {config.master_server_address} did not finish "
            f"within {timeout:.0f} s: the port answers but the master does not; check that "
            f"it is a mooncake_master of the same release as this client")
    rc = result[0] if result else None
    if not made or isinstance(rc, BaseException) or rc != 0:
        raise StoreUnavailableError(
            f"Mooncake setup failed (returned {rc!r}) for master "
            f"{config.master_server_address}, metadata {metadata}, protocol "
            f"{config.protocol}; check that master and client are the same Mooncake "
            f"release and that local_hostname {hostname!r} is an address of this host")
    log.debug("connected to Mooncake master %s as %s", config.master_server_address, hostname)
    return made[0]
