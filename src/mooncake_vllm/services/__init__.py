"""Real processes on loopback for tests, ``mooncake-vllm up`` and the demo.

Everything started here binds 127.0.0.1 on free ports, logs to a work directory,
and is stopped by PID (its own process group), at the latest at interpreter exit
or on SIGTERM.
"""

from __future__ import annotations

from mooncake_vllm.services.external import cpu_binding, start_etcd, start_redis, start_vllm_server, vllm_env
from mooncake_vllm.services.mooncake import (
    HOLDER_KINDS,
    METADATA_KINDS,
    LocalStack,
    clean_dev_shm,
    cli_argv,
    client_env,
    start_holder,
    start_http_metadata,
    start_master,
    watch_dev_shm,
)
from mooncake_vllm.services.placement import LOOPBACK, Placement
from mooncake_vllm.services.process import (
    SETUP_HINT,
    ManagedProcess,
    ServiceError,
    find_binary,
    free_port,
    http_probe,
    port_is_free,
    running,
    started,
    stop_all,
    tcp_probe,
)
from mooncake_vllm.services.tier import DiskTier

__all__ = [
    "HOLDER_KINDS",
    "LOOPBACK",
    "METADATA_KINDS",
    "SETUP_HINT",
    "DiskTier",
    "LocalStack",
    "ManagedProcess",
    "Placement",
    "ServiceError",
    "clean_dev_shm",
    "cpu_binding",
    "cli_argv",
    "client_env",
    "find_binary",
    "free_port",
    "http_probe",
    "port_is_free",
    "running",
    "start_etcd",
    "started",
    "start_holder",
    "start_http_metadata",
    "start_master",
    "start_redis",
    "start_vllm_server",
    "stop_all",
    "tcp_probe",
    "vllm_env",
    "watch_dev_shm",
]
