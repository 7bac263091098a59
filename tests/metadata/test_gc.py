"""Stale-entry cleanup: a SIGKILLed client's entries are found and removed while the pool keeps serving."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import pytest

from mooncake_vllm.metadata.backends import MemoryBackend, backend_for
from mooncake_vllm.metadata.gc import ALIVE, DEAD, UNKNOWN, collect_garbage, probe, scan
from tests.md_services import child_env, free_port


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

    applied = _cli("gc", "--metadata", url, "--apply", "--grace", "0.5")
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
    report = collect_garbage(b, apply=True, timeout=0.5, grace=0.1)
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
    report = collect_garbage(b, apply=True, timeout=0.5, grace=0.1)
    assert report.kept == ["mooncake/rpc_meta/127.0.0.1:2"]
    assert report.deleted == ["mooncake/ram/127.0.0.1:2"]
    assert b.get("mooncake/rpc_meta/127.0.0.1:2") == b'{"ip_or_host_name":"127.0.0.1","rpc_port":3}'


# -- a living client is never deleted (issue 13 item 10) ----------------------------------------------------------
def _listener(port: int = 0, backlog: int = 16) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(backlog)
    return s


def _segment(b: MemoryBackend, name: str, port: int) -> set[str]:
    """A client's two entries (rpc_meta and ram) pointing at ``port``; returns the keys."""
    b.put(f"mooncake/rpc_meta/{name}", json.dumps({"ip_or_host_name": "127.0.0.1", "rpc_port": port}).encode())
    b.put(f"mooncake/ram/{name}", json.dumps({"name": name, "tcp_data_port": port}).encode())
    return {f"mooncake/rpc_meta/{name}", f"mooncake/ram/{name}"}


def test_an_owner_whose_accept_queue_is_full_is_unknown_not_dead() -> None:
    """A real live listener that cannot accept (backlog full): connects time out. That is no proof of death."""
    busy = _listener(backlog=0)
    held = socket.create_connection(busy.getsockname())  # fills the accept queue: later SYNs are dropped
    try:
        assert "no answer" in (probe("127.0.0.1", busy.getsockname()[1], 0.3) or "")
        b = MemoryBackend()
        keys = _segment(b, "127.0.0.1:7", busy.getsockname()[1])
        [status] = scan(b, timeout=0.3)
        assert status.state == UNKNOWN, status
        report = collect_garbage(b, apply=True, timeout=0.3, grace=0.2)
        assert report.deleted == [] and set(b.list()) == keys
    finally:
        held.close()
        busy.close()


def test_deletion_needs_refusals_throughout_the_grace_period() -> None:
    """Dead at the first probe, back (same values) during the grace period: kept; a really dead one: deleted."""
    b = MemoryBackend()
    back_port, dead_port = free_port(), free_port()
    back = _segment(b, "127.0.0.1:8", back_port)
    dead = _segment(b, "127.0.0.1:9", dead_port)
    restarted: list[socket.socket] = []
    waits: list[float] = []

    def sleep(seconds: float) -> None:  # the client restarts on its old port while gc waits
        waits.append(seconds)
        if not restarted:
            restarted.append(_listener(back_port))

    try:
        report = collect_garbage(b, apply=True, timeout=0.5, grace=1.0, rounds=3, sleep=sleep)
    finally:
        for s in restarted:
            s.close()
    assert sum(waits) == pytest.approx(1.0) and len(waits) == 2  # 3 observations over the grace period
    assert set(report.deleted) == dead and set(report.kept) == back
    assert "alive on a later probe" in report.kept_why["mooncake/ram/127.0.0.1:8"]
    assert set(b.list()) == back


def test_restart_with_identical_values_just_before_the_delete_keeps_the_entries() -> None:
    """The owner comes back (same port, same values) right after the scan: the value check alone would pass;
    the re-probe immediately before the delete keeps its entries."""
    port = free_port()
    restarted: list[socket.socket] = []

    class RestartsAfterTheScan(MemoryBackend):
        gets = 0

        def get(self, key: str) -> bytes | None:  # noqa: D102
            self.gets += 1
            if self.gets == 3 and not restarted:  # the scan read both entries; the owner restarts now
                restarted.append(_listener(port))
            return super().get(key)

    b = RestartsAfterTheScan()
    keys = _segment(b, "127.0.0.1:10", port)
    try:
        report = collect_garbage(b, apply=True, timeout=0.5, grace=0, rounds=1)
    finally:
        for s in restarted:
            s.close()
    assert restarted and report.deleted == [] and set(report.kept) == keys
    assert set(b.list()) == keys


def test_restart_between_the_last_probe_and_the_delete_restores_the_entry() -> None:
    port = free_port()
    restarted: list[socket.socket] = []

    class RestartsDuringTheDelete(MemoryBackend):
        def delete(self, key: str) -> None:  # noqa: D102
            super().delete(key)
            if not restarted:
                restarted.append(_listener(port))

    b = RestartsDuringTheDelete()
    keys = _segment(b, "127.0.0.1:11", port)
    before = {k: b.get(k) for k in keys}
    try:
        report = collect_garbage(b, apply=True, timeout=0.5, grace=0, rounds=1)
    finally:
        for s in restarted:
            s.close()
    assert report.deleted == [] and {k: b.get(k) for k in keys} == before
    assert set(report.kept) == keys and any("restored" in report.kept_why[k] for k in keys)


def test_the_master_is_asked_first(pool_holder, mooncake_master) -> None:  # noqa: ANN001
    """A REAL master lists the holder's segment as mounted: its entries are kept even when TCP says refused."""
    import urllib.request

    with urllib.request.urlopen(f"{mooncake_master.url}/get_all_segments", timeout=5) as resp:
        [segment] = resp.read().decode().split()
    b = MemoryBackend()
    unreachable = _segment(b, segment, free_port())  # as seen from a gc host that cannot reach the holder
    dead = _segment(b, "127.0.0.1:12", free_port())
    statuses = {s.segment: s for s in scan(b, timeout=0.5, master=mooncake_master.url)}
    assert statuses[segment].state == ALIVE and "mounted on the master" in statuses[segment].reason
    report = collect_garbage(b, apply=True, timeout=0.5, master=mooncake_master.url, grace=0.2)
    assert set(report.deleted) == dead and set(b.list()) == unreachable
    # a master that was named but does not answer: nothing is deleted
    b2 = MemoryBackend()
    keys = _segment(b2, "127.0.0.1:13", free_port())
    silent = collect_garbage(b2, apply=True, timeout=0.5, master=f"http://127.0.0.1:{free_port()}", grace=0)
    assert silent.deleted == [] and set(b2.list()) == keys and silent.errors
