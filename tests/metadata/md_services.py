"""Process helpers for the metadata tests (real services, stopped by process-group id, never by name)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["BIN", "HERE", "Client", "Server", "child_env", "free_port", "readline", "start", "stop", "wait_port"]

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
BIN = Path(sys.executable).parent
CLIENT_ENV = {
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    "MC_STORE_CLIENT_SETUP_RETRIES": "1",
    "MC_RPC_TIMEOUT_MS": "2000",
    "MC_LOG_LEVEL": "ERROR",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    env.update(CLIENT_ENV)
    env.update(extra)
    return env


def stop(proc: subprocess.Popen, *, sig: int = signal.SIGTERM, grace: float = 10.0) -> int:
    """Stop ``proc`` (and its process group) by PID; returns its exit code."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    return proc.returncode


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout} s")


def start(cmd: list[str], log: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, **kw)


class Server:
    """Our metadata server as a child process."""

    def __init__(self, backend: str, log: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mooncake_vllm.metadata.server", "--port", "0", "--backend", backend],
            stdout=subprocess.PIPE, stderr=open(log, "wb"), stdin=subprocess.DEVNULL, env=child_env(),
            start_new_session=True,
        )
        self.ready_line = readline(self.proc, 20.0)
        if "ready at " not in self.ready_line:
            stop(self.proc)
            raise RuntimeError(f"metadata server did not start: {self.ready_line!r}; see {log}")
        self.url = self.ready_line.split("ready at ", 1)[1].split(" ", 1)[0]

    def stop(self, sig: int = signal.SIGTERM) -> int:
        return stop(self.proc, sig=sig)


def readline(proc: subprocess.Popen, timeout: float) -> str:
    """One stdout line of ``proc`` within ``timeout`` seconds ('' on EOF/timeout)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline().decode("utf-8", "replace").strip() if ready else ""


class Client:
    """A real Mooncake store client process running mc_client.py."""

    def __init__(self, metadata: str, master: str, log: Path, *, segment_mb: int = 0, resolve: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.log = log
        cmd = [sys.executable, str(HERE / "mc_client.py"), "--metadata", metadata, "--master", master,
               "--segment-mb", str(segment_mb)] + (["--resolve"] if resolve else [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "wb"),
                                     env=child_env(**(env or {})), start_new_session=True)
        line = readline(self.proc, 60.0)
        self.info = json.loads(line) if line.startswith("{") else {"ready": False, "line": line}
        if not self.info.get("ready"):
            stop(self.proc, sig=signal.SIGKILL)
            raise RuntimeError(f"Mooncake client did not set up: {self.info}; log: {log.read_text()[-2000:]}")
        self.hostname: str = self.info["hostname"]

    def call(self, op: str, prefix: str = "", n: int = 0, timeout: float = 60.0) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, "prefix": prefix, "n": n}) + "\n").encode())
        self.proc.stdin.flush()
        line = readline(self.proc, timeout)
        if not line:
            raise RuntimeError(f"client gave no answer to {op}; log: {self.log.read_text()[-2000:]}")
        return int(json.loads(line)["ok"])

    def quit(self) -> int:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        return stop(self.proc, sig=signal.SIGKILL)
