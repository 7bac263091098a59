"""Process helpers for the metadata and redis-bridge tests.

Real services, stopped by process-group id, never by name."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

from mooncake_vllm.services import client_env, free_port

__all__ = ["HERE", "Client", "Server", "child_env", "free_port", "readline", "stop"]

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    env.update(client_env())  # MC_TCP_BIND_ADDRESS=127.0.0.1, setup retries 1, RPC timeout 2 s, glog ERROR
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
