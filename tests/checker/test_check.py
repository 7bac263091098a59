"""The whole check: the seed's examples, the CLI's exit codes, output formats and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from checker_cases import CONFIG, DATA, OURS, serve

from mooncake_vllm.checker import render, run_check

V0, V1 = DATA / "seed_v0", DATA / "seed_v1"
CLI = Path(sys.executable).parent / "mooncake-vllm"  # the console script users run


def _ids(*paths: Path, vllm: str = "0.32.0") -> Counter[str]:
    result, _ = run_check(paths, target_vllm=vllm, target_mooncake="0.3.13.post1")
    return Counter(f.id for f in result.findings)


def _cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLI), "check", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, cwd=cwd, timeout=60)


def test_seed_v0_example_against_vllm_0_32() -> None:
    result, _ = run_check([V0], target_vllm="0.32.0", target_mooncake="0.3.13.post1")
    ids = Counter(f.id for f in result.findings)
    # 4 V0 instances (VLLM_USE_V1=0) on a vLLM without V0; cold pool; demo proxies; open admin API; unpinned wheel
    assert ids == Counter({"MCV-E001": 4, "MCV-W010": 2, "MCV-W009": 1, "MCV-W011": 1, "MCV-W014": 1})
    where = sorted(str(f.where).rsplit("/", 1)[-1] for f in result.findings if f.id == "MCV-E001")
    assert where == ["xpyd.sh:13", "xpyd.sh:21", "xpyd.sh:28", "xpyd.sh:6"]
    admin = [str(f.where) for f in result.findings if f.id == "MCV-W011"]
    assert admin == [f"{V0 / 'xpyd.sh'}:36"]  # dynamic.sh exports ADMIN_API_KEY
    assert result.exit_code == 3


def test_seed_v0_example_on_its_own_release() -> None:
    assert _ids(V0, vllm="0.10.0") == Counter({"MCV-W011": 1, "MCV-W014": 1})


def test_seed_v1_example_against_vllm_0_32() -> None:
    ids = _ids(V1)
    # pool held by nobody (segment "0"), rdma without device, name ambiguity x3 instances, example P2P proxy,
    # and kv_both.sh's plain instance shares xpyd.sh's pool but keys NHD where the P2P pairs' KV is HND
    assert ids == Counter({"MCV-E009": 1, "MCV-W002": 1, "MCV-W008": 3, "MCV-W010": 1, "MCV-W031": 1})


def test_seed_v1_example_on_a_vllm_without_p2p_connector() -> None:
    ids = _ids(V1, vllm="0.10.0")
    assert {"MCV-E012", "MCV-W003", "MCV-E009", "MCV-W002"} <= set(ids)
    assert "MCV-W008" not in ids  # no in-tree MooncakeStoreConnector before 0.21


def _clean(tmp_path: Path) -> Path:
    d = tmp_path / "clean"
    d.mkdir()
    (d / "mooncake.json").write_text(json.dumps(CONFIG))
    (d / "run.sh").write_text(serve(OURS))
    return d


def test_cli_exit_codes_and_all_clear(tmp_path: Path) -> None:
    clean = _clean(tmp_path)
    ok = _cli(str(clean), "--target-vllm", "0.32.0", "--target-mooncake", "0.3.13.post1")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "All clear" in ok.stdout
    (clean / "proxy.sh").write_text("python3 disagg_proxy_demo.py --model m -p h:1 -d h:2\n")
    warn = _cli(str(clean), "--target-vllm", "0.32.0", "--target-mooncake", "0.3.13.post1")
    assert warn.returncode == 2 and "MCV-W011" in warn.stdout
    assert _cli(str(V0), "--target-vllm", "0.32.0").returncode == 3


def test_ignore(tmp_path: Path) -> None:
    clean = _clean(tmp_path)
    (clean / "proxy.sh").write_text("python3 disagg_proxy_demo.py --model m -p h:1 -d h:2\n")
    args = [str(clean), "--target-vllm", "0.32.0", "--target-mooncake", "0.3.13.post1"]
    assert _cli(*args, "--ignore", "MCV-W011", "--ignore", "legacy-proxy").returncode == 0
    bad = _cli(*args, "--ignore", "MCV-W999")
    assert bad.returncode == 1 and "MCV-W999" in bad.stderr and bad.stdout == ""


def test_json_schema_is_stable() -> None:
    out = _cli(str(V0), "--target-vllm", "0.32.0", "--format", "json")
    doc = json.loads(out.stdout)
    assert doc["schema"] == "mooncake-vllm-check/1"
    assert doc["summary"]["exit_code"] == out.returncode == 3
    for finding in doc["findings"]:
        assert set(finding) == {"id", "severity", "name", "message", "why", "fix", "where", "reference"}
        assert finding["severity"] in ("error", "warning") and finding["fix"] and finding["reference"]


def test_markdown_output() -> None:
    out = _cli(str(V1), "--target-vllm", "0.32.0", "--format", "markdown")
    assert out.stdout.startswith("# mooncake-vllm check")
    assert "### `MCV-E009`" in out.stdout and "- **Fix:**" in out.stdout


def test_environment_mode(tmp_path: Path) -> None:
    cfg = tmp_path / "mc.json"
    cfg.write_text(json.dumps({**CONFIG, "metadata_server": "redis://127.0.0.1:6379"}))
    result, _ = run_check([], target_vllm="0.32.0", env={"VLLM_USE_V1": "0", "MOONCAKE_CONFIG_PATH": str(cfg)})
    assert {f.id for f in result.findings} >= {"MCV-E001", "MCV-W012"}
    missing = _cli("--target-vllm", "0.32.0", env={"MOONCAKE_CONFIG_PATH": str(tmp_path / "nope.json")})
    assert missing.returncode == 1 and "MOONCAKE_CONFIG_PATH" in missing.stderr


def _bad_inputs(tmp_path: Path) -> dict[str, Path]:
    bad = {}
    bad["json"] = tmp_path / "mooncake.json"
    bad["json"].write_text('{"metadata_server": "http://x/metadata",}')
    bad["binary"] = tmp_path / "junk.sh"
    bad["binary"].write_bytes(os.urandom(4096) + b"\x00\xff\xfe")
    bad["huge"] = tmp_path / "huge.sh"
    with open(bad["huge"], "wb") as fh:  # a sparse 100 MB file: nothing is read
        fh.truncate(100 << 20)
    bad["dangling"] = tmp_path / "gone.sh"
    bad["dangling"].symlink_to(tmp_path / "does-not-exist.sh")
    bad["missing"] = tmp_path / "missing-dir"
    bad["quote"] = tmp_path / "quote.sh"
    bad["quote"].write_text("vllm serve m --kv-transfer-config '{\"kv_role\": 1}\n")
    return bad


@pytest.mark.parametrize("kind", ["json", "binary", "huge", "dangling", "missing", "quote"])
def test_bad_input_is_one_clear_error_and_writes_nothing(kind: str, tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    path = _bad_inputs(inputs)[kind]
    out = tmp_path / "out"
    res = _cli(str(path), "--target-vllm", "0.32.0", "--fix", str(out))
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stdout == ""
    assert str(path) in res.stderr and res.stderr.count("mooncake-vllm check:") == 1
    assert "fix:" in res.stderr
    assert not out.exists()


def test_bad_files_in_a_directory_are_reported_together(tmp_path: Path) -> None:
    bad = _bad_inputs(tmp_path)
    res = _cli(str(tmp_path), "--target-vllm", "0.32.0")
    assert res.returncode == 1
    for kind in ("json", "binary", "huge", "dangling"):
        assert str(bad[kind]) in res.stderr, kind


def test_bad_target_version(tmp_path: Path) -> None:
    res = _cli(str(_clean(tmp_path)), "--target-vllm", "banana")
    assert res.returncode == 1 and "banana" in res.stderr
    (tmp_path / "x").mkdir()
    old = _cli(str(_clean(tmp_path / "x")), "--target-vllm", "0.7.3")
    assert old.returncode == 1 and "0.8.3" in old.stderr


def test_targets_newer_than_the_tables_are_flagged(tmp_path: Path) -> None:
    result, _ = run_check([_clean(tmp_path)], target_vllm="0.40.0", target_mooncake="0.3.13.post1")
    assert result.beyond_reference == ["vLLM 0.40.0"]
    assert "newer than the version tables: vLLM 0.40.0" in render(result)


def test_list_rules() -> None:
    res = _cli("--list-rules")
    assert res.returncode == 0 and "MCV-E001" in res.stdout and "(--probe)" in res.stdout


def test_installed_versions_are_the_default(tmp_path: Path) -> None:
    result, ctx = run_check([_clean(tmp_path)])
    from importlib import metadata

    assert ctx.vllm is not None and ctx.vllm_origin.startswith("installed vllm")
    assert ctx.vllm.version == metadata.version(ctx.vllm_origin.split()[-1])
    assert ctx.mooncake is not None and ctx.mooncake_origin.startswith("installed mooncake-transfer-engine")


def test_check_never_imports_vllm_or_mooncake() -> None:
    code = (f"import sys; from mooncake_vllm.cli import main; rc = main(['check', {str(V0)!r}, '--format', 'json']);"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'mooncake', 'torch')];"
            "sys.stderr.write(repr(bad)); sys.exit(0 if not bad else 9)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-500:]


def test_directory_walk_reads_only_regular_files_inside_it(tmp_path: Path) -> None:
    """A FIFO named start.sh must not hang the check, a run.sh -> /dev/zero must not exhaust memory, and
    symlinks (files or directories) out of the scanned directory are not followed (issue 13 item 11)."""
    d, outside = tmp_path / "deploy", tmp_path / "elsewhere"
    d.mkdir()
    outside.mkdir()
    (d / "launch.sh").write_text(serve())
    (d / "mooncake.json").write_text(json.dumps(CONFIG))
    (outside / "secret.sh").write_text("vllm serve outside-model &\n")
    (d / "other.sh").symlink_to(outside / "secret.sh")
    (d / "linked").symlink_to(outside, target_is_directory=True)
    (d / "same.sh").symlink_to(d / "launch.sh")  # inside: read once, as itself
    (d / "run.sh").symlink_to("/dev/zero")
    os.mkfifo(d / "start.sh")
    res = _cli(str(d), "--target-vllm", "0.32.0", "--format", "json")  # a hang ends in TimeoutExpired
    assert res.returncode == 1, res.stdout + res.stderr
    assert "MemoryError" not in res.stderr
    assert f"{d / 'start.sh'}" in res.stderr and "not a regular file" in res.stderr
    assert f"{d / 'run.sh'}" in res.stderr and f"{d / 'other.sh'}" in res.stderr
    assert "secret.sh" in res.stderr and "linked" not in res.stderr  # the directory link is not entered
    for name in ("run.sh", "start.sh", "other.sh"):
        (d / name).unlink()
    result, _ = run_check([d], target_vllm="0.32.0", target_mooncake="0.3.13.post1")
    assert sorted(result.inputs) == sorted([str(d / "launch.sh"), str(d / "mooncake.json")])


@pytest.mark.parametrize("special", ["fifo", "dev-zero"])
def test_explicit_non_regular_file_is_one_clear_error(special: str, tmp_path: Path) -> None:
    path = tmp_path / "start.sh"
    if special == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    res = _cli(str(path), "--target-vllm", "0.32.0")
    assert res.returncode == 1 and "not a regular file" in res.stderr, res.stderr


def test_size_limit_holds_on_the_bytes_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc files say st_size 0 but have content: the limit counts what was read."""
    from mooncake_vllm.checker import parse
    from mooncake_vllm.errors import ConfigError

    monkeypatch.setattr(parse, "MAX_INPUT_BYTES", 64)
    assert Path("/proc/self/maps").stat().st_size == 0
    with pytest.raises(ConfigError, match="larger than"):
        run_check(["/proc/self/maps"], target_vllm="0.32.0", target_mooncake="0.3.13.post1")
