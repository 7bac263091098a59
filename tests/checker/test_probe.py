"""``--probe``: live checks against a REAL mooncake_master, metadata servers and a real pool holder."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from checker_cases import CONFIG

from mooncake_vllm.checker import probe, run_check
from mooncake_vllm.services import ManagedProcess, free_port, start_holder, start_http_metadata, start_master
from tests.conftest import TEST_CLIENT_TTL


def _probe_ids(tmp_path: Path, config: dict[str, Any], **kwargs: Any) -> dict[str, list[str]]:
    path = tmp_path / f"mooncake-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(config))
    result, _ = run_check([path], target_vllm="0.32.0", target_mooncake="0.3.13.post1", probe=True, **kwargs)
    found: dict[str, list[str]] = {}
    for f in result.findings:
        found.setdefault(f.id, []).append(f.message)
    return found


def _closed_port() -> int:
    return free_port()  # free = nobody listens there


def test_master_and_metadata_reachable(tmp_path: Path, mooncake_master: ManagedProcess, metadata_url: str) -> None:
    up = _probe_ids(tmp_path, {**CONFIG, "master_server_address": mooncake_master.address,
                               "metadata_server": metadata_url})
    assert "MCV-E101" not in up and "MCV-E102" not in up
    down = _probe_ids(tmp_path, {**CONFIG, "master_server_address": f"127.0.0.1:{_closed_port()}",
                                 "metadata_server": f"http://127.0.0.1:{_closed_port()}/metadata"})
    assert "MCV-E101" in down and "MCV-E102" in down
    assert "refused" in down["MCV-E101"][0].lower()


def test_probes_are_opt_in(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({**CONFIG, "master_server_address": f"127.0.0.1:{_closed_port()}"}))
    result, _ = run_check([path], target_vllm="0.32.0", target_mooncake="0.3.13.post1")
    assert not [f for f in result.findings if f.rule.probe]


def test_etcd_metadata_reachable(tmp_path: Path, etcd_server: str) -> None:
    assert "MCV-E102" not in _probe_ids(tmp_path, {**CONFIG, "metadata_server": f"etcd://{etcd_server}"})
    assert "MCV-E102" in _probe_ids(tmp_path, {**CONFIG, "metadata_server": f"127.0.0.1:{_closed_port()}"})


def test_stale_metadata_of_a_killed_holder(tmp_path: Path, workdir: Path, mooncake_master: ManagedProcess) -> None:
    """A real mooncake_client registers in a listable metadata server; after SIGKILL its entries are stale."""
    meta = start_http_metadata(workdir, "embedded")  # mooncake-vllm's server: lists keys
    try:
        holder = start_holder(workdir, mooncake_master.address, meta.url, 64 << 20, 16 << 20)
        config = {**CONFIG, "master_server_address": mooncake_master.address, "metadata_server": meta.url}
        alive = _probe_ids(tmp_path, config)
        assert "MCV-W101" not in alive and "MCV-E102" not in alive
        holder.kill()
        holder.stop()
        stale = _probe_ids(tmp_path, config)
        assert "MCV-W101" in stale, stale
        assert holder.address.split(":")[0] in stale["MCV-W101"][0]
    finally:
        meta.stop()


def test_rdma_devices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    present = os.listdir(probe.IB_SYSFS) if os.path.isdir(probe.IB_SYSFS) else []
    rdma = {**CONFIG, "protocol": "rdma", "device_name": "mcv_missing_0"}
    found = _probe_ids(tmp_path, rdma)
    assert "MCV-E103" in found  # this host: no such device (and on this CI box no RDMA at all)
    assert ("no RDMA devices" in found["MCV-E103"][0]) == (not present)
    assert "MCV-E103" not in _probe_ids(tmp_path, CONFIG)  # tcp needs none
    fake = tmp_path / "infiniband"
    (fake / "mlx5_0").mkdir(parents=True)
    monkeypatch.setattr(probe, "IB_SYSFS", str(fake))
    assert "MCV-E103" not in _probe_ids(tmp_path, {**rdma, "device_name": "mlx5_0"})


def test_p2p_half_without_rdma_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MCV-E105: the seed's MultiConnector P2P half asks for rdma by default; no device -> tcp."""
    from checker_cases import multi, serve

    def ids(kv: str, target: str = "0.24.0") -> dict[str, str]:
        d = tmp_path / f"p2p-{time.monotonic_ns()}"
        d.mkdir()
        (d / "launch.sh").write_text(serve(kv))
        (d / "mooncake.json").write_text(json.dumps(CONFIG))
        result, _ = run_check([d], target_vllm=target, target_mooncake="0.3.13.post1", probe=True)
        return {f.id: f.fix for f in result.findings}

    monkeypatch.setattr(probe, "IB_SYSFS", str(tmp_path / "no-infiniband"))
    seed = multi("kv_producer")
    found = ids(seed)
    assert "MCV-E105" in found and '"mooncake_protocol": "tcp"' in found["MCV-E105"]
    assert "vLLM >= 0.24.0" in ids(seed, target="0.20.0")["MCV-E105"]  # not read there: no key helps
    doc = json.loads(seed)
    doc["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"] = {"mooncake_protocol": "tcp"}
    assert "MCV-E105" not in ids(json.dumps(doc))
    fake = tmp_path / "infiniband"
    (fake / "mlx5_0").mkdir(parents=True)
    monkeypatch.setattr(probe, "IB_SYSFS", str(fake))
    assert "MCV-E105" not in ids(seed)  # an RDMA host runs the seed as written


