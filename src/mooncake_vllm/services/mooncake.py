"""Mooncake services on loopback: master, HTTP metadata, pool holder, and the LocalStack.

Everything binds 127.0.0.1 (except the listeners Mooncake clients always open on the
wildcard address, see running-on-cpu.md 1.4) and uses free ports; a
:class:`~mooncake_vllm.services.placement.Placement` puts a service elsewhere (a simulated
host: an address in a network namespace).
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from mooncake_vllm.config import CONFIG_ENV
from mooncake_vllm.services.placement import LOOPBACK, Placement
from mooncake_vllm.services.process import (
    ManagedProcess,
    ServiceError,
    find_binary,
    free_port,
    http_probe,
    with_port_retry,
)
from mooncake_vllm.services.tier import DiskTier, holder_env

__all__ = [
    "HOLDER_KINDS",
    "METADATA_KINDS",
    "LocalStack",
    "client_env",
    "clean_dev_shm",
    "cli_argv",
    "start_holder",
    "start_http_metadata",
    "start_master",
    "watch_dev_shm",
]

METADATA_KINDS = ("mooncake", "embedded", "p2p")
HOLDER_KINDS = ("auto", "mooncake_client", "python")
P2P = "P2PHANDSHAKE"

#: Progress callback: (component, state, detail); state is "starting" | "ready" | "stopped".
Progress = Callable[[str, str, str], None]


def client_env(host: str = "127.0.0.1") -> dict[str, str]:
    """MC_* variables every Mooncake client we start (or a test starts) should get.

    Advertise ``host`` (loopback unless placed elsewhere), fail ``setup`` in seconds rather than ~90 s on a wrong
    master, bound each master RPC to 2 s, and silence glog INFO.
    """
    return {
        "MC_TCP_BIND_ADDRESS": host,
        "MC_STORE_CLIENT_SETUP_RETRIES": "1",
        "MC_RPC_TIMEOUT_MS": "2000",
        "MC_LOG_LEVEL": "ERROR",
    }


def _env(host: str = "127.0.0.1") -> dict[str, str]:
    """Environment of our Mooncake servers/holders: client_env() but with glog INFO kept
    (their logs are attached to failing tests)."""
    env = dict(os.environ)
    env.update(client_env(host))
    env.pop("MC_LOG_LEVEL", None)
    return env


def cli_argv(*args: str) -> list[str]:
    """argv running ``mooncake-vllm ARGS`` with this interpreter (no console script needed)."""
    return [sys.executable, "-c", "import sys; from mooncake_vllm.cli import main; sys.exit(main(sys.argv[1:]))",
            *args]


# -- /dev/shm leftovers -------------------------------------------------------------
_SHM = Path("/dev/shm")


def _shm_names() -> set[str]:
    try:
        return set(os.listdir(_SHM))
    except OSError:
        return set()


def _shm_in_use() -> tuple[set[str], bool]:
    """Names under /dev/shm that some live process has open or mapped, and whether every process of
    this user could be inspected (a process that exited meanwhile does not count as unreadable)."""
    used: set[str] = set()
    complete = True
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited
        except OSError:
            try:
                if os.stat(f"/proc/{pid}").st_uid == os.getuid():
                    complete = False  # one of ours whose open files we cannot see: it may hold any of ours
            except OSError:
                pass
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if target.startswith("/dev/shm/"):
                used.add(target[9:].split(" ")[0])
        try:  # mapped after the descriptor was closed (unreadable for some init processes: fds suffice there)
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    if "/dev/shm/" in line:
                        used.add(line.split("/dev/shm/", 1)[1].split(" ")[0].strip())
        except OSError:
            pass
    return used, complete


def clean_dev_shm(before: set[str]) -> list[str]:
    """Remove /dev/shm entries created since ``before`` that no live process uses.

    Only Mooncake-looking regular files owned by this user are touched (a
    SIGKILLed holder can leave its shared-memory pool behind). Nothing is removed
    when a process of this user could not be inspected, and the in-use scan is
    repeated right before the removals. Returns the names removed.
    """
    new = _shm_names() - before
    if not new:
        return []
    candidates = []
    for name in new:
        if not ("mooncake" in name.lower() or name.startswith(("mc_", "mc-"))):
            continue
        try:
            info = os.lstat(_SHM / name)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
            candidates.append(name)
    removed: list[str] = []
    for _ in range(2):  # two scans: a file must look unused in both
        if not candidates:
            return removed
        in_use, complete = _shm_in_use()
        if not complete:
            return removed
        candidates = [n for n in candidates if n not in in_use]
    for name in candidates:
        try:
            (_SHM / name).unlink()
            removed.append(name)
        except OSError:
            pass
    return removed


def watch_dev_shm(proc: ManagedProcess) -> ManagedProcess:
    """Arrange for /dev/shm leftovers of ``proc`` to be removed once it stops; call before start()."""
    before = _shm_names()
    proc.after_stop.append(lambda _p: clean_dev_shm(before))
    return proc


# -- launchers ----------------------------------------------------------------------
def start_master(
    workdir: str | os.PathLike,
    client_ttl: int = 2,
    *,
    port: int | None = None,
    metrics_port: int | None = None,
    extra_args: Sequence[str] = (),
    timeout: float = 30.0,
    name: str = "mooncake_master",
    placement: Placement = LOOPBACK,
) -> ManagedProcess:
    """Start ``mooncake_master`` on ``placement`` (RPC and metrics); ready when both answer.

    The result has ``.address`` ("HOST:P", the ``master_server_address``)
    and ``.url`` (the metrics base URL).
    """
    host = placement.host
    binary = find_binary("mooncake_master", name)

    def launch(rpc_port: int) -> ManagedProcess:
        mport = metrics_port or free_port()
        argv = placement.wrap([
            binary,
            f"--rpc_address={host}",
            f"--rpc_port={rpc_port}",
            f"--metrics_host={host}",
            f"--metrics_port={mport}",
            f"--client_ttl={client_ttl}",
            *extra_args,
        ])
        proc = watch_dev_shm(ManagedProcess(name, argv, workdir=workdir, env=_env(host), port=rpc_port)).start()
        proc.address = f"{host}:{rpc_port}"
        proc.url = f"http://{host}:{mport}"
        serving = http_probe(f"{proc.url}/metrics/summary", lambda s, b: s == 200 and b"service_ready=true" in b)
        proc.wait_ready(lambda: proc.listens_on(rpc_port) and proc.listens_on(mport) and serving(),
                        timeout, "serving on " + proc.address)
        return proc

    return with_port_retry(launch, port, name, placement)


def start_http_metadata(
    workdir: str | os.PathLike,
    kind: str = "mooncake",
    backend: str = "memory",
    *,
    port: int | None = None,
    extra_args: Sequence[str] = (),
    timeout: float = 30.0,
    placement: Placement = LOOPBACK,
) -> ManagedProcess:
    """Start an HTTP metadata server on ``placement``; ``.url`` is ``http://HOST:P/metadata``.

    ``kind="mooncake"`` runs the wheel's ``mooncake_http_metadata_server``;
    ``kind="embedded"`` runs ours (``python -m mooncake_vllm.metadata.server``)
    with ``backend`` ("memory" or a redis/etcd URL it understands).
    """
    host = placement.host
    if kind == "mooncake":
        name = "mooncake_http_metadata_server"
        binary = find_binary(name, "metadata server")

        def argv(p: int) -> list[str]:
            return [binary, "--host", host, "--port", str(p), *extra_args]

    elif kind == "embedded":
        name = "metadata_server"

        def argv(p: int) -> list[str]:
            return [sys.executable, "-m", "mooncake_vllm.metadata.server", "--host", host,
                    "--port", str(p), "--backend", backend, *extra_args]

    else:
        raise ValueError(f"metadata kind: got {kind!r}, expected 'mooncake' or 'embedded' "
                         f"(P2PHANDSHAKE needs no server)")

    def launch(p: int) -> ManagedProcess:
        proc = ManagedProcess(name, placement.wrap(argv(p)), workdir=workdir, env=_env(host), port=p).start()
        proc.url = f"http://{host}:{p}/metadata"
        proc.address = f"{host}:{p}"
        # Any HTTP answer to a GET of an absent key (404) means it serves.
        answers = http_probe(f"{proc.url}?key=mooncake-vllm%2Fprobe")
        proc.wait_ready(lambda: proc.listens_on(p) and answers(), timeout, "serving on " + proc.url)
        return proc

    return with_port_retry(launch, port, name, placement)


def start_holder(
    workdir: str | os.PathLike,
    master: str,
    metadata: str,
    segment_size: int = 256 << 20,
    local_buffer: int = 64 << 20,
    *,
    kind: str = "auto",
    port: int | None = None,
    timeout: float = 30.0,
    name: str = "pool_holder",
    placement: Placement = LOOPBACK,
    disk: tuple[Path, int] | None = None,
) -> ManagedProcess:
    """Start a process that mounts ``segment_size`` bytes of pool memory and keeps it.

    ``kind="mooncake_client"`` runs the wheel's standalone ``mooncake_client``
    (verified: pure clients in other processes put into it with ordinary
    ``setup(..., 0, ...)``, and data outlives them); ``kind="python"`` runs
    ``mooncake-vllm holder``; ``kind="auto"`` picks mooncake_client when the wheel
    has it (Mooncake >= 0.3.8), else the Python holder. Ready once its segment is mounted.
    ``placement``: the address peers reach it at and the namespace it runs in.
    ``disk``: (directory, bytes) of its disk tier (``services.tier``; the master needs
    ``--enable_offload=true``).
    """
    host = placement.host
    if kind not in HOLDER_KINDS:
        raise ValueError(f"holder kind: got {kind!r}, expected one of {HOLDER_KINDS}")
    if segment_size <= 0:
        raise ValueError(f"segment_size: got {segment_size}, expected > 0 bytes (the holder's pool memory)")
    if kind == "auto":
        try:
            find_binary("mooncake_client", name)
            kind = "mooncake_client"
        except ServiceError:
            kind = "python"
    if kind == "mooncake_client":
        binary = find_binary("mooncake_client", name)

        def argv(p: int) -> list[str]:
            return [binary, f"--host={host}", f"--port={p}", f"--global_segment_size={segment_size}",
                    f"--local_buffer_size={local_buffer}", f"--master_server_address={master}",
                    f"--metadata_server={metadata}", "--protocol=tcp",
                    *(["--enable_offload=true"] if disk else [])]
    else:
        def argv(p: int) -> list[str]:
            return [*cli_argv("holder"), "--master", master,
                    "--metadata", metadata, "--segment-size", str(segment_size),
                    "--local-buffer", str(local_buffer), "--ready-port", str(p), "--host", host,
                    *(["--ssd", str(disk[0]), "--ssd-size", str(disk[1])] if disk else [])]
    env = _env(host)
    if disk:
        env.update(holder_env(*disk))

    def launch(p: int) -> ManagedProcess:
        proc = watch_dev_shm(ManagedProcess(name, placement.wrap(argv(p)), workdir=workdir, env=env,
                                            port=p)).start()
        proc.address = f"{host}:{p}"
        # Both kinds open their port only after setup() mounted the segment.
        proc.wait_ready(lambda: proc.listens_on(p), timeout, "holding a mounted segment")
        return proc

    return with_port_retry(launch, port, name, placement)


# -- the local stack ------------------------------------------------------------------
class LocalStack:
    """mooncake_master + metadata + pool holders on loopback, and a ready ``mooncake_config.json``.

    Use as a context manager, or call ``start()`` / ``stop()``. The config has the
    seed's V1 shape: vLLM instances are pure clients (``global_segment_size "0"``),
    the pool's memory lives in ``holders`` holder processes that split
    ``segment_size`` evenly (values spread over them; a client striping its
    transfers over several store clients reads several holders at once, and one
    holder's death costs only its share). ``disk``: a disk tier behind the holders' DRAM
    (``services.tier``: the master runs with offload, each holder with its own directory).
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        metadata: str = "mooncake",
        segment_size: int = 256 << 20,
        local_buffer_size: int = 64 << 20,
        client_ttl: int = 2,
        master_port: int | None = None,
        metadata_port: int | None = None,
        holder_port: int | None = None,
        holder: str = "auto",
        metadata_backend: str = "memory",
        progress: Progress | None = None,
        holders: int = 1,
        disk: DiskTier | None = None,
    ) -> None:
        if metadata not in METADATA_KINDS:
            raise ValueError(f"metadata: got {metadata!r}, expected one of {', '.join(METADATA_KINDS)}")
        if local_buffer_size <= 0:
            raise ValueError(f"local_buffer_size: got {local_buffer_size}, expected > 0 bytes")
        if segment_size <= 0:
            raise ValueError(f"segment_size: got {segment_size}, expected > 0 bytes (the holder's pool memory)")
        if holder not in HOLDER_KINDS:
            raise ValueError(f"holder: got {holder!r}, expected one of {', '.join(HOLDER_KINDS)}")
        if isinstance(holders, bool) or not isinstance(holders, int) or not 1 <= holders <= 64:
            raise ValueError(f"holders: got {holders!r}, expected 1 to 64 holder processes")
        if segment_size // holders < 16 << 20:
            raise ValueError(f"segment_size: {segment_size} bytes split over {holders} holders is "
                             f"under 16 MiB each; give more memory or fewer holders")
        self.workdir = Path(workdir)
        self.metadata_kind = metadata
        self.segment_size = segment_size
        self.local_buffer_size = local_buffer_size
        self.client_ttl = client_ttl
        self.ports = {"master": master_port, "metadata": metadata_port, "holder": holder_port}
        self.holder_kind = holder
        self.holder_count = holders
        self.holders: list[ManagedProcess] = []
        self.disk = disk
        self.metadata_backend = metadata_backend
        self.progress = progress or (lambda component, state, detail: None)
        self.master: ManagedProcess | None = None
        self.metadata_server: ManagedProcess | None = None
        self.config_path = self.workdir / "mooncake_config.json"
        self._written: str | None = None  # the config text start() wrote, removed again by stop()

    @property
    def master_address(self) -> str:
        if self.master is None or self.master.address is None:
            raise ServiceError("LocalStack: not started")
        return self.master.address

    @property
    def metadata_url(self) -> str:
        if self.metadata_kind == "p2p":
            return P2P
        if self.metadata_server is None or self.metadata_server.url is None:
            raise ServiceError("LocalStack: not started")
        return self.metadata_server.url

    @property
    def holder(self) -> ManagedProcess | None:
        """The first holder (``None`` before start)."""
        return self.holders[0] if self.holders else None

    @property
    def processes(self) -> list[ManagedProcess]:
        return [p for p in (self.master, self.metadata_server) if p is not None] + self.holders

    def config(self) -> dict[str, str | bool]:
        """The V1 ``mooncake_config.json`` content for pure clients of this stack."""
        return {
            "metadata_server": self.metadata_url,
            "master_server_address": self.master_address,
            "global_segment_size": "0",
            "local_buffer_size": str(self.local_buffer_size),
            "protocol": "tcp",
            "device_name": "",
            **({"enable_ssd_offload": True} if self.disk else {}),
        }

    def env(self) -> dict[str, str]:
        """Environment for a client of this stack: MOONCAKE_CONFIG_PATH plus the MC_* variables."""
        return {CONFIG_ENV: str(self.config_path), **client_env()}

    def _step(self, component: str, start: Callable[[], ManagedProcess]) -> ManagedProcess:
        self.progress(component, "starting", "")
        t0 = time.monotonic()
        proc = start()
        where = proc.url if component == "metadata" else proc.address
        self.progress(component, "ready", f"{where} pid {proc.pid} "
                                          f"in {time.monotonic() - t0:.1f} s, log {proc.log_path}")
        return proc

    def start(self) -> LocalStack:
        """Start master, metadata and holder; write the config. On failure stop what started."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.unlink(missing_ok=True)  # a stale config would point at dead ports
        try:
            self.master = self._step("master", lambda: start_master(
                self.workdir, self.client_ttl, port=self.ports["master"],
                extra_args=self.disk.master_args() if self.disk else ()))
            if self.metadata_kind != "p2p":
                self.metadata_server = self._step("metadata", lambda: start_http_metadata(
                    self.workdir, self.metadata_kind, self.metadata_backend, port=self.ports["metadata"]))
            else:
                self.progress("metadata", "ready", "P2PHANDSHAKE (no server needed)")
            self.holders = []
            each = self.segment_size // self.holder_count
            for i in range(self.holder_count):
                name = "pool_holder" if i == 0 else f"pool_holder{i}"
                port = self.ports["holder"] if i == 0 else None
                disk = (self.disk.holder_dir(name), self.disk.size // self.holder_count) if self.disk else None
                self.holders.append(self._step("holder", lambda port=port, name=name, disk=disk: start_holder(
                    self.workdir, self.master_address, self.metadata_url, each,
                    self.local_buffer_size, kind=self.holder_kind, port=port, name=name, disk=disk)))
        except BaseException:
            self.stop()
            raise
        text = json.dumps(self.config(), indent=2) + "\n"
        tmp = self.config_path.with_suffix(".json.tmp")
        tmp.write_text(text)
        tmp.replace(self.config_path)  # never half-written
        self._written = text
        return self

    def stop(self) -> None:
        """Stop holder, metadata and master (in that order), then remove the config this stack wrote
        (it would point at dead ports); idempotent. A config someone changed since is left alone."""
        for component, proc in ([("holder", h) for h in reversed(self.holders)]
                                + [("metadata", self.metadata_server), ("master", self.master)]):
            if proc is not None and not proc.stopped:
                proc.stop()
                self.progress(component, "stopped", f"exit code {proc.returncode}")
        written, self._written = self._written, None
        if written is not None:
            try:
                if self.config_path.read_text() == written:
                    self.config_path.unlink()
                    self.progress("config", "stopped", f"removed {self.config_path}")
            except OSError:
                pass  # already gone or unreadable: nothing of ours to remove

    def alive(self) -> bool:
        return bool(self.processes) and all(p.alive() for p in self.processes)

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
