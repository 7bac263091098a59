"""Managed child processes on loopback: start, wait until ready, stop by PID.

Every process is started in its own session (so its process group id equals its
PID), logs to a file in a work directory, and is recorded in a registry that
stops it at interpreter exit and on SIGTERM. Stopping sends SIGTERM to the
process group, then SIGKILL after a grace period; nothing is ever killed by name.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from mooncake_vllm.errors import ServiceError
from mooncake_vllm.services.placement import LOOPBACK, Placement

__all__ = [
    "SETUP_HINT",
    "ManagedProcess",
    "ServiceError",
    "find_binary",
    "free_port",
    "http_probe",
    "listening_ports",
    "running",
    "started",
    "stop_all",
    "port_is_free",
    "tcp_probe",
    "with_port_retry",
]

#: The command that installs every binary the services need.
SETUP_HINT = "bash scripts/dev.sh setup"


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True if ``port`` can be bound on ``host`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def find_binary(name: str, component: str | None = None) -> str:
    """Full path of executable ``name``: next to this interpreter first, then PATH.

    Raises ServiceError naming the component and the setup command when absent.
    """
    here = Path(sys.executable).parent  # the venv's bin/, not resolved through symlinks
    found = shutil.which(name, path=os.pathsep.join([str(here), os.environ.get("PATH", "")]))
    if found is None:
        raise ServiceError(
            f"{component or name}: executable {name!r} not found next to {sys.executable} "
            f"or on PATH; install it with `{SETUP_HINT}`"
        )
    return found


def tcp_probe(port: int, host: str = "127.0.0.1") -> Callable[[], bool]:
    """A readiness probe: True once something accepts TCP connections on host:port."""

    def probe() -> bool:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            return False

    return probe


def http_probe(url: str, ok: Callable[[int, bytes], bool] | None = None) -> Callable[[], bool]:
    """A readiness probe: True once GET ``url`` answers and ``ok(status, body)`` holds.

    Without ``ok``, any HTTP answer (including 404) counts as ready.
    """

    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310 - loopback URL
                status, body = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, body = exc.code, exc.read() if exc.fp else b""
        except (OSError, ValueError):
            return False
        return True if ok is None else bool(ok(status, body))

    return probe


def listening_ports(pids: Sequence[int]) -> set[int]:
    """TCP ports in LISTEN state owned by any of ``pids`` (Linux /proc, IPv4 and IPv6; each in its
    own network namespace)."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    ports: set[int] = set()
    # each process's own table: a process in another network namespace (a Placement's
    # netns) lists its sockets there, not in ours
    for table in _tcp_tables(pids):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and f[9] in inodes:  # 0A = LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def _tcp_tables(pids: Sequence[int]) -> list[str]:
    """``/proc/<pid>/net/tcp{,6}`` once per network namespace among ``pids``."""
    seen: set[str] = set()
    tables: list[str] = []
    for pid in pids:
        try:
            netns = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if netns not in seen:
            seen.add(netns)
            tables += [f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"]
    return tables


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        _LIBC.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG: die with the parent thread
    except Exception:  # noqa: BLE001 - best effort safety net only
        pass


try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - non-glibc platforms
    _LIBC = None


class ManagedProcess:
    """One child process we own: started in its own session, logged to a file.

    ``name`` is the component name used in every message; ``port`` is the main
    port it serves (if any); ``url``/``address`` are set by the launchers.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        workdir: str | os.PathLike,
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        log_name: str | None = None,
    ) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.workdir = Path(workdir)
        self.env = dict(os.environ if env is None else env)
        self.port = port
        self.url: str | None = None
        self.address: str | None = None
        self.log_path = self.workdir / (log_name or f"{name}.log")
        self._popen: subprocess.Popen[bytes] | None = None
        self._stopped = False
        #: Callbacks run once after the process was stopped (e.g. /dev/shm cleanup).
        self.after_stop: list[Callable[[ManagedProcess], None]] = []

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> ManagedProcess:
        """Spawn the process (own session, stdin closed, stdout+stderr to the log file)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            in_main = threading.current_thread() is threading.main_thread()
            self._popen = subprocess.Popen(  # noqa: S603 - argv built by our launchers
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env=self.env,
                start_new_session=True,
                # The parent-death signal follows the forking *thread*; only use it
                # from the main thread so a short-lived worker thread cannot kill us.
                preexec_fn=_set_pdeathsig if (in_main and _LIBC is not None) else None,  # noqa: PLW1509
            )
        _register(self)
        return self

    @property
    def pid(self) -> int:
        if self._popen is None:
            raise ServiceError(f"{self.name}: not started")
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return None if self._popen is None else self._popen.poll()

    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` ran (whatever the exit code)."""
        return self._stopped

    def alive(self) -> bool:
        """True while the main process has not exited."""
        return self._popen is not None and self._popen.poll() is None

    def group_pids(self) -> list[int]:
        """PIDs alive in this process's group (the process and children that stayed in it)."""
        return _group_members(self.pid) if self._popen is not None else []

    def listens_on(self, port: int) -> bool:
        """True if this process (or its group) itself listens on ``port`` (not some other program)."""
        return port in listening_ports(self.group_pids())

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the log file ("" if there is none yet)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 256 * max(n, 1)))  # lines of ~256 bytes are plenty
                data = f.read()
        except OSError:
            return ""
        lines = data.decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])

    def wait_ready(self, probe: Callable[[], bool], timeout: float, what: str = "ready") -> None:
        """Poll ``probe`` until it is True; on death or timeout stop and raise ServiceError."""
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            if not self.alive():
                rc = self.returncode
                self.stop()
                raise ServiceError(
                    f"{self.name} exited with code {rc} before it was {what} "
                    f"(command: {' '.join(self.argv)}; log {self.log_path}):\n{self.log_tail()}"
                )
            if probe():
                return
            if time.monotonic() >= deadline:
                self.stop()
                raise ServiceError(
                    f"{self.name} was not {what} within {timeout:.0f} s "
                    f"(command: {' '.join(self.argv)}; log {self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds; return the exit code.

        Idempotent. Only this process's own group (pgid == its PID) is signalled.
        """
        if self._popen is None:
            return None
        if self._stopped:
            return self._popen.returncode
        self._stopped = True
        pgid = self._popen.pid
        if self._popen.poll() is None:
            # The leader is not reaped yet, so its PID (= the group id) cannot be reused.
            _signal_group(pgid, signal.SIGTERM)
            try:
                self._popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _signal_group(pgid, signal.SIGKILL)
                self._popen.wait(timeout=10)
        elif _group_members(pgid):
            # The leader died on its own; its children still hold the group id: SIGTERM them.
            _signal_group(pgid, signal.SIGTERM)
        # Members left in the group keep its id reserved; give them a moment, then SIGKILL.
        deadline = time.monotonic() + min(grace, 5.0)
        while _group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_members(pgid):
            _signal_group(pgid, signal.SIGKILL)
            deadline = time.monotonic() + 5.0
            while _group_members(pgid) and time.monotonic() < deadline:
                time.sleep(0.05)
        _unregister(self)
        for hook in self.after_stop:
            try:
                hook(self)
            except Exception:  # noqa: BLE001 - cleanup must not mask the stop
                pass
        return self._popen.returncode

    def kill(self) -> None:
        """SIGKILL the whole process group now (simulates a crash); reaps the leader."""
        if self._popen is None:
            return
        _signal_group(self._popen.pid, signal.SIGKILL)
        self._popen.wait(timeout=10)
        self.stop(grace=1.0)

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "alive" if self.alive() else f"exited {self.returncode}"
        pid = self._popen.pid if self._popen else None
        return f"<ManagedProcess {self.name} pid={pid} port={self.port} {state}>"


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_members(pgid: int) -> list[int]:
    """PIDs still alive (not zombies) in process group ``pgid`` (Linux /proc)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state ppid pgrp ...
            members.append(int(entry))
    return members


def _bind_failed(exc: ServiceError) -> bool:
    text = str(exc).lower()
    return any(s in text for s in ("address already in use", "failed to bind", "bind failed", "errno 98"))


def with_port_retry(launch: Callable[[int], ManagedProcess], port: int | None,
                    component: str = "service", placement: Placement = LOOPBACK) -> ManagedProcess:
    """Run ``launch(port)``; if the port was ours to pick and got taken meanwhile, retry.

    An explicit ``port`` that is already taken is refused up front, naming ``component``
    (checked here only on loopback: another namespace's ports are its own).
    """
    if port and placement.netns is None and not port_is_free(port):
        raise ServiceError(f"{component}: port 127.0.0.1:{port} is already in use by another program; "
                           f"choose another port or leave it unset to get a free one")
    attempts = 1 if port else 3
    for attempt in range(attempts):
        try:
            return launch(port or free_port())
        except ServiceError as exc:
            if attempt + 1 >= attempts or not _bind_failed(exc):
                raise
    raise AssertionError("unreachable")  # pragma: no cover


# -- registry: everything we started is stopped at exit / SIGTERM -------------------
_REGISTRY: dict[int, ManagedProcess] = {}
_HISTORY: list[ManagedProcess] = []
_LOCK = threading.Lock()
_HOOKS_INSTALLED = False


def _register(proc: ManagedProcess) -> None:
    global _HOOKS_INSTALLED
    with _LOCK:
        _REGISTRY[id(proc)] = proc
        _HISTORY.append(proc)
        if _HOOKS_INSTALLED:
            return
        _HOOKS_INSTALLED = True
    atexit.register(stop_all)
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _on_sigterm)


def _unregister(proc: ManagedProcess) -> None:
    with _LOCK:
        _REGISTRY.pop(id(proc), None)


def _on_sigterm(signum: int, frame: object) -> None:
    stop_all()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def running() -> list[ManagedProcess]:
    """Every process started here that has not been stopped yet."""
    with _LOCK:
        return list(_REGISTRY.values())


def started() -> list[ManagedProcess]:
    """Every process started in this interpreter so far, oldest first (stopped ones too)."""
    with _LOCK:
        return list(_HISTORY)


def stop_all(grace: float = 10.0) -> None:
    """Stop every registered process, newest first (clients before the master)."""
    for proc in reversed(running()):
        try:
            proc.stop(grace=grace)
        except Exception:  # noqa: BLE001 - keep stopping the others
            pass
