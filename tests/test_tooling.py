"""The lint and type check that ``scripts/dev.sh test`` runs first, as tests: a config
drift (a rule, a path, a pin) fails here too, also when pytest is run on its own."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    beside = Path(sys.executable).with_name(name)  # the venv's own, as dev.sh runs it
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pinned in requirements/test.txt)")
    return found


def test_ruff_check_passes() -> None:
    res = subprocess.run([_tool("ruff"), "check", "--no-cache", "src", "tests", "bench", "scripts"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]


def test_mypy_passes_on_the_runtime_layers() -> None:
    res = subprocess.run([_tool("mypy")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
