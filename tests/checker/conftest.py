"""Fixtures for the checker tests: write a small deployment, run the check, get rule IDs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mooncake_vllm.checker import run_check

CheckIds = Callable[..., set[str]]


@pytest.fixture
def check_ids(tmp_path: Path) -> CheckIds:
    """``check_ids(script=..., config={...}, target_vllm=..., ...)`` -> the set of rule IDs found."""
    counter = iter(range(1000))

    def run(script: str | None = None, config: dict[str, Any] | None = None, **kwargs: Any) -> set[str]:
        d = tmp_path / f"case{next(counter)}"
        d.mkdir()
        if script is not None:
            (d / "launch.sh").write_text(script)
        if config is not None:
            (d / "mooncake.json").write_text(json.dumps(config, indent=2))
        kwargs.setdefault("target_vllm", "0.32.0")
        kwargs.setdefault("target_mooncake", "0.3.13.post1")
        result, _ = run_check([d], **kwargs)
        return {f.id for f in result.findings}

    return run
