"""Non-Mooncake services on loopback: etcd, redis-server and a vLLM OpenAI server on CPU."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mooncake_vllm.services.mooncake import client_env
from mooncake_vllm.services.placement import LOOPBACK, Placement
from mooncake_vllm.services.process import (
    ManagedProcess,
    find_binary,
    free_port,
    http_probe,
    with_port_retry,
)

__all__ = ["cpu_binding", "kv_cache_size", "start_etcd", "start_redis", "start_vllm_server", "vllm_env"]


def cpu_binding(index: int) -> dict[str, str]:
    """The environment that binds the compute thread of the ``index``-th of several vLLM CPU
    instances on this machine to its own core, round robin over the cores this process may use.
    vLLM's CPU default (``VLLM_CPU_OMP_THREADS_BIND=auto``) binds every instance to the same
    core: on the 2-core dev box three or five instances computed on one core while the other
    idled, and a restarted one took 7–12 minutes to start beside busy ones. Empty where the
    user set ``VLLM_CPU_OMP_THREADS_BIND``."""
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return {}
    cores = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cores[index % len(cores)])}


def kv_cache_size(nbytes: int) -> tuple[dict[str, int], dict[str, str]]:
    """How this vLLM takes a KV cache size: ``({"kv_cache_memory_bytes": n}, {})`` where the
    engine has that option (``--kv-cache-memory-bytes``), else (vLLM 0.10 and older, CPU)
    ``({}, {"VLLM_CPU_KVCACHE_SPACE": whole GiB})``."""
    from vllm.engine.arg_utils import EngineArgs

    if "kv_cache_memory_bytes" in EngineArgs.__dataclass_fields__:
        return {"kv_cache_memory_bytes": nbytes}, {}
    return {}, {"VLLM_CPU_KVCACHE_SPACE": str(max(1, -(-nbytes // (1 << 30))))}


def start_etcd(workdir: str | os.PathLike, *, timeout: float = 30.0) -> ManagedProcess:
    """Start a single-member etcd (apt etcd-server 3.4) on two free loopback ports.

    ``.address`` is "127.0.0.1:P" (the client endpoint), ``.url`` "http://127.0.0.1:P".
    Ready when ``/health`` reports true.
    """
    binary = find_binary("etcd", "etcd")

    def launch(client_port: int) -> ManagedProcess:
        peer_port = free_port()
        data_dir = Path(workdir) / f"etcd-{client_port}.data"
        client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
        argv = [binary, "--name", "mcv", "--data-dir", str(data_dir),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"mcv={peer}", "--initial-cluster-state", "new"]
        env = dict(os.environ)
        env.pop("ETCDCTL_API", None)
        proc = ManagedProcess("etcd", argv, workdir=workdir, env=env, port=client_port).start()
        proc.address, proc.url = f"127.0.0.1:{client_port}", client
        healthy = http_probe(f"{client}/health", lambda s, b: s == 200 and b'"true"' in b)
        proc.wait_ready(lambda: proc.listens_on(client_port) and healthy(), timeout, "healthy on " + client)
        return proc

    return with_port_retry(launch, None, "etcd")


def _redis_ping(port: int):  # noqa: ANN202 - returns a probe
    def probe() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    return probe


def start_redis(workdir: str | os.PathLike, *, timeout: float = 30.0) -> ManagedProcess:
    """Start ``redis-server`` on 127.0.0.1 without persistence; ``.url`` is ``redis://127.0.0.1:P``."""
    binary = find_binary("redis-server", "redis")

    def launch(port: int) -> ManagedProcess:
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(workdir), "--protected-mode", "yes"]
        proc = ManagedProcess("redis", argv, workdir=workdir, port=port).start()
        proc.address, proc.url = f"127.0.0.1:{port}", f"redis://127.0.0.1:{port}"
        pong = _redis_ping(port)
        proc.wait_ready(lambda: proc.listens_on(port) and pong(), timeout, "answering PING on " + proc.address)
        return proc

    return with_port_retry(launch, None, "redis")