def test_local_hostname(tmp_path: Path) -> None:
    assert "MCV-W102" not in _probe_ids(tmp_path, {**CONFIG, "local_hostname": "127.0.0.1"})
    assert "MCV-W102" not in _probe_ids(tmp_path, {**CONFIG, "local_hostname": "localhost:12345"})
    assert "MCV-W102" in _probe_ids(tmp_path, {**CONFIG, "local_hostname": "192.0.2.77"})  # TEST-NET-1


def test_installed_mooncake_libraries_resolve(tmp_path: Path) -> None:
    directory = probe.mooncake_package_dir()
    assert directory is not None and list(directory.glob("*.so"))
    assert probe.missing_libraries(directory) == {}
    assert "MCV-E104" not in _probe_ids(tmp_path, CONFIG)


def test_missing_library_is_found(tmp_path: Path) -> None:
    """A real shared object whose dependency is gone, as ldd sees it."""
    dep, ext = tmp_path / "libmcvgone.so", tmp_path / "broken" / "engine.so"
    ext.parent.mkdir()
    (tmp_path / "d.c").write_text("int gone(void) { return 1; }\n")
    (tmp_path / "e.c").write_text("int gone(void); int use(void) { return gone(); }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(dep), str(tmp_path / "d.c")], check=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(ext), str(tmp_path / "e.c"), f"-L{tmp_path}", "-lmcvgone"],
                   check=True)
    dep.unlink()
    assert probe.missing_libraries(ext.parent) == {"engine.so": ["libmcvgone.so"]}
    assert "libibverbs1" in probe.library_fix(["libibverbs.so.1"])
    assert "-non-cuda" in probe.library_fix(["libcudart.so.12"])


