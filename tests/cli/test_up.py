"""``mooncake-vllm up`` for real: a subprocess that starts the stack, serves, and stops on a signal."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mooncake_vllm.cli import up
from mooncake_vllm.config import load_store_config
from mooncake_vllm.services import cli_argv, client_env, free_port, tcp_probe

CLIENT = """
import json, os, sys
from mooncake.store import MooncakeDistributedStore
cfg = json.load(open(os.environ["MOONCAKE_CONFIG_PATH"]))
s = MooncakeDistributedStore()
assert s.setup("127.0.0.1", cfg["metadata_server"], 0, 16 << 20, "tcp", "", cfg["master_server_address"]) == 0
assert s.put("up-key", b"x" * 4096) == 0
assert s.get("up-key") == b"x" * 4096
s.close()
print("client ok")
"""


class Up:
    """A running ``mooncake-vllm up`` subprocess (own session) and what it printed."""

    def __init__(self, workdir: Path, *extra: str) -> None:
        self.workdir = workdir
        argv = [*cli_argv("up"), "--workdir", str(workdir), "--client-ttl", "2", *extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.rstrip("\n"))
            if line.startswith(up.READY_LINE):
                return
        raise AssertionError(f"no ready line; rc={self.proc.poll()} stdout:\n" + "\n".join(self.lines)
                             + f"\nstderr:\n{self.stderr()}")

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return ""
        assert self.proc.stderr is not None
        return self.proc.stderr.read()

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def finish(self, timeout: float = 60) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, "\n".join(self.lines) + out, err

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return out


def ports() -> list[str]:
    return ["--master-port", str(free_port()), "--metadata-port", str(free_port()),
            "--holder-port", str(free_port())]


@pytest.mark.parametrize(("sig", "metadata"), [
    pytest.param(signal.SIGTERM, "embedded", id="sigterm-embedded"),
    pytest.param(signal.SIGINT, "mooncake", id="sigint-mooncake"),
    pytest.param(signal.SIGTERM, "p2p", id="sigterm-p2p"),
])
def test_up_serves_then_stops_everything(workdir: Path, sig: int, metadata: str) -> None:
    args = ports()
    run = Up(workdir, "--metadata", metadata, "--segment-size", "128MB", "--local-buffer", "32MB",
             "--holders", "2", *args)
    try:
        run.wait_ready()
        kids = run.children()
        assert len(kids) >= 3 + (metadata != "p2p"), alive(kids)
        holders = [p for p in kids if "mooncake_client" in " ".join(p.cmdline())]
        assert len(holders) == 2 and all(f"--global_segment_size={64 << 20}" in p.cmdline()
                                         for p in holders), [p.cmdline() for p in holders]
        master_port = int(args[1])
        assert tcp_probe(master_port)()
        config_path = workdir / "mooncake_config.json"
        cfg = load_store_config(config_path)  # the project's validator accepts it as is
        assert cfg.master_server_address == f"127.0.0.1:{master_port}"
        assert cfg.global_segment_size == 0 and cfg.local_buffer_size == 32 << 20
        assert cfg.metadata_server == ("P2PHANDSHAKE" if metadata == "p2p"
                                       else f"http://127.0.0.1:{args[3]}/metadata")
        out = "\n".join(run.lines)
        assert f"MOONCAKE_CONFIG_PATH={config_path}" in out
        for role in ("kv_both", "kv_producer", "kv_consumer"):
            assert f'"kv_role":"{role}"' in out
        # A pure client in another process uses the written config: the pool works.
        env = {**os.environ, **client_env(), "MOONCAKE_CONFIG_PATH": str(config_path)}
        client = subprocess.run([sys.executable, "-c", CLIENT], env=env, capture_output=True, text=True,
                                timeout=60)
        assert client.returncode == 0, client.stderr[-2000:]
        os.kill(run.proc.pid, sig)
        rc, stdout, stderr = run.finish()
        assert rc == 0, stderr
        assert f"{signal.Signals(sig).name} received, stopping" in stdout
        assert "stopped master" in stdout
        deadline = time.monotonic() + 10  # reaped children may take a moment to vanish from /proc
        while alive(kids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive(kids) == []
        assert not tcp_probe(master_port)()
        # the config pointed at the stopped ports: it is gone, not left behind stale
        assert not config_path.exists() and f"removed {config_path}" in stdout
    finally:
        run.cleanup()


def test_component_dying_stops_the_rest(workdir: Path) -> None:
    run = Up(workdir, "--metadata", "mooncake", *ports())
    try:
        run.wait_ready()
        kids = run.children()
        holder = next(p for p in kids if "mooncake_client" in " ".join(p.cmdline()))
        holder.kill()
        rc, _, stderr = run.finish()
        assert rc == 1
        assert "pool_holder exited unexpectedly" in stderr
        assert alive(kids) == []
    finally:
        run.cleanup()


def test_taken_port_is_a_clear_error(workdir: Path) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]
        run = Up(workdir, "--master-port", str(taken))
        rc, stdout, stderr = run.finish()
    assert rc == 1
    assert "mooncake_master" in stderr and f"127.0.0.1:{taken} is already in use" in stderr
    assert not (workdir / "mooncake_config.json").exists()


def test_bad_size_names_the_option(workdir: Path) -> None:
    rc, _, stderr = Up(workdir, "--segment-size", "lots").finish()
    assert rc == 2 and "--segment-size" in stderr and "'lots'" in stderr
    rc, _, stderr = Up(workdir, "--holders", "0").finish()
    assert rc == 2 and "--holders must be auto or 1 to 64" in stderr and "'0'" in stderr


def test_holders_auto_is_one_per_four_cores() -> None:
    from mooncake_vllm.cli.up import parse_holders
    from mooncake_vllm.settings import auto_store_clients

    assert parse_holders("auto") == auto_store_clients() and parse_holders("3") == 3
    with pytest.raises(ValueError, match="--holders"):
        parse_holders("many")


def test_taken_default_port_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]
        monkeypatch.setattr(up, "DEFAULT_PORTS", {"master": taken, "metadata": taken, "holder": taken})
        args = argparse.Namespace(master_port=None, metadata_port=4242, holder_port=None)
        chosen, notes = up._pick_ports(args)
    assert chosen["metadata"] == 4242  # explicit ports are kept (and checked by the launcher)
    assert chosen["master"] != taken and chosen["holder"] != taken
    assert [n.split(":")[0] for n in notes] == ["master", "holder"]
    assert f"default port {taken} is taken" in notes[0]


def test_vllm_serve_lines_are_the_seeds_with_our_config() -> None:
    lines = up.vllm_serve_lines("/x y/mooncake_config.json", "m")
    assert lines["kv_both"].startswith("MOONCAKE_CONFIG_PATH='/x y/mooncake_config.json' \\\nvllm serve m")
    ktc = json.loads(lines["kv_consumer"].rsplit("--kv-transfer-config ", 1)[1].strip("'"))
    assert ktc == {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_consumer"}
    assert "--port 8100" in lines["kv_producer"] and "--port 8200" in lines["kv_consumer"]
