"""``--fix OUTDIR``: the migrated V1 config and launch script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from checker_cases import CONFIG, DATA, serve

from mooncake_vllm.checker import run_check
from mooncake_vllm.checker.fix import CONFIG_NAME, SCRIPT_NAME, check_outdir, migrated_config, write_migration
from mooncake_vllm.checker.parse import parse_shell
from mooncake_vllm.errors import ConfigError


def _ctx(*paths: Path, vllm: str = "0.32.0"):  # noqa: ANN202
    return run_check(paths, target_vllm=vllm, target_mooncake="0.3.13.post1")[1]


def _instances(script: str) -> list:
    return [launch for launch in parse_shell(script, "launch_v1.sh") if launch.kind == "vllm"]


def test_seed_v0_migrates_to_multiconnector_on_rdma(tmp_path: Path) -> None:
    ctx = _ctx(DATA / "seed_v0" / "xpyd.sh", DATA / "seed_v0" / "mooncake-rdma.json")
    written = write_migration(ctx, tmp_path / "out")
    assert [Path(p).name for p in written] == [CONFIG_NAME, SCRIPT_NAME]
    config = json.loads((tmp_path / "out" / CONFIG_NAME).read_text())
    assert config["metadata_server"] == "etcd://192.168.0.137:2379" and config["protocol"] == "rdma"
    assert config["global_segment_size"] == 3355443200 and config["mode"] == "embedded"
    script = (tmp_path / "out" / SCRIPT_NAME).read_text()
    assert os.access(tmp_path / "out" / SCRIPT_NAME, os.X_OK)
    subprocess.run(["bash", "-n", str(tmp_path / "out" / SCRIPT_NAME)], check=True)  # valid bash
    instances = _instances(script)
    assert len(instances) == 4 and all("VLLM_USE_V1" not in i.prefix_env for i in instances)
    assert [i.prefix_env.get("CUDA_VISIBLE_DEVICES") for i in instances] == [None, "1", "4", "5"]
    assert all(i.kv_config["kv_connector"] == "MultiConnector" for i in instances)
    store = instances[0].kv_config["kv_connector_extra_config"]["connectors"][1]
    assert store["kv_connector_module_path"] == "mooncake_vllm.compat.facade"
    assert "mooncake-vllm proxy --model Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4 --prefill localhost:8100@8998" in script
    assert "disagg_proxy_demo" not in script.split("# proxy", 1)[1].split("\n", 2)[1]


def test_tcp_deployment_stays_store_only(tmp_path: Path) -> None:
    ctx = _ctx(DATA / "seed_v0" / "xpyd.sh", DATA / "seed_v0" / "mooncake-tcp.json")
    write_migration(ctx, tmp_path)
    script = (tmp_path / SCRIPT_NAME).read_text()
    roles = [i.kv_config["kv_role"] for i in _instances(script)]
    assert roles == ["kv_producer", "kv_producer", "kv_consumer", "kv_consumer"]
    assert all(i.kv_config["kv_connector"] == "MooncakeStoreConnector" for i in _instances(script))
    assert "--flow p2p" not in script and "--prefill localhost:8100 localhost:8101" in script


def test_migrated_output_passes_the_check(tmp_path: Path) -> None:
    ctx = _ctx(DATA / "seed_v0" / "xpyd.sh", DATA / "seed_v0" / "mooncake-tcp.json")
    write_migration(ctx, tmp_path / "out")
    result, _ = run_check([tmp_path / "out"], target_vllm="0.32.0", target_mooncake="0.3.13.post1")
    assert result.exit_code == 0, [f.message for f in result.findings]


def test_segment_zero_gets_a_holder_and_standalone_mode(tmp_path: Path) -> None:
    ctx = _ctx(DATA / "seed_v1")
    write_migration(ctx, tmp_path)
    assert json.loads((tmp_path / CONFIG_NAME).read_text())["mode"] == "standalone-store"
    assert 'mooncake-vllm holder --config "$MOONCAKE_CONFIG_PATH"' in (tmp_path / SCRIPT_NAME).read_text()
    result, _ = run_check([tmp_path], target_vllm="0.32.0", target_mooncake="0.3.13.post1")
    assert "MCV-E009" not in {f.id for f in result.findings}


def test_old_targets_get_no_mode_and_a_shared_seed(tmp_path: Path) -> None:
    ctx = _ctx(DATA / "seed_v0" / "xpyd.sh", DATA / "seed_v0" / "mooncake-tcp.json", vllm="0.11.1")
    assert "mode" not in migrated_config(ctx)
    write_migration(ctx, tmp_path)
    assert "export PYTHONHASHSEED=0" in (tmp_path / SCRIPT_NAME).read_text()


def test_admin_key_is_required_not_copied(tmp_path: Path) -> None:
    ctx = _ctx(DATA / "seed_v0" / "dynamic.sh", DATA / "seed_v0" / "xpyd.sh", DATA / "seed_v0" / "mooncake-tcp.json")
    write_migration(ctx, tmp_path)
    script = (tmp_path / SCRIPT_NAME).read_text()
    assert "xxxxxxxx" not in script and "${ADMIN_API_KEY:?" in script


def test_never_overwrites_without_force(tmp_path: Path) -> None:
    ctx = _ctx(DATA / "seed_v1")
    (tmp_path / SCRIPT_NAME).write_text("mine\n")
    with pytest.raises(ConfigError, match="--force"):
        write_migration(ctx, tmp_path)
    assert (tmp_path / SCRIPT_NAME).read_text() == "mine\n" and not (tmp_path / CONFIG_NAME).exists()
    notes: list[str] = []
    write_migration(ctx, tmp_path, force=True, notes=notes)
    assert (tmp_path / SCRIPT_NAME).read_text().startswith("#!/usr/bin/env bash")
    assert (tmp_path / f"{SCRIPT_NAME}.bak").read_text() == "mine\n"  # --force keeps what it replaced
    assert notes == [f"kept the previous {tmp_path / SCRIPT_NAME} as {tmp_path / SCRIPT_NAME}.bak"]
    # no temp files left
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([CONFIG_NAME, SCRIPT_NAME, f"{SCRIPT_NAME}.bak"])
    write_migration(ctx, tmp_path, force=True)  # a second backup never replaces the first
    assert {p.name for p in tmp_path.iterdir()} >= {f"{CONFIG_NAME}.bak", f"{SCRIPT_NAME}.bak.1"}
    assert (tmp_path / f"{SCRIPT_NAME}.bak").read_text() == "mine\n"


def test_outdir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        check_outdir(tmp_path / "f", force=True)


def test_cli_fix_and_force(tmp_path: Path) -> None:
    cli = Path(sys.executable).parent / "mooncake-vllm"
    src = tmp_path / "src"
    src.mkdir()
    (src / "mooncake.json").write_text(json.dumps(CONFIG))
    (src / "run.sh").write_text(serve(env="MOONCAKE_CONFIG_PATH=mooncake.json VLLM_USE_V1=0"))
    args = [str(cli), "check", str(src), "--target-vllm", "0.32.0", "--fix", str(tmp_path / "out")]
    first = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert first.returncode == 3 and "wrote" in first.stderr  # findings of the INPUT, files written
    again = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "--force" in again.stderr and again.stdout == ""
    forced = subprocess.run(args + ["--force"], capture_output=True, text=True, timeout=60)
    assert forced.returncode == 3


def test_outputs_never_widen_the_inputs_modes(tmp_path: Path) -> None:
    """A 0600 config with a redis password stays 0600; a 0700 script's HF_TOKEN does not land in a
    world-readable 0755 script (issue 13 item 12)."""
    src = tmp_path / "src"
    src.mkdir()
    config = src / "mooncake.json"
    config.write_text(json.dumps({**CONFIG, "metadata_server": "redis://:hunter2@127.0.0.1:6379"}))
    script = src / "run.sh"
    script.write_text(serve(env="MOONCAKE_CONFIG_PATH=mooncake.json HF_TOKEN=hf_secret"))
    config.chmod(0o600)
    script.chmod(0o700)
    out = tmp_path / "out"
    write_migration(_ctx(src), out)
    assert "hf_secret" in (out / SCRIPT_NAME).read_text()
    assert "hunter2" in (out / CONFIG_NAME).read_text()
    assert (out / CONFIG_NAME).stat().st_mode & 0o777 == 0o600
    assert (out / SCRIPT_NAME).stat().st_mode & 0o777 == 0o700
    # group-readable inputs: group may read (and run) the outputs, others may not
    config.chmod(0o640)
    script.chmod(0o750)
    write_migration(_ctx(src), tmp_path / "out2")
    assert (tmp_path / "out2" / CONFIG_NAME).stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "out2" / SCRIPT_NAME).stat().st_mode & 0o777 == 0o750
    # --force onto a narrower existing file keeps it narrow
    config.chmod(0o644)
    script.chmod(0o755)
    notes: list[str] = []
    write_migration(_ctx(src), out, force=True, notes=notes)
    assert (out / CONFIG_NAME).stat().st_mode & 0o777 == 0o600
    assert (out / SCRIPT_NAME).stat().st_mode & 0o777 == 0o700
    assert (out / f"{CONFIG_NAME}.bak").stat().st_mode & 0o777 == 0o600 and len(notes) == 2


def test_seed_v1_p2p_half_gets_tcp_without_an_rdma_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MCV-E105's fix: the P2P child's own Transfer Engine on TCP; a plain store instance beside
    the pairs keys by their HND layout (MCV-W031)."""
    from mooncake_vllm.checker import probe

    monkeypatch.setattr(probe, "IB_SYSFS", str(tmp_path / "none"))
    ctx = _ctx(DATA / "seed_v1", vllm="0.24.0")
    write_migration(ctx, tmp_path / "out")
    script = (tmp_path / "out" / SCRIPT_NAME).read_text()
    pairs = [i for i in _instances(script) if i.kv_config["kv_connector"] == "MultiConnector"]
    assert len(pairs) == 2
    for launch in pairs:
        p2p = launch.kv_config["kv_connector_extra_config"]["connectors"][0]
        assert p2p["kv_connector_extra_config"] == {"mooncake_protocol": "tcp"}
    plain = [i for i in _instances(script) if i.kv_config["kv_connector"] == "MooncakeStoreConnector"]
    assert plain and all(i.prefix_env.get("VLLM_KV_CACHE_LAYOUT") == "HND" for i in plain)
    assert "--prefill 192.168.0.2:8100@50052" in script
    result, _ = run_check([tmp_path / "out"], target_vllm="0.24.0", target_mooncake="0.3.13.post1", probe=True)
    assert not {"MCV-E105", "MCV-W031"} & {f.id for f in result.findings}
    (tmp_path / "ib" / "mlx5_0").mkdir(parents=True)
    monkeypatch.setattr(probe, "IB_SYSFS", str(tmp_path / "ib"))
    write_migration(_ctx(DATA / "seed_v1", vllm="0.24.0"), tmp_path / "rdma")
    assert "mooncake_protocol" not in (tmp_path / "rdma" / SCRIPT_NAME).read_text()
