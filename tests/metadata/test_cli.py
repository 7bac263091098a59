"""``mooncake-vllm metadata list|gc|serve`` as a user runs them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from mooncake_vllm.metadata.backends import backend_for, http_request
from tests.md_services import child_env, free_port, readline, stop

MAIN = "import sys; from mooncake_vllm.cli import main; sys.exit(main())"


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", MAIN, "metadata", *args], capture_output=True, text=True,
                          env=env or child_env(), timeout=60)


def test_serve_binds_loopback_prints_ready_and_stops_on_sigterm(tmp_path) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", MAIN, "metadata", "serve", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(), start_new_session=True)
    try:
        line = readline(proc, 20)
        assert line == f"mooncake-vllm metadata server ready at http://127.0.0.1:{port}/metadata (backend memory)"
        assert http_request("GET", f"http://127.0.0.1:{port}/health")[0] == 200
        listening = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True).stdout
        local = [line.split()[3] for line in listening.splitlines()]
        assert local == [f"127.0.0.1:{port}"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert proc.stderr is not None and b"Traceback" not in proc.stderr.read()
    finally:
        stop(proc)


def test_serve_port_taken_is_one_clear_error() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = cli("serve", "--port", str(port))
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "--port" in result.stderr
    assert "Traceback" not in result.stderr


def test_list_table_and_json(md_server) -> None:
    server = md_server("memory")
    b = backend_for(server.url)
    b.put("mooncake/ram/127.0.0.1:5", b'{"tcp_data_host":"127.0.0.1","tcp_data_port":7}')
    b.put("mooncake/rpc_meta/127.0.0.1:5", b'{"ip_or_host_name":"127.0.0.1","rpc_port":6}')
    table = cli("list", "--metadata", server.url)
    assert table.returncode == 0, table.stderr
    assert "2 entries" in table.stdout
    assert "mooncake/rpc_meta/127.0.0.1:5  44     rpc 127.0.0.1:6" in table.stdout
    assert "tcp 127.0.0.1:7" in table.stdout
    doc = json.loads(cli("list", "--metadata", server.url, "--format", "json").stdout)
    assert [e["key"] for e in doc["entries"]] == ["mooncake/ram/127.0.0.1:5", "mooncake/rpc_meta/127.0.0.1:5"]


def test_url_from_mooncake_config_path(md_server, tmp_path) -> None:
    server = md_server("memory")
    cfg = tmp_path / "mooncake_config.json"
    cfg.write_text(json.dumps({"metadata_server": server.url, "master_server_address": "127.0.0.1:50051",
                               "global_segment_size": "0", "local_buffer_size": "1GB", "protocol": "tcp",
                               "device_name": ""}))
    result = cli("list", env=child_env(MOONCAKE_CONFIG_PATH=str(cfg)))
    assert result.returncode == 0, result.stderr
    assert f"0 entries in {server.url}" in result.stdout


def test_errors_are_one_clear_line_each() -> None:
    env = child_env()
    env.pop("MOONCAKE_CONFIG_PATH", None)
    env.pop("MOONCAKE_TE_META_DATA_SERVER", None)
    missing = cli("gc", env=env)
    assert missing.returncode == 2 and "--metadata" in missing.stderr
    p2p = cli("list", "--metadata", "P2PHANDSHAKE")
    assert p2p.returncode == 2 and "P2PHANDSHAKE needs no metadata server" in p2p.stderr
    down = cli("gc", "--metadata", f"http://127.0.0.1:{free_port()}/metadata")
    assert down.returncode == 1 and "unreachable" in down.stderr
    for r in (missing, p2p, down):
        assert "Traceback" not in r.stderr