def _short_dir() -> Path:
    """A short per-run directory for unix sockets (sun_path is limited to 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="mcv-", dir="/tmp" if os.path.isdir("/tmp") else None))


def _shared_modelinfos() -> Path:
    """vLLM's cache of model-class inspections, shared by every server started here (one per
    installed vLLM release). Cold, it costs each server start a subprocess that imports vLLM
    again (~7 s of CPU); vLLM keys each entry by the model module's hash and writes it
    atomically, so a stale entry is recomputed, never used."""
    from mooncake_vllm.compat import installed_vllm
    from mooncake_vllm.demo.tiny_model import default_cache_dir

    dist = installed_vllm()
    return default_cache_dir().parent / "vllm-modelinfos" / (dist.version if dist else "none")


def vllm_env(workdir: str | os.PathLike, extra: Mapping[str, str] | None = None,
             *, socket_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """Environment for a vLLM process on CPU (running-on-cpu.md 2.3): offline, no telemetry,
    per-run temp/cache directories (but for :func:`_shared_modelinfos`), one reserved core,
    quiet Mooncake clients.

    Caches go under ``workdir``; TMPDIR and VLLM_RPC_BASE_PATH (ZMQ IPC sockets,
    whose paths must stay short) under ``socket_dir`` (default: ``workdir``).
    """
    root = Path(workdir)
    sockets = Path(socket_dir) if socket_dir is not None else root
    dirs = {name: root / name for name in ("vllm-cache", "inductor", "hf-home")}
    dirs.update(tmp=sockets / "tmp", rpc=sockets / "rpc")
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    infos, link = _shared_modelinfos(), dirs["vllm-cache"] / "modelinfos"
    infos.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink() and not link.exists():
        link.symlink_to(infos, target_is_directory=True)
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TMPDIR": str(dirs["tmp"]),
        "VLLM_RPC_BASE_PATH": str(dirs["rpc"]),
        "VLLM_CACHE_ROOT": str(dirs["vllm-cache"]),
        "TORCHINDUCTOR_CACHE_DIR": str(dirs["inductor"]),
        "HF_HOME": str(dirs["hf-home"]),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
        **client_env(),
    })
    env.update(extra or {})
    return env


def start_vllm_server(
    model_dir: str | os.PathLike,
    port: int | None,
    workdir: str | os.PathLike,
    kv_transfer_config: dict[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    extra_args: tuple[str, ...] = (),
    timeout: float | None = None,
    name: str = "vllm",
    placement: Placement = LOOPBACK,
    kv_cache_bytes: int = 64 << 20,
) -> ManagedProcess:
    """Start vLLM's OpenAI server on CPU (float32, block 32, ``kv_cache_bytes`` of KV, default
    64 MiB, eager) on ``placement``
    (default 127.0.0.1; its Mooncake clients advertise that address too).

    Ready when ``GET /v1/models`` answers 200 (within ``timeout``, default
    ``$MOONCAKE_VLLM_SERVER_TIMEOUT`` or 300 s: 20-30 s on an idle 2-core box, far
    more when the cores are shared); ``.url`` is ``http://HOST:P``.
    ``env`` is added on top of :func:`vllm_env` (e.g. MOONCAKE_CONFIG_PATH).
    """
    wd = Path(workdir)
    host = placement.host
    size, size_env = kv_cache_size(kv_cache_bytes)
    size_args = [f"--{k.replace('_', '-')}={v}" for k, v in size.items()]
    env = {**size_env, **(env or {})}
    wait = timeout if timeout is not None else float(os.environ.get("MOONCAKE_VLLM_SERVER_TIMEOUT", "300"))

    def launch(p: int) -> ManagedProcess:
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--host", host, "--port", str(p), "--dtype", "float32", "--block-size", "32",
                "--max-model-len", "2048", *size_args, "--enforce-eager", *extra_args]
        if kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        run_dir = wd / f"{name}-{p}"
        sockets = _short_dir()
        proc = ManagedProcess(name, placement.wrap(argv), workdir=run_dir, port=p,
                              env=vllm_env(run_dir, {**client_env(host), **env}, socket_dir=sockets))
        proc.after_stop.append(lambda _p: shutil.rmtree(sockets, ignore_errors=True))
        proc.start()
        proc.address, proc.url = f"{host}:{p}", f"http://{host}:{p}"
        models = http_probe(f"{proc.url}/v1/models", lambda s, b: s == 200)
        proc.wait_ready(lambda: proc.listens_on(p) and models(), wait, "serving /v1/models on " + proc.url)
        return proc

    return with_port_retry(launch, port, name, placement)