def test_missing_library_fails_the_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MCV-E104 at the rule level: an extension directory with a real .so whose dependency is gone."""
    dep, ext = tmp_path / "libmcvgone.so", tmp_path / "mooncake" / "store.so"
    ext.parent.mkdir()
    (tmp_path / "d.c").write_text("int gone(void) { return 1; }\n")
    (tmp_path / "e.c").write_text("int gone(void); int use(void) { return gone(); }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(dep), str(tmp_path / "d.c")], check=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(ext), str(tmp_path / "e.c"), f"-L{tmp_path}", "-lmcvgone",
                    f"-Wl,-rpath,{tmp_path}"], check=True)
    monkeypatch.setattr(probe, "mooncake_package_dir", lambda: ext.parent)
    assert "MCV-E104" not in _probe_ids(tmp_path, CONFIG)  # the dependency is still there
    dep.unlink()
    found = _probe_ids(tmp_path, CONFIG)
    assert "MCV-E104" in found and "libmcvgone.so" in found["MCV-E104"][0] and "store.so" in found["MCV-E104"][0]


def test_live_master_with_a_short_client_ttl(tmp_path: Path, workdir: Path, mooncake_master: ManagedProcess) -> None:
    """The REAL running master's --client_ttl (TEST_CLIENT_TTL here) is read from its command line
    (issue 13 item 5c)."""
    short = _probe_ids(tmp_path, {**CONFIG, "master_server_address": mooncake_master.address})
    assert "MCV-W103" in short and f"pid {mooncake_master.pid}" in short["MCV-W103"][0] \
        and f"{TEST_CLIENT_TTL} s" in short["MCV-W103"][0]
    calm = start_master(workdir, client_ttl=10, name="calm_master")
    try:
        assert "MCV-W103" not in _probe_ids(tmp_path, {**CONFIG, "master_server_address": calm.address})
    finally:
        calm.stop()


def test_live_pool_in_one_holder(tmp_path: Path, workdir: Path, mooncake_master: ManagedProcess,
                                 pool_holder: ManagedProcess, metadata_url: str) -> None:
    """The REAL master lists one mounted segment: the whole pool is one process; a second holder: quiet."""
    config = {**CONFIG, "master_server_address": mooncake_master.address, "metadata_server": metadata_url}
    one = _probe_ids(tmp_path, config)
    assert "MCV-W104" in one and mooncake_master.url in one["MCV-W104"][0]
    second = start_holder(workdir, mooncake_master.address, metadata_url, 64 << 20, 16 << 20, name="holder_2")
    try:
        assert "MCV-W104" not in _probe_ids(tmp_path, config)
    finally:
        second.stop()


def test_live_namespaces_split(tmp_path: Path, local_stack: Any) -> None:
    """MCV-W105 names a model whose namespaces differ in block size in the REAL pool; a split by
    tenant only (on purpose) and a model with one namespace stay quiet."""
    from mooncake_vllm.config import load_store_config
    from mooncake_vllm.keys import KeyNamespace
    from mooncake_vllm.store import StoreClient
    from mooncake_vllm.store.namespaces import register_namespaces

    config = json.loads(Path(local_stack.config_path).read_text())
    quiet = [KeyNamespace("probe-llama", "float32", "cpu:float32:L2:2x32x64", 32),
             KeyNamespace("probe-llama", "float32", "cpu:float32:L2:2x32x64", 32, tenant="b")]
    with StoreClient.connect(load_store_config(local_stack.config_path)) as client:
        register_namespaces(client, quiet)
        assert "MCV-W105" not in _probe_ids(tmp_path, config)
        register_namespaces(client, [KeyNamespace("probe-llama", "float32", "cpu:float32:L2:2x16x64", 16)])
    found = _probe_ids(tmp_path, config)["MCV-W105"]
    assert len(found) == 1 and "2 namespaces for model probe-llama: differ in block_size (16 vs 32)" \
        in found[0] and "never share KV" in found[0]


def test_live_pool_without_the_disk_tier_a_config_asks_for(tmp_path: Path, mooncake_master: ManagedProcess) -> None:
    """MCV-W106 on a REAL master started without --enable_offload (tests/services/test_tier.py: quiet with it)."""
    config = {**CONFIG, "master_server_address": mooncake_master.address, "global_segment_size": "0"}
    assert "MCV-W106" not in _probe_ids(tmp_path, config)
    found = _probe_ids(tmp_path, {**config, "enable_ssd_offload": True})["MCV-W106"]
    assert "master_total_file_capacity_bytes 0" in found[0]
