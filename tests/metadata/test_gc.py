"""Stale-entry cleanup: a SIGKILLed client's entries are found and removed while the pool keeps serving."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import pytest
from md_services import child_env, free_port

from mooncake_vllm.metadata.backends import MemoryBackend, backend_for
from mooncake_vllm.metadata.gc import ALIVE, DEAD, UNKNOWN, collect_garbage, probe, scan


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from mooncake_vllm.cli import main; sys.exit(main())",
                           "metadata", *args],
                          capture_output=True, text=True, env=child_env(), timeout=60)


@pytest.mark.parametrize("backend_name", ["memory", "etcd", "etcd-native"])
def test_sigkilled_client_is_collected_while_survivor_serves(
    md_server, md_clients, md_master: str, request: pytest.FixtureRequest, backend_name: str, unique: str
) -> None:
    """memory/etcd: clients use our server; etcd-native: clients use the wheel's own etcd plugin
    (bare ``host:port``), so gc reads exactly what Mooncake itself wrote."""
    backend = "memory" if backend_name == "memory" else request.getfixturevalue("md_etcd_url")
    if backend_name == "etcd-native":
        client_url = url = backend.removeprefix("etcd://")
    else:
        client_url = md_server(backend).url
        url = client_url if backend_name == "memory" else backend  # gc reads our server, or etcd directly
    survivor = md_clients(client_url, md_master, segment_mb=32)
    victim = md_clients(client_url, md_master, segment_mb=32)
    reader = md_clients(client_url, md_master, segment_mb=0)
    assert survivor.call("put", unique, 10) == 10
    assert victim.call("put", unique + "-v", 5) == 5
    assert reader.call("get", unique, 10) == 10

    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    store = backend_for(url)
    dead_keys = {f"mooncake/ram/{victim.hostname}", f"mooncake/rpc_meta/{victim.hostname}"}
    assert dead_keys <= set(store.list())

    dry = _cli("gc", "--metadata", url, "--format", "json")
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout)
    assert set(report["stale_keys"]) == dead_keys and report["deleted"] == []
    states = {s["segment"]: s["state"] for s in report["segments"]}
    assert states[victim.hostname] == DEAD
    assert states[survivor.hostname] == ALIVE and states[reader.hostname] == ALIVE
    assert dead_keys <= set(store.list())  # dry run deleted nothing
    assert reader.call("get", unique, 10) == 10

    applied = _cli("gc", "--metadata", url, "--apply")
    assert applied.returncode == 0, applied.stderr
    assert "deleted 2 entries" in applied.stdout and victim.hostname in applied.stdout
    left = set(store.list())
    assert not dead_keys & left
    for alive in (survivor, reader):
        assert f"mooncake/ram/{alive.hostname}" in left and f"mooncake/rpc_meta/{alive.hostname}" in left
    assert reader.call("get", unique, 10) == 10  # the pool keeps serving
    assert survivor.call("put", unique + "-after", 5) == 5
    assert reader.call("get", unique + "-after", 5) == 5

    again = _cli("gc", "--metadata", url)
    assert "0 stale" in again.stdout


def test_probe_reports_why() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert probe("127.0.0.1", listener.getsockname()[1], 1.0) is None
    assert "refused" in (probe("127.0.0.1", free_port(), 1.0) or "").lower()


def test_only_authoritative_addresses_make_a_segment_dead() -> None:
    """A ram entry without tcp_data_port whose name port is closed is 'unknown' and never deleted."""
    closed = free_port()
    b = MemoryBackend()
    b.put(f"mooncake/ram/127.0.0.1:{closed}", b'{"name":"x","protocol":"rdma","buffers":[]}')
    b.put("mooncake/mycluster/rpc_meta/127.0.0.1:1", json.dumps({"ip_or_host_name": "127.0.0.1",
                                                                 "rpc_port": free_port()}).encode())
    b.put("mooncake/unrelated/key", b"{}")
    statuses = {s.segment: s for s in scan(b, timeout=0.5)}
    assert statuses[f"127.0.0.1:{closed}"].state == UNKNOWN
    assert statuses["127.0.0.1:1"].state == DEAD and statuses["127.0.0.1:1"].cluster_id == "mycluster"
    report = collect_garbage(b, apply=True, timeout=0.5)
    assert report.deleted == ["mooncake/mycluster/rpc_meta/127.0.0.1:1"]
    assert b.list() == [f"mooncake/ram/127.0.0.1:{closed}", "mooncake/unrelated/key"]


def test_entry_re_registered_after_the_probe_is_kept() -> None:
    """If a segment re-registers between scan and delete, its new entry survives."""

    class Racing(MemoryBackend):
        def delete(self, key: str) -> None:  # noqa: D102 - the race happens right before the first delete
            if not getattr(self, "raced", False):
                self.raced = True
                self.put("mooncake/rpc_meta/127.0.0.1:2", b'{"ip_or_host_name":"127.0.0.1","rpc_port":3}')
                if key == "mooncake/rpc_meta/127.0.0.1:2":
                    return
            super().delete(key)

    b = Racing()
    b.put("mooncake/rpc_meta/127.0.0.1:2", json.dumps({"ip_or_host_name": "127.0.0.1",
                                                       "rpc_port": free_port()}).encode())
    b.put("mooncake/ram/127.0.0.1:2", json.dumps({"tcp_data_port": free_port()}).encode())
    report = collect_garbage(b, apply=True, timeout=0.5)
    assert report.kept == ["mooncake/rpc_meta/127.0.0.1:2"]
    assert report.deleted == ["mooncake/ram/127.0.0.1:2"]
    assert b.get("mooncake/rpc_meta/127.0.0.1:2") == b'{"ip_or_host_name":"127.0.0.1","rpc_port":3}'
